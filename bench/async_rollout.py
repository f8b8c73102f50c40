"""Asynchronous rollout side by side: the same GRPO workload synchronous (colocated, and on
two pools in turn) and with max_staleness K = 1 and K = 4 (docs/async.md).

Usage: python bench/async_rollout.py [--steps=6] [--warmup=3] [--runs=colocate,sync,k1,k4]
                                     [--layout=processes|threads]

Every run uses 2 simulated CPU devices: `colocate` puts every role on both; the others give
the rollout one device and the trainer the other ("gen=1:rollout;train=1:actor+ref+reward").
XLA runs each program on one thread (--xla_cpu_multi_thread_eigen=false).

- `--layout=processes` (the default): each run is `launch.local_cluster --num_processes=2
  --devices_per_process=1`, each process pinned to a core of its own (`sched_setaffinity`, as
  `taskset` does): the rollout pool on process 0, the trainer's on process 1, one schedule on
  one thread in each (docs/async.md, "Across processes"). Two pinned processes run at once,
  each at its one-core speed.
- `--layout=threads`: each run is one process with 2 devices, the rollout on a thread of its
  own. One process's programs on its simulated devices share the interpreter and the cores.

Per run: steps/s over the steps after `--warmup` (which compile, timed on process 0), the
seconds of generation per step (`timing_s/gen`), both pools' idle seconds per step (the loop's
`timing_s/idle/rollout` and `timing_s/idle/train`, docs/async.md "Metrics"; in the processes
layout each is measured on its own pool's process), the mean staleness,
the ratio to the synchronous two-pool run, and the planner's price of each two-pool run's step
(`hfjax.planner.simulator.async_step_seconds`, from the synchronous run's measured generation
and other stage times). The last line is JSON.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TWO_POOLS = "gen=1:rollout;train=1:actor+ref+reward"
RUNS = {"colocate": ("colocate", 0), "sync": (TWO_POOLS, 0), "k1": (TWO_POOLS, 1),
        "k4": (TWO_POOLS, 4)}


def workload(placement: str, k: int, steps: int, smoke: bool):
    """GRPO on the arithmetic task with a small model, sized so that generation and the rest
    of the step (rewards, advantages, the update) take comparable time on one CPU core."""
    from configs import ppo_arith

    c = ppo_arith.get_config()
    c.algorithm, c.algo.adv_estimator, c.placement = "grpo", "grpo", placement
    m = c.model
    m.hidden_size, m.intermediate_size, m.head_dim = 256, 512, 32
    m.num_layers, m.num_heads, m.num_kv_heads = 4, 8, 4
    # Logits over 512 ids (the task's 18 and unused ones, which decode to nothing): the
    # untrained policy draws its stop token about once in 512, so every response runs to the
    # response length, each step has the same widths (no timed step compiles) and generation
    # is as long as the rest of the step.
    m.vocab_size = 512
    c.data.n_train, c.data.n_test = 256, 16
    # Few rows and no reference: decoding is latency-bound (its time barely grows with the
    # rows), the update is not, so a small batch keeps the two sides comparable (measured:
    # generation 0.04 s, the rest 0.06 s per step in the synchronous two-pool run).
    c.data.train_batch_size = 1
    c.actor.use_kl_loss = c.algo.use_kl_in_reward = False
    c.rollout.n = 2
    c.rollout.response_length = 8 if smoke else 128
    c.actor.ppo_mini_batch_size = c.data.train_batch_size
    c.actor.ppo_micro_batch_size = c.data.train_batch_size * c.rollout.n
    c.actor.mesh = c.ref.mesh = "fsdp=-1"
    c.sft.steps = 0
    c.reward.num_processes = 0
    c.async_rollout.max_staleness = k
    c.trainer.total_steps = steps
    c.trainer.val_before_train = False
    c.trainer.test_freq = 0
    return c


def one(name: str, steps: int, warmup: int, smoke: bool) -> dict:
    """Runs one configuration in this process (one of a local cluster's processes when
    HFJAX_PROCESS_ID is set: pinned to its own core, joined to the others); returns its
    figures."""
    if "HFJAX_PROCESS_ID" in os.environ:
        rank = int(os.environ["HFJAX_PROCESS_ID"])
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
        from hfjax.parallel import distributed

        distributed.initialize(distributed.resolve_settings(environ=os.environ))
    import jax

    jax.config.update("jax_cpu_enable_async_dispatch", False)  # as launch.train does on CPU
    from hfjax.run.trainer import Trainer

    placement, k = RUNS[name]
    trainer = Trainer(workload(placement, k, warmup + steps + 1, smoke))
    for _ in range(warmup):
        trainer.train_step()
    t0 = time.perf_counter()
    ms = [trainer.train_step() for _ in range(steps)]
    wall = time.perf_counter() - t0
    # A step reports the rollout's idle time over the step before it (the rollout waits for
    # the trainer's step to end): one more step, untimed, reports the last timed step's.
    after = trainer.train_step() if name != "colocate" else {}
    if trainer.async_rollout is not None:
        trainer.async_rollout.close()
    gen = statistics.mean(m["timing_s/gen"] for m in ms)
    step = wall / steps
    if name == "colocate":  # both stages on every device: nothing idles by placement
        idle_rollout = idle_train = 0.0
    else:  # the loop's own measure (across processes, each pool's on its own process)
        idle_rollout = statistics.mean(m["timing_s/idle/rollout"] for m in [*ms[1:], after])
        idle_train = statistics.mean(m["timing_s/idle/train"] for m in ms)
    return {"run": name, "steps_per_s": steps / wall, "step_s": step, "gen_s": gen,
            "idle_rollout_s": idle_rollout, "idle_train_s": idle_train,
            "staleness_mean": statistics.mean(m.get("async/staleness/mean", 0.0) for m in ms),
            "push_s": statistics.mean(m.get("async/push_s", 0.0) for m in ms)}


def seconds(value: float) -> str:
    """An idle column: n/a where no process measured it (a process holding devices of both
    pools measures neither)."""
    return "n/a" if math.isnan(value) else f"{value:.3f}"


def main(argv: list[str]) -> None:
    args = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    steps, warmup = int(args.get("steps", 6)), int(args.get("warmup", 3))
    smoke = os.environ.get("HFJAX_SMOKE") == "1"
    if smoke:
        steps, warmup = 2, 1
    if "one" in args:
        figures = one(args["one"], steps, warmup, smoke)
        if os.environ.get("HFJAX_PROCESS_ID", "0") == "0":
            print(json.dumps(figures))
        return
    layout = args.get("layout", "processes")
    single = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get(
        "PYTHONPATH")])))
    if layout == "threads":
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=2 {single}"
        launcher = [sys.executable, os.path.abspath(__file__)]
    elif layout == "processes":
        env["XLA_FLAGS"] = single
        launcher = [sys.executable, "-m", "launch.local_cluster", "--num_processes=2",
                    "--devices_per_process=1", "--stop_grace_s=10",
                    f"--script={os.path.abspath(__file__)}", "--"]
    else:
        raise SystemExit(f"--layout={layout}: choose processes or threads")
    results = {}
    for name in args.get("runs", ",".join(RUNS)).split(","):
        p = subprocess.run([*launcher, f"--one={name}", f"--steps={steps}",
                            f"--warmup={warmup}"], cwd=ROOT, env=env, capture_output=True,
                           text=True, check=False)
        if p.returncode != 0:
            raise SystemExit(f"run {name} failed:\n{p.stdout[-2000:]}{p.stderr[-3000:]}")
        lines = [line.removeprefix("[0] ") for line in p.stdout.strip().splitlines()
                 if line.startswith(("{", "[0] {"))]
        results[name] = json.loads(lines[-1])
    from hfjax.planner.simulator import async_step_seconds

    base = results.get("sync")
    print(f"{'run':10} {'steps/s':>8} {'step s':>7} {'gen s':>7} {'idle rollout':>13} "
          f"{'idle train':>11} {'staleness':>9} {'vs sync':>8} {'predicted':>9}")
    for name, r in results.items():
        ratio = r["steps_per_s"] / base["steps_per_s"] if base else float("nan")
        r["vs_sync"] = ratio
        # The simulator's price of this run's step, from the synchronous run's stage times
        # (generation; the rest, less its push) and this run's push.
        pred = float("nan")
        if base and name != "colocate":
            rest = base["step_s"] - base["gen_s"] - base["push_s"]
            pred = async_step_seconds(base["gen_s"], rest, r["push_s"], RUNS[name][1])
        r["predicted_step_s"] = pred
        print(f"{name:10} {r['steps_per_s']:8.3f} {r['step_s']:7.3f} {r['gen_s']:7.3f} "
              f"{seconds(r['idle_rollout_s']):>13} {seconds(r['idle_train_s']):>11} "
              f"{r['staleness_mean']:9.2f} {ratio:8.2f} {pred:9.3f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
