"""Plans a run for a cluster: which models share devices, how many each set gets, every mesh,
and the estimated time of one step (HybridFlow's auto device mapping).

    python -m launch.plan --target=h200 --num_devices=64 --config=configs/ppo_arith.py \\
        --config.model.path=preset:llama3.1-8b --config.model.dtype=bfloat16
    python -m launch.plan --target=a100-80gb --num_devices=8 --emit_config=plan.flags
    python -m launch.train --flagfile=plan.flags --cpu_devices=8

Prints the models and the step's shape, the best plan (pools, meshes, the decode layout, peak
memory per pool and a per-stage table), the best plan of each of the next placements, and a
last line of JSON with `placement` (pool -> size and roles), `meshes` (role -> mesh),
`rollout_mesh`, `estimated_iteration_s`, `tokens_per_s` and the per-stage seconds. With
`--emit_config=FILE` it writes the plan as an absl flagfile of config overrides (the config,
your overrides, then the placement, every role's mesh, the actor's rules and rollout.mesh)
that `launch.train --flagfile=FILE` runs unchanged.

The models come from the config: the actor (model.path, model.dtype, model.remat_policy), the
reference when a KL term reads it, and the critic (the actor's shape with a value head) when
the algorithm has one. The reward is the config's rule reward, scored on the host, unless
`--reward_model` names a reward model (a preset, an HF directory or a .gguf file; score head).
Estimates come from `hfjax.planner.simulator`: published device figures
(`hfjax/parallel/targets.py`) times the efficiency factors (`--efficiency`), applied to each
program's FLOPs and bytes: closed forms of the models' shapes (`--prices=closed_form`, the
default), or with `--prices=compiled` XLA's cost and memory analysis of the programs of the
plans shown, compiled at abstract shapes (the search itself ranks by the closed forms).
"""

import json
import os
import sys

from absl import flags, logging
from ml_collections import config_flags

from launch import cli

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "ppo_arith.py")
_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "configuration file (configs/*.py) of the run to plan; default "
    "configs/ppo_arith.py")
_TARGET = flags.DEFINE_string("target", "h200", "device model (hfjax/parallel/targets.py)")
_DEVICES = flags.DEFINE_integer("num_devices", None, "devices in the cluster", required=True)
_EMIT = flags.DEFINE_string("emit_config", "", "write the plan as a flagfile for launch.train")
_REWARD = flags.DEFINE_string("reward_model", "", "a reward model to place (preset:NAME, HF "
                              "directory or .gguf); empty: the config's reward_model.path, else "
                              "its rule reward (host)")
_EFFICIENCY = flags.DEFINE_string("efficiency", "", "efficiency factors, e.g. "
                                  "'train=0.4,hbm=0.6' (hfjax/planner/simulator.py)")
_CALIBRATION = flags.DEFINE_string(
    "calibration", "", "measured efficiencies: a file holding python -m bench.accelerator's "
    "JSON line (its last line is read); --efficiency overrides on top")
_NODE = flags.DEFINE_integer("node_size", None, "devices per node on the fast link (default: "
                             "the target's reference system)")
_SCALE_OUT = flags.DEFINE_float("scale_out_gbps", None, "network bandwidth between nodes per "
                                "device, GB/s one way (default: the reference system's)")
_MEMORY = flags.DEFINE_float("memory_fraction", 0.9, "share of device memory a plan may use")
_ALTERNATIVES = flags.DEFINE_integer("alternatives", 5, "next placements to show")
_SCORE_MICRO = flags.DEFINE_integer("score_micro", None, "rows per scoring pass (0: the "
                                    "whole batch in one call, as hfjax runs them); default: "
                                    "the config's plan.score_micro")
_PRICES = flags.DEFINE_enum(
    "prices", "closed_form", ["closed_form", "compiled"],
    "how programs are priced: closed_form (formulas from the models' shapes, the whole search "
    "in about a second), or compiled: the search ranks by the closed forms, then the best plan "
    "and the --alternatives are priced again from XLA's cost and memory analysis of their "
    "programs compiled at abstract shapes, and ranked anew (hfjax/planner/compiled.py)")
_COMPILE_BUDGET = flags.DEFINE_float(
    "compile_budget_s", 300.0, "with --prices=compiled: compile seconds after which the "
    "remaining programs are priced by the closed forms (the output lists them)")
_GEN_ROWS = flags.DEFINE_integer("gen_rows", None, "rows a decode replica generates at once "
                                 "(0: all, as hfjax's sampler does; -1: let the planner pick); "
                                 "default: the config's plan.gen_rows")


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f} GB" if x >= 1e8 else f"{x / 1e6:.2f} MB"


def main(argv):
    from hfjax.models import backend
    from hfjax.planner import report, search
    from hfjax.planner.config import flagfile_lines, plan_inputs
    from hfjax.planner.simulator import (
        Efficiency,
        cluster_for,
        efficiency_from_calibration,
        measured_cpu_efficiency,
    )

    cfg = _CONFIG.value
    if _PRICES.value == "compiled":
        from hfjax.parallel.distributed import simulate_cpu_devices

        # Programs compile on this process's devices; on a CPU host, 8 simulated ones (before
        # JAX starts its backend) hold tensor sizes up to 8.
        simulate_cpu_devices(8)
    # The search tries layouts no run will use; their warnings (KV heads a tensor size does not
    # divide, replicated) are not the user's concern.
    logging.set_verbosity(logging.ERROR)
    try:
        cluster = cluster_for(_TARGET.value, _NODE.value,
                              None if _SCALE_OUT.value is None else _SCALE_OUT.value * 1e9)
        base = cluster.efficiency
        if _PRICES.value == "compiled" and cluster.target.name == "cpu":
            base = measured_cpu_efficiency("compiled")  # fitted to compiled prices
        if _CALIBRATION.value:
            base = efficiency_from_calibration(_read_calibration(_CALIBRATION.value),
                                               cluster.target, base)
        efficiency = Efficiency.parse(_EFFICIENCY.value, base=base)
        models, host, workload = plan_inputs(cfg, _REWARD.value, _SCORE_MICRO.value,
                                             _GEN_ROWS.value, cluster.target.platform)
        result = search.plan(models, workload, cluster, _DEVICES.value, host_roles=host,
                              efficiency=efficiency, memory_fraction=_MEMORY.value,
                              alternatives=_ALTERNATIVES.value)
        compiled = None
        if _PRICES.value == "compiled":
            from hfjax.planner.compiled import CompiledPrices
            from hfjax.planner.refine import reprice

            compiled = CompiledPrices(cluster.target.platform, budget_s=_COMPILE_BUDGET.value)
            result = reprice(result, models, compiled, efficiency=efficiency, host_roles=host,
                             memory_fraction=_MEMORY.value)
    except (ValueError, FileNotFoundError) as err:
        raise cli.UserError(str(err)) from None
    t = cluster.target
    best = result.best
    print(f"hfjax plan: {cfg.algorithm} on {_DEVICES.value} x {t.description} "
          f"({t.memory_bytes / 1e9:.0f} GB, {t.bf16_flops / 1e12:.0f} TFLOP/s bf16, "
          f"{t.memory_bandwidth / 1e12:.2f} TB/s HBM, {t.interconnect_bandwidth / 1e9:.0f} GB/s "
          f"{t.interconnect}; {cluster.node_size} per node, "
          f"{cluster.scale_out_bandwidth / 1e9:.1f} GB/s between nodes)")
    if _CALIBRATION.value:
        e = efficiency
        print(f"  efficiencies measured ({_CALIBRATION.value}): decode {e.decode:.3f}, train "
              f"{e.train:.3f}, forward {e.forward:.3f} of the peak")
    for m in models:
        kind = "trained" if m.trainable else "frozen"
        count = m.config.num_params()
        size = f"{count / 1e9:.2f}B" if count >= 1e8 else f"{count / 1e6:.2f}M"
        print(f"  {m.role:<7} {size} params, {m.head}, {kind}, "
              f"dtype {m.config.dtype}, remat {m.config.remat_policy}")
    for role in host:
        what = ("rule reward, scored on the host" if role == "reward"
                else "not built (no KL term reads it); placed with the actor")
        print(f"  {role:<7} {what}")
    w = workload
    print(f"  step: {w.prompts} prompts x {w.n} samples, {w.prompt_len} prompt + "
          f"{w.response_len} response tokens (buckets); actor mini/micro {w.actor_mini}/"
          f"{w.actor_micro}" + (f", critic {w.critic_mini}/{w.critic_micro}"
                                if w.critic_mini else "")
          + f"; old log-probs {'yes' if w.old_log_prob else 'no'}")
    print(f"searched {result.placements} placements, {result.allocations} allocations in "
          f"{result.seconds:.1f} s")
    if compiled is not None:
        n_plans = 1 + len(result.alternatives)
        print(f"prices: compiled for the {n_plans} plan{'s' if n_plans > 1 else ''} shown "
              f"({compiled.programs} programs from XLA's analysis, {compiled.compiles} "
              f"compiles in {compiled.compile_s:.1f} s; the search ranked by the closed forms)")
        for label, why in compiled.fallbacks.items():
            print(f"  closed forms for {label}: {why}")
        if differences := backend.stand_in_differences(t.platform):
            print(f"  {differences}")
    else:
        print("prices: closed forms (--prices=compiled prices the plans shown from compiled "
              "programs)")
    print(f"best: {best.mode}, estimated {report.fmt_seconds(best.iteration_s)} per step, "
          f"{best.tokens_per_s:,.0f} tokens/s ({best.tokens_per_s / _DEVICES.value:,.1f} per "
          "device)")
    for name, sc in best.sets.items():
        size, roles = best.pools[name]
        print(f"  pool {name}: {size} devices (fits on {result.min_allocation[name]} or more), "
              f"roles {'+'.join(roles)}, peak {_gb(sc.peak_bytes)} of {_gb(t.memory_bytes)} "
              "per device")
        if sc.peak_bytes > _MEMORY.value * t.memory_bytes:
            # Only a re-priced plan can: the search keeps plans within the budget.
            print(f"    over --memory_fraction={_MEMORY.value} of the device by the compiled "
                  "prices: the closed forms underestimated this pool's working memory")
        for role, ch in sc.choices.items():
            extra = ""
            if role == "actor":
                extra = (f", rules {ch.layout.rules}, decode "
                         + (f"{ch.decode_mesh} (3D-HybridEngine)" if ch.engine
                            else "in the training layout"))
            print(f"    {role:<7} mesh {ch.layout.mesh}{extra}; state {_gb(ch.state_bytes)}, "
                  f"working {_gb(ch.extra_bytes)} per device")
    print("\n".join(report.format_stage_table(best)))
    if result.alternatives:
        print("next placements (the best allocation of each):")
        for i, p in enumerate(result.alternatives, 1):
            print(f"  {i}. {report.describe(p)}")
    if _EMIT.value:
        lines, missing = flagfile_lines(best, cfg, _config_path(), sys.argv, _REWARD.value)
        with open(_EMIT.value, "w") as f:
            f.write("\n".join(lines) + "\n")
        print(f"wrote {_EMIT.value}: python -m launch.train --flagfile={_EMIT.value}")
        if missing:
            print(f"  (the config has no field for {', '.join(missing)}; set those by hand)")
    summary = best.summary()
    summary["prices"] = _PRICES.value
    if compiled is not None:
        summary["closed_form_fallbacks"] = len(compiled.fallbacks)
    print(json.dumps(summary), flush=True)


def _read_calibration(path: str) -> dict:
    """The JSON object on the last non-empty line of `path` (bench.accelerator's output)."""
    try:
        with open(path) as f:
            lines = [x for x in f.read().splitlines() if x.strip()]
    except OSError as err:
        raise ValueError(f"calibration={path}: cannot read it ({err.strerror})") from None
    try:
        data = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        data = None
    if not isinstance(data, dict):
        raise ValueError(f"calibration={path}: its last line is not a JSON object; save the "
                         "output of python -m bench.accelerator there")
    return data


def _config_path() -> str:
    args = sys.argv[1:]
    for i, arg in enumerate(args):
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
        if arg == "--config" and i + 1 < len(args):
            return args[i + 1]
    return os.path.relpath(DEFAULT_CONFIG)


if __name__ == "__main__":
    cli.run(main, "plan", config_default=DEFAULT_CONFIG)
