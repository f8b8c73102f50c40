"""Asynchronous rollout side by side: the same GRPO workload synchronous (colocated, and on
two pools in turn) and with max_staleness K = 1 and K = 4 (docs/async.md), on stages the bench
balances on the machine it runs on.

Usage: python bench/async_rollout.py [--steps=6] [--warmup=3] [--runs=colocate,sync,k1,k4]
                                     [--layout=processes|threads] [--repeats=1]
                                     [--response_length=N] [--workload=fixed|longtail]

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

Calibration: an overlap can at best take a step from generation + the rest down to the longer
of the two, so the bench first balances them here. Unless `--response_length` is given, it
runs the synchronous two-pool workload at 128-token responses, measures generation (g) and
the rest of the step (t, the update, scoring and the push), and sets the response length
where a line through each stage's two measured points (g and t against the length; the first
point assumes g proportional to the length and t fixed) makes them equal, measuring again
until they are within 20% (at most 3 tries, 32 to 2048 tokens). The runs then use that
length. `--workload=longtail` draws response lengths from a long tail instead (8 samples of
2 prompts, geometric lengths cut at the response length, which a quarter of the rows reach;
see `workload`), and its runs are sync, k1 and `k2p`, K = 2 with partial rollouts, in one
process (partial rollouts do not run across processes, so the layout is threads).

No run applies a rollout correction, so all do the same work and each ratio is the overlap's
alone; `k1c` is K = 1 with the correction K >= 1 applies by default (token-level importance
weights: one more scoring pass on the trainer's pool each step).

Per run: steps/s over the steps after `--warmup` (which compile, timed on process 0), the
seconds of generation per step (`timing_s/gen`), both pools' idle seconds per step (the loop's
`timing_s/idle/rollout` and `timing_s/idle/train`, docs/async.md "Metrics"; in the processes
layout each is measured on its own pool's process), the mean staleness, the ratio to the
synchronous two-pool run, the overlap's ideal ratio beside it (the synchronous step over the
longer of its two stages: what a perfect overlap would reach), and the planner's price of
each two-pool run's step (`hfjax.planner.simulator.async_step_seconds`, from the synchronous
run's measured stages). With `--repeats=N` every run is repeated N times in turn and the
medians are reported. The load average (`os.getloadavg`) before and after is printed; the
last line is JSON.
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
        "k2": (TWO_POOLS, 2), "k4": (TWO_POOLS, 4), "k2p": (TWO_POOLS, 2),
        "k1c": (TWO_POOLS, 1)}
PARTIAL = {"k2p"}
CORRECTED = {"k1c"}  # with the rollout correction K >= 1 applies by default
START_LENGTH, MIN_LENGTH, MAX_LENGTH = 128, 32, 2048


def workload(placement: str, k: int, steps: int, smoke: bool, length: int = START_LENGTH,
             longtail: bool = False, partial: bool = False, corrected: bool = False):
    """GRPO on the arithmetic task with a small model; `length` is the response length the
    calibration balances generation and the rest of the step (rewards, advantages, the
    update, the push) with on this machine. Without `corrected` no rollout correction runs,
    so every run does the same work and the ratios measure the overlap alone; with it, K >= 1
    applies its default token-level importance weights, whose old-policy scoring pass
    lengthens the trainer's stage."""
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
    m.vocab_size = 512 if length <= 256 else 4096  # longer rows: keep the stop token rare
    c.data.n_train, c.data.n_test = 256, 16
    # Few rows and no reference: decoding is latency-bound (its time barely grows with the
    # rows), the update is not, so a small batch keeps the two sides comparable (measured:
    # generation 0.04 s, the rest 0.06 s per step in the synchronous two-pool run).
    c.data.train_batch_size = 1
    c.actor.use_kl_loss = c.algo.use_kl_in_reward = False
    c.rollout.n = 2
    if longtail:
        # The untrained policy draws its stop token about once in `vocab_size` tokens, so
        # response lengths are geometric, cut at the limit: with vocab_size = limit / 1.4 a
        # row reaches the limit with probability e^-1.4 (one in four; half the rows end
        # before half of it), and some row of 16 does in 99% of the steps, so every step
        # decodes to the limit (fixed widths, no timed step compiles) while most rows idle
        # in the batch: the long tail of verl's fully-async setting.
        m.vocab_size = max(32, round(length / 1.4))
        c.data.train_batch_size, c.rollout.n = 2, 8
    c.rollout.response_length = 8 if smoke else length
    c.async_rollout.partial_rollout = partial
    c.algo.rollout_correction.rollout_is = "auto" if corrected else "none"
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


def one(name: str, steps: int, warmup: int, smoke: bool, length: int,
        longtail: bool) -> dict:
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
    trainer = Trainer(workload(placement, k, warmup + steps + 1, smoke, length, longtail,
                               name in PARTIAL, name in CORRECTED))
    for _ in range(warmup):
        trainer.train_step()
    ms, walls = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        ms.append(trainer.train_step())
        walls.append(time.perf_counter() - t0)
    wall = sum(walls)
    # A step reports the rollout's idle time over the step before it (the rollout waits for
    # the trainer's step to end): one more step, untimed, reports the last timed step's.
    after = trainer.train_step() if name != "colocate" else {}
    if trainer.async_rollout is not None:
        trainer.async_rollout.close()
    gen = statistics.mean(m["timing_s/gen"] for m in ms)
    step = wall / steps
    # Medians per step, for the calibration: a step slowed by another job on the machine
    # moves a mean, not them.
    gen_median = statistics.median(m["timing_s/gen"] for m in ms)
    step_median = statistics.median(walls)
    if name == "colocate":  # both stages on every device: nothing idles by placement
        idle_rollout = idle_train = 0.0
    else:  # the loop's own measure (across processes, each pool's on its own process)
        idle_rollout = statistics.mean(m["timing_s/idle/rollout"] for m in [*ms[1:], after])
        idle_train = statistics.mean(m["timing_s/idle/train"] for m in ms)
    return {"run": name, "length": length, "steps_per_s": steps / wall, "step_s": step,
            "gen_s": gen, "gen_median_s": gen_median, "step_median_s": step_median,
            "response_length_mean": statistics.mean(m["response_length/mean"] for m in ms),
            "idle_rollout_s": idle_rollout, "idle_train_s": idle_train,
            "staleness_mean": statistics.mean(m.get("async/staleness/mean", 0.0) for m in ms),
            "push_s": statistics.mean(m.get("async/push_s", 0.0) for m in ms)}


def seconds(value: float) -> str:
    """An idle column: n/a where no process measured it (a process holding devices of both
    pools measures neither)."""
    return "n/a" if math.isnan(value) else f"{value:.3f}"


def launch(name: str, args: dict, env: dict, launcher: list[str], length: int) -> dict:
    """Runs one configuration in fresh processes; returns its figures."""
    p = subprocess.run([*launcher, f"--one={name}", f"--steps={args['steps']}",
                        f"--warmup={args['warmup']}", f"--response_length={length}",
                        f"--workload={args['workload']}"], cwd=ROOT, env=env,
                       capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise SystemExit(f"run {name} failed:\n{p.stdout[-2000:]}{p.stderr[-3000:]}")
    lines = [line.removeprefix("[0] ") for line in p.stdout.strip().splitlines()
             if line.startswith(("{", "[0] {"))]
    return json.loads(lines[-1])


def stages(r: dict) -> tuple[float, float]:
    """A synchronous two-pool run's (generation, rest of the step) seconds: medians per step."""
    return r["gen_median_s"], r["step_median_s"] - r["gen_median_s"]


def calibrate(run) -> tuple[int, dict, list[dict]]:
    """The response length at which the synchronous two-pool run's generation and the rest of
    its step take about the same time here (within 20%), found by at most 3 measured tries;
    returns it, that run's figures and the tries."""
    length, tries = START_LENGTH, []
    while True:
        r = run(length)
        tries.append(r)
        g, t = stages(r)
        print(f"calibration: {length} tokens: generation {g:.3f} s, rest {t:.3f} s",
              flush=True)
        if abs(g - t) <= 0.2 * max(g, t) or len(tries) == 3:
            return length, r, tries
        if len(tries) == 1:  # generation grows with the length, the rest assumed fixed
            want = length * t / max(g, 1e-6)
        else:  # the two stages' lines through the last two tries meet at the balance
            a, b = tries[-2], tries[-1]
            (g0, t0), (g1, t1) = stages(a), stages(b)
            dl = b["length"] - a["length"]
            slope = ((g1 - g0) - (t1 - t0)) / dl
            want = b["length"] + (t1 - g1) / slope if slope > 0 else length * t / g
        new = int(min(max(round(want / 16) * 16, MIN_LENGTH), MAX_LENGTH))
        if new == length:
            return length, r, tries
        length = new


def main(argv: list[str]) -> None:
    args = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    steps, warmup = int(args.get("steps", 6)), int(args.get("warmup", 3))
    smoke = os.environ.get("HFJAX_SMOKE") == "1"
    if smoke:
        steps, warmup = 2, 1
    args["steps"], args["warmup"] = steps, warmup
    longtail = args.setdefault("workload", "fixed") == "longtail"
    if args["workload"] not in ("fixed", "longtail"):
        raise SystemExit(f"--workload={args['workload']}: choose fixed or longtail")
    if "one" in args:
        figures = one(args["one"], steps, warmup, smoke,
                      int(args.get("response_length", START_LENGTH)), longtail)
        if os.environ.get("HFJAX_PROCESS_ID", "0") == "0":
            print(json.dumps(figures))
        return
    layout = args.get("layout", "threads" if longtail else "processes")
    names = args.get("runs", "sync,k1,k2p" if longtail else "colocate,sync,k1,k4").split(",")
    if layout == "processes" and PARTIAL & set(names):
        raise SystemExit("partial rollouts run in one process only (docs/async.md); use "
                         "--layout=threads or leave k2p out of --runs")
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
    load_before = os.getloadavg()
    repeats = int(args.get("repeats", 1))
    first_sync = None
    if smoke:
        length = 8  # the workload's smoke size
    elif "response_length" in args:
        length = int(args["response_length"])
    else:
        length, first_sync, _ = calibrate(
            lambda n: launch("sync", args, env, launcher, n))
    print(f"response length {length}; layout {layout}; {repeats} repeat(s) of "
          f"{','.join(names)}", flush=True)
    samples: dict[str, list[dict]] = {name: [] for name in names}
    if first_sync is not None and "sync" in samples:
        samples["sync"].append(first_sync)  # the calibration's last try is one repeat
    for _ in range(repeats):
        for name in names:
            if len(samples[name]) < repeats:
                samples[name].append(launch(name, args, env, launcher, length))
    load_after = os.getloadavg()
    results = {}
    for name, rs in samples.items():
        r = dict(min(rs, key=lambda x: abs(x["steps_per_s"] - statistics.median(
            y["steps_per_s"] for y in rs))))  # the median run's figures
        r["steps_per_s"] = statistics.median(x["steps_per_s"] for x in rs)
        r["step_s"] = 1.0 / r["steps_per_s"]
        r["steps_per_s_all"] = [x["steps_per_s"] for x in rs]
        results[name] = r
    from hfjax.planner.simulator import async_step_seconds

    base = results.get("sync")
    ideal = float("nan")
    if base:
        g, t = stages(base)
        ideal = (g + t) / max(g, t)  # the synchronous step (median) over its longer stage
        print(f"synchronous stages: generation {g:.3f} s, rest {t:.3f} s; the overlap's "
              f"ideal: {ideal:.2f}x")
    print(f"{'run':10} {'steps/s':>8} {'step s':>7} {'gen s':>7} {'idle rollout':>13} "
          f"{'idle train':>11} {'staleness':>9} {'vs sync':>8} {'ideal':>6} {'predicted':>9}")
    for name, r in results.items():
        ratio = r["steps_per_s"] / base["steps_per_s"] if base else float("nan")
        r["vs_sync"] = ratio
        r["ideal_vs_sync"] = ideal if name != "colocate" else float("nan")
        # The simulator's price of this run's step, from the synchronous run's stage times
        # (generation; the rest, less its push) and this run's push.
        pred = float("nan")
        if base and name != "colocate":
            rest = base["step_s"] - base["gen_s"] - base["push_s"]
            pred = async_step_seconds(base["gen_s"], rest, r["push_s"], RUNS[name][1])
        r["predicted_step_s"] = pred
        print(f"{name:10} {r['steps_per_s']:8.3f} {r['step_s']:7.3f} {r['gen_s']:7.3f} "
              f"{seconds(r['idle_rollout_s']):>13} {seconds(r['idle_train_s']):>11} "
              f"{r['staleness_mean']:9.2f} {ratio:8.2f} {r['ideal_vs_sync']:6.2f} {pred:9.3f}")
    print("load average (1, 5, 15 min) before: {:.2f} {:.2f} {:.2f}; after: {:.2f} {:.2f} "
          "{:.2f}".format(*load_before, *load_after))
    print(json.dumps({"length": length, "layout": layout, "load_before": load_before,
                      "load_after": load_after, "runs": results}))


if __name__ == "__main__":
    main(sys.argv[1:])
