"""Calibrates the planner's simulator against measured runs on this machine.

Usage: python bench/plan_calibration.py [--steps=5] [--reps=5] [--runs=default,wide,batch]

1. **Device figures, measured**: the 8 simulated CPU devices' float32 and bfloat16 matmul
   FLOP/s, memory bandwidth (a sharded elementwise pass) and all-gather bandwidth at the
   default job's sizes, all 8 devices at once; the best of `--reps` samples, measured before
   every run, best over the runs (other jobs on the shared cores only slow samples down).
2. **Stage times, measured**: the default job (`python -m launch.train`, PPO on the arithmetic
   task, colocated on 8 CPU devices, warm start skipped) and two variants (`wide`: hidden 256 /
   MLP 768, four times the matmul FLOPs; `batch`: 256 prompts per step), `--steps` RL steps
   each; per stage the median of the steps after the first (which compiles).
3. **Prices, both sources**: every program's FLOPs, bytes and memory from the closed forms
   (`ClosedFormPrices`) and from XLA's analysis of the programs compiled at abstract shapes
   (`hfjax.planner.compiled.CompiledPrices`).
4. **Fit, per source**: per stage kind, measured seconds = calls x overhead + ideal seconds /
   efficiency, where ideal seconds is the simulator's time at efficiency 1 and zero overhead
   from the measured device figures and the source's prices; least squares over the runs. Then
   each run is predicted from a fit to the other runs (leave one out), and the error of every
   stage is printed for both sources side by side.

`--measured_out=FILE` saves the measurements as soon as they are taken (a JSON line that
`--from_json` refits). The last line is JSON: the measured device figures, the fitted factors
of each source (stored as the planner's `cpu` target, `simulator.CPU_MEASURED`) and the
held-out errors of both sources, per run and per stage.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

# Run as a script (`python bench/plan_calibration.py`): the repository root for `bench.timing`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hfjax.parallel.distributed import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)  # before JAX starts (a count in XLA_FLAGS wins)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from bench.timing import best_time  # noqa: E402
from configs import ppo_arith  # noqa: E402
from hfjax.parallel.mesh import MeshSpec  # noqa: E402
from hfjax.parallel.targets import Target  # noqa: E402
from hfjax.planner import report, search  # noqa: E402
from hfjax.planner.compiled import CompiledPrices  # noqa: E402
from hfjax.planner.config import plan_inputs  # noqa: E402
from hfjax.planner.pricing import ClosedFormPrices, MeshLayout  # noqa: E402
from hfjax.planner.simulator import Cluster, Efficiency, Simulator  # noqa: E402

_STEPS = flags.DEFINE_integer("steps", 5, "RL steps per run (the first compiles and is dropped)")
_REPS = flags.DEFINE_integer("reps", 10, "repetitions of each device measurement (best)")
_RUNS = flags.DEFINE_list("runs", ["default", "wide", "batch"], "runs to measure")
_FROM = flags.DEFINE_string("from_json", "", "refit the measurements of an earlier run's JSON "
                            "line (a file holding it) instead of measuring again")
_MEASURED_OUT = flags.DEFINE_string("measured_out", "", "write the measurements to this file "
                                    "as soon as they are taken (for --from_json)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = {
    "default": {},
    "wide": {"model.hidden_size": 256, "model.intermediate_size": 768, "model.head_dim": 64},
    "batch": {"data.train_batch_size": 256},
}
KINDS = {"gen": "gen", "old_log_prob": "forward", "ref": "forward", "values": "forward",
         "update_critic": "train", "update_actor": "train"}


# -- 1. device figures --------------------------------------------------------------------------


def measure_device(reps: int) -> dict[str, float]:
    """Per-device FLOP/s, memory and all-gather bandwidth of the 8 simulated CPU devices, at
    the sizes of the default job's programs (a few MB per device: on a CPU, caches make small
    programs faster than a large-array measurement would say)."""
    mesh = MeshSpec.parse("data=8").build(jax.devices())
    rows = NamedSharding(mesh, P("data"))
    out = {}
    for dtype in ("float32", "bfloat16"):
        # One 2-D [512, 384] x [384, 384] matmul per device, as the model's projections run.
        m, k = 512, 384
        x = jax.device_put(jnp.ones((8 * m, k), dtype), rows)
        w = jax.device_put(jnp.ones((8 * k, k), dtype), rows)
        mm = jax.jit(jax.shard_map(
            lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32), mesh=mesh,
            in_specs=(P("data"), P("data")), out_specs=P("data")))
        t = best_time(mm, x, w, reps=reps)[0]
        out[f"{dtype}_flops"] = 2 * m * k * k / t
    x = jax.device_put(jnp.ones((8, 2**18), jnp.float32), rows)  # 1 MB per device
    t = best_time(jax.jit(lambda v: v * 1.0001 + 1.0), x, reps=reps)[0]
    out["memory_bandwidth"] = 2 * x.nbytes / t / 8
    gather = jax.jit(jax.shard_map(lambda v: jax.lax.all_gather(v, "data", tiled=True),
                                   mesh=mesh, in_specs=P("data"), out_specs=P(),
                                   check_vma=False))
    t = best_time(gather, x, reps=reps)[0]
    out["gather_bandwidth"] = 7 / 8 * x.nbytes / t  # bytes each device receives per second
    return out


def cpu_cluster(figures: dict[str, float]) -> Cluster:
    """The 8 simulated devices as a Cluster of measured figures (one node)."""
    host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    target = Target("cpu", "8 simulated CPU devices (measured)", host_bytes // 8,
                    figures["bfloat16_flops"], figures["memory_bandwidth"],
                    2 * figures["gather_bandwidth"], "shared memory",
                    "bench/plan_calibration.py", platform="cpu")
    return Cluster(target, 8, figures["gather_bandwidth"], "one host",
                   f32_flops=figures["float32_flops"])


# -- 2. measured stage times ----------------------------------------------------------------------


def job_overrides(run: str, out_dir: str, steps: int) -> dict:
    base = {"sft.steps": 0, "trainer.total_steps": steps, "trainer.test_freq": 0,
            "trainer.val_before_train": False, "trainer.logger": "jsonl",
            "trainer.plot": False, "trainer.save_freq": 0, "reward.num_processes": 0,
            "trainer.out_dir": out_dir}
    return {**base, **RUNS[run]}


def measure_run(run: str, steps: int) -> dict[str, float]:
    """Median seconds per stage over the steps after the first."""
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = os.path.join(tmp, "out")
        cmd = [sys.executable, "-m", "launch.train", "--cpu_devices=8",
               *(f"--config.{k}={v}" for k, v in job_overrides(run, out_dir, steps).items())]
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
        if p.returncode:
            raise RuntimeError(f"run {run} failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
        with open(os.path.join(out_dir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if "timing_s/gen" in line]
    rows = rows[1:]  # the first RL step compiles
    return {s: statistics.median(r[f"timing_s/{s}"] for r in rows)
            for s in KINDS if f"timing_s/{s}" in rows[0]} | {
        "step": statistics.median(r["timing_s/step"] for r in rows)}


# -- 4. fit ----------------------------------------------------------------------------------------


def ideal_stage_times(run: str, cluster: Cluster, costs) -> dict[str, tuple[float, float]]:
    """{stage: (calls or steps, ideal seconds)} of the run's colocated plan on 8 devices at
    efficiency 1 and zero overhead."""
    cfg = ppo_arith.get_config()
    for key, value in RUNS[run].items():
        section, name = key.split(".")
        cfg[section][name] = value
    cfg.sft.steps = 0
    models, host, workload = plan_inputs(cfg, platform="cpu")
    ideal = Efficiency(train=1, forward=1, prefill=1, hbm=1, link=1)
    sim = Simulator(cluster, workload, ideal, costs)
    out = {}
    lay = MeshLayout(fsdp=8)
    for m in models:
        if m.role == "actor":
            gen, _ = sim.generate(m, lay, 1, True)
            out["gen"] = (workload.response_len, gen.seconds)
            if workload.old_log_prob:
                out["old_log_prob"] = (1, sim.forward(m, lay).seconds)
            out["update_actor"] = (workload.sequences // workload.actor_mini,
                                   sim.train(m, lay).seconds)
        elif m.role == "critic":
            out["values"] = (1, sim.forward(m, lay).seconds)
            out["update_critic"] = (workload.sequences // workload.critic_mini,
                                    sim.train(m, lay).seconds)
        elif m.role == "ref":
            out["ref"] = (1, sim.forward(m, lay).seconds)
    return out


def fit(samples: list[tuple[str, float, float, float]]) -> dict[str, tuple[float, float]]:
    """{kind: (overhead, efficiency)} from (kind, calls, ideal, measured) samples.

    Generation: measured = steps x overhead per step + ideal / efficiency. Scoring and
    training share one overhead per program call and have an efficiency each. Least squares,
    each sample weighted by 1 / measured (relative errors, so the largest run does not decide
    alone); a negative overhead is dropped and the rest refitted.
    """
    out = {}
    gen = [(c, i, m) for k, c, i, m in samples if k == "gen"]
    comp = [(k, c, i, m) for k, c, i, m in samples if k != "gen"]
    if gen:
        x = _lstsq([[c / m, i / m] for c, i, m in gen])
        out["gen"] = (x[0], 1 / x[1])
    if comp:
        kinds = sorted({k for k, *_ in comp})
        rows = [[c / m] + [i / m if k == kind else 0.0 for kind in kinds] for k, c, i, m in comp]
        x = _lstsq(rows)
        for j, kind in enumerate(kinds):
            out[kind] = (x[0], 1 / x[1 + j])
    return out


def _lstsq(rows: list[list[float]]) -> list[float]:
    """Non-negative least squares by dropping the terms that come out negative (an overhead
    below 0, or an efficiency term that would have to run time backwards) and refitting;
    a dropped efficiency term comes back as 1e-12 (the stage's time is all overhead)."""
    a = np.array(rows)
    b = np.ones(len(rows))
    keep = list(range(a.shape[1]))
    while True:
        y, *_ = np.linalg.lstsq(a[:, keep], b, rcond=None)
        bad = [k for k, v in zip(keep, y) if v < 0]
        if not bad:
            break
        keep = [k for k in keep if k not in bad]
    x = [0.0] * a.shape[1]
    for k, v in zip(keep, y):
        x[k] = float(v)
    return [x[0]] + [max(v, 1e-12) for v in x[1:]]


def efficiency_from(fitted: dict[str, tuple[float, float]]) -> Efficiency:
    """The fitted factors as an Efficiency (clipped to (0, 1]: a CPU may beat its own measured
    matmul rate on tiny programs only through rounding)."""
    def clip(x):
        return max(1e-6, min(1.0, x))

    gen_over, gen_eff = fitted.get("gen", (0.0, 1.0))
    call_over, fwd_eff = fitted.get("forward", (0.0, 1.0))
    _, tr_eff = fitted.get("train", (0.0, 1.0))
    return Efficiency(train=clip(tr_eff), forward=clip(fwd_eff), prefill=clip(gen_eff),
                      hbm=clip(gen_eff), link=1.0, call_overhead_s=call_over,
                      step_overhead_s=gen_over)


def held_out(ideal: dict, measured: dict) -> dict[str, dict[str, float]]:
    """{run: {stage: predicted / measured - 1, "total": ...}}, each run predicted from a fit to
    the other runs."""
    out = {}
    for run in ideal:
        rest = [(KINDS[st], c, i, measured[r][st]) for r in ideal if r != run
                for st, (c, i) in ideal[r].items()]
        if not rest:
            continue
        f = fit(rest)
        pred = {st: c * f[KINDS[st]][0] + i / f[KINDS[st]][1] for st, (c, i) in ideal[run].items()}
        errs = {st: pred[st] / measured[run][st] - 1 for st in pred}
        errs["total"] = sum(pred.values()) / sum(measured[run][st] for st in pred) - 1
        out[run] = errs
    return out


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x:+.0%}"


def main(argv):
    del argv
    t0 = time.perf_counter()
    if _FROM.value:
        with open(_FROM.value) as f:
            earlier = json.loads(f.read().strip().splitlines()[-1])
        figures, spread, measured = earlier["device"], earlier["device_spread"], {
            r: earlier["measured"][r] for r in _RUNS.value}
    else:
        samples_dev = [measure_device(_REPS.value)]
        measured = {}
        for run in _RUNS.value:
            measured[run] = measure_run(run, _STEPS.value)
            samples_dev.append(measure_device(_REPS.value))
        figures = {k: max(s[k] for s in samples_dev) for k in samples_dev[0]}
        spread = {k: min(s[k] for s in samples_dev) / figures[k] for k in figures}
        if _MEASURED_OUT.value:
            with open(_MEASURED_OUT.value, "w") as f:
                f.write(json.dumps({"device": figures, "device_spread": spread,
                                    "measured": measured}) + "\n")
    cluster = cpu_cluster(figures)
    print("device spread (slowest / best sample): "
          + ", ".join(f"{k} {v:.2f}" for k, v in spread.items()))
    print("device (measured, per simulated device): "
          f"f32 {figures['float32_flops'] / 1e9:.2f} GFLOP/s, bf16 "
          f"{figures['bfloat16_flops'] / 1e9:.2f} GFLOP/s, memory "
          f"{figures['memory_bandwidth'] / 1e9:.2f} GB/s, all-gather "
          f"{figures['gather_bandwidth'] / 1e9:.2f} GB/s received")
    compiled = CompiledPrices("cpu", budget_s=None)
    sources = {"closed_form": ClosedFormPrices("cpu"), "compiled": compiled}
    ideal = {src: {run: ideal_stage_times(run, cluster, costs) for run in _RUNS.value}
             for src, costs in sources.items()}
    print(f"compiled prices: {compiled.programs} programs, {compiled.compiles} compiles in "
          f"{compiled.compile_s:.1f} s; closed forms for {len(compiled.fallbacks)}"
          + "".join(f"\n  {label}: {why}" for label, why in compiled.fallbacks.items()))
    fitted, errors = {}, {}
    for src in sources:
        samples = [(KINDS[s], c, i, measured[r][s]) for r in ideal[src]
                   for s, (c, i) in ideal[src][r].items()]
        fitted[src] = fit(samples)
        errors[src] = held_out(ideal[src], measured)
        print(f"fit ({src}): " + "; ".join(
            f"{k}: overhead {o * 1e3:.3f} ms per {'step' if k == 'gen' else 'call'}, "
            f"efficiency {e:.4f}" for k, (o, e) in fitted[src].items()))
    for run in _RUNS.value:
        print(f"run {run}: measured step {measured[run]['step']:.3f} s; held out (fit on the "
              "other runs), predicted / measured - 1:")
        print(f"  {'stage':<14}{'measured':>10}  {'ideal closed':>13}{'ideal compiled':>15}"
              f"{'err closed':>12}{'err compiled':>14}")
        for stage in [*ideal["compiled"][run], "total"]:
            m = (sum(measured[run][s] for s in ideal["compiled"][run]) if stage == "total"
                 else measured[run][stage])
            ic = "" if stage == "total" else f"{ideal['closed_form'][run][stage][1]:13.2e}"
            ip = "" if stage == "total" else f"{ideal['compiled'][run][stage][1]:15.2e}"
            ec, ep = (_pct(errors[src].get(run, {}).get(stage)) for src in sources)
            print(f"  {stage:<14}{m:>9.4f}s  {ic:>13}{ip:>15}{ec:>12}{ep:>14}")
    effs = {src: efficiency_from(f) for src, f in fitted.items()}
    eff = effs["closed_form"]
    # The plan the fitted model makes for the default job on this machine (closed forms, as
    # launch.plan prices by default).
    cfg = ppo_arith.get_config()
    cfg.sft.steps = 0
    models, host, workload = plan_inputs(cfg, platform="cpu")
    result = search.plan(models, workload, cluster, 8, host_roles=host, efficiency=eff)
    print("plan for the default job on this machine, fitted factors: "
          + report.describe(result.best))
    print(json.dumps({
        "device": figures, "device_spread": spread,
        "fit": {src: {k: {"overhead_s": o, "efficiency": e} for k, (o, e) in f.items()}
                for src, f in fitted.items()},
        "efficiency": {src: e.__dict__ for src, e in effs.items()}, "held_out_error": errors,
        "measured": measured, "wall_s": round(time.perf_counter() - t0, 1),
    }))


if __name__ == "__main__":
    app.run(main)
