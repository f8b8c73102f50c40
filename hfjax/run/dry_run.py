"""The dry run: every program of a configured run, compiled ahead of time from abstract shapes,
with its per-device memory and FLOPs, against a device's memory.

The run's worker groups are built as for a real run, from abstract models (parameters and
optimizer state are `jax.ShapeDtypeStruct`s carrying their shardings: nothing is allocated, no
weight is read; a reward or cost model's architecture comes from its config.json, a .gguf's
metadata or a preset), and each group lists its own programs at the run's shapes
(`WorkerGroup.programs`, in the modes its config selects: padded, packed, length-grouped,
shared-prompt rows), which are lowered and compiled here:

- `actor.update_sft` (the warm start, when it runs), `actor.log_prob` (when the step scores
  its samples under the pre-update policy), `actor.update`, `ref.log_prob`, `critic.values`,
  `critic.update` (and `cost_critic.*`), `reward_model.score` and `cost_model.score`; a
  length-grouped update is a full-width micro-batch's gradient accumulation (`*.update`, the
  widest cut) and the optimizer update (`*.update.apply`);
- `rollout.prefill` and `rollout.decode` (the sampler's programs on the decode layout), and
  `validate.prefill` / `validate.decode` when the validation batch has more rows than the
  training rollout (otherwise the training rollout's programs bound its memory);
- `hybrid.to_decode` and `hybrid.to_train`: the 3D-HybridEngine's per-parameter transition
  programs, run one after the other;
- a vision-language policy's `sft.vision_encode`, `rollout.vision_encode`,
  `validate.vision_encode` (`_encode`), its frozen tower resident beside the actor. Not yet
  priced: the image arrays the scoring and update passes read, and a training tower's pass
  inside the update (docs/vision.md).

Shapes are the worst case the config allows: prompts `data.max_prompt_length` wide, responses
`rollout.response_length` long, batches padded to the data-parallel size as the transfer
protocols pad them.

Memory, per device. `compiled.memory_analysis()` gives a program's argument, output,
temporary and aliased (donated) bytes. Between programs, every model of a pool stays resident
(parameters and optimizer state: colocated models time-share the devices but keep their
state). A program's peak is what else its pool holds while it runs plus its own arguments,
outputs and temporaries, less the outputs that reuse donated arguments:

    peak = resident(pool) - resident state passed as arguments + arguments + outputs - aliased
           + temporaries

While generating with the hybrid engine the actor's training parameters are gone (the decode
copy replaces them), and an offloaded optimizer state sits in host memory. A transition runs
one program per parameter and frees each source buffer after its copy, so its peak is the
largest moment of that sequence. Batch arrays held by the dataflow between stages (a few
[rows, sequence] arrays on the actor's mesh) are not counted: they are small beside the
models at the sizes where memory is in question.

FLOPs are `compiled.cost_analysis()`'s, per device. XLA counts a loop body once, so the
decode's FLOPs are those of one decode step, and a program that loops (micro-batches under
`lax.map`, layers under `lax.scan` with `model.scan_layers`) reports one trip's: the column
is a lower bound, not the step's work. The planner's compiled prices
(`hfjax.planner.compiled`) compile unrolled one- and two-layer passes for that reason.

Dtypes and kernels are the target's (`hfjax.models.backend`, every choice made for the
`platform` the run is priced for, under `backend.compiling_for`): for a GPU or TPU target a
bfloat16 model's attention inputs (q, k, v, RoPE) and KV caches are bfloat16, as on the
accelerator, not the float32 a CPU run keeps them in; only a CPU target prices them in float32.
Kernels only the target has are compiled as their portable stand-ins of the same memory
behaviour: blockwise attention for cuDNN and splash, the chunked cache read for the Pallas
decode read. What remains different is the compiler. Compiled on CPU devices standing in for
the target's, the programs are XLA:CPU's: an accelerator's compiler fuses differently, and
XLA:CPU computes bfloat16 element-wise work in float32 between conversions, so temporaries
differ somewhat (float32 copies of bfloat16 operands can appear that the accelerator does not
make). Arguments, outputs and resident state (parameters, optimizer state, batches, caches) are
the accelerator's bytes.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np
from absl import logging
from flax import nnx

from hfjax.algorithms import dataflow
from hfjax.algorithms.spec import StepSpec
from hfjax.config import model_source, run_roles, validate_config
from hfjax.engine.buckets import prompt_bucket
from hfjax.engine.sampler import SamplingParams
from hfjax.models import backend, qwen2_5_vl, transformer
from hfjax.workers import groups, vision
from hfjax.workers.actor import BaseReference
from hfjax.workers.base import Program, StepShape, WorkerGroup
from hfjax.workers.reward import RuleReward

GiB = 2**30


@dataclasses.dataclass
class ProgramMemory:
    """One compiled program's per-device figures (bytes, FLOPs) and its pool's peak while it
    runs."""

    name: str
    pool: str
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    flops: float
    resident_bytes: int  # what else the pool holds while the program runs
    peak_bytes: int
    compile_s: float
    arguments: dict[str, int] = dataclasses.field(default_factory=dict)  # named arg bytes


@dataclasses.dataclass
class DryRun:
    """The programs of one run, the state each pool keeps resident, and the verdict against
    `device_memory_bytes` (None: no limit known, nothing to judge)."""

    programs: list[ProgramMemory]
    resident: dict[str, dict[str, int]]  # pool -> {"actor params": bytes per device, ...}
    num_devices: int
    platform: str
    compute_dtype: str
    device_memory_bytes: int | None = None
    target: str | None = None
    # pool -> bytes of its models' parameters and optimizer state in all (every array once,
    # however it is sharded): what the pool must hold somewhere, on however many devices.
    state_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    # The remat policy the programs were compiled with (model.remat_policy, or what auto chose).
    remat_policy: str | None = None

    @property
    def worst(self) -> ProgramMemory:
        return max(self.programs, key=lambda p: p.peak_bytes)

    @property
    def peak_bytes_per_device(self) -> int:
        return self.worst.peak_bytes

    @property
    def fits(self) -> bool:
        return self.device_memory_bytes is None or self.peak_bytes_per_device <= (
            self.device_memory_bytes)

    def pool_peaks(self) -> dict[str, ProgramMemory]:
        """{pool: its program with the highest peak}."""
        out: dict[str, ProgramMemory] = {}
        for p in self.programs:
            if p.pool not in out or p.peak_bytes > out[p.pool].peak_bytes:
                out[p.pool] = p
        return out

    def verdict(self) -> str:
        """'fits ...' or 'does not fit by N GiB, in program P ...' (one line; MiB for devices
        under 1 GiB)."""
        w = self.worst
        if self.device_memory_bytes is None:
            return f"peak {w.peak_bytes / GiB:.2f} GiB per device, in program {w.name}"
        mem = self.device_memory_bytes
        unit, size = ("GiB", GiB) if mem >= GiB else ("MiB", 2**20)
        if self.fits:
            return (f"fits: peak {w.peak_bytes / size:.2f} {unit} per device in program "
                    f"{w.name}, {(mem - w.peak_bytes) / size:.2f} {unit} to spare of "
                    f"{mem / size:.2f} {unit}")
        return (f"does not fit by {(w.peak_bytes - mem) / size:.2f} {unit}, in program {w.name} "
                f"(pool {w.pool}: peak {w.peak_bytes / size:.2f} {unit} per device, the device "
                f"has {mem / size:.2f} {unit})")

    def min_devices(self) -> int | None:
        """A lower bound on the devices the worst pool needs: its models' state alone, each
        array stored once, divided by the device memory (None: no memory known or no state).
        Activations, caches and replicated arrays need more."""
        if not self.device_memory_bytes or not self.state_bytes:
            return None
        worst = self.state_bytes.get(self.worst.pool, max(self.state_bytes.values()))
        return max(1, math.ceil(worst / self.device_memory_bytes))

    def advice(self) -> str:
        """What to change when the run does not fit (one line; empty when it fits)."""
        if self.fits:
            return ""
        need = self.min_devices()
        state = self.state_bytes.get(self.worst.pool, 0)
        mem = self.device_memory_bytes
        unit, size = ("GiB", GiB) if mem >= GiB else ("MiB", 2**20)
        more = (f"its models' parameters and optimizer state alone are {state / size:.1f} "
                f"{unit}, at least {need} devices of {mem / size:.1f} {unit} even with nothing "
                "else on them; " if need and need > self.num_devices else "")
        w = self.worst
        rows = ("" if w.name.startswith(("rollout", "val", "hybrid")) else
                f"split each row's tokens over the sequence mesh axis (sequence parallelism: "
                f"{w.name.split('.')[0]}.mesh with sequence=2, 4 or 8, e.g. "
                "fsdp=2,sequence=4; docs/scaling.md, \"Long responses\"), ")
        return (f"{more}{rows}shard over more devices (--num_devices, and meshes that span them), "
                "put the models on separate pools (placement), keep master weights in "
                "bfloat16 (model.param_dtype), recompute activations (model.remat_policy=full) "
                "or shrink batches and sequence lengths (data.train_batch_size, "
                "*.ppo_micro_batch_size, data.max_prompt_length, rollout.response_length)")

    def table(self) -> str:
        """The per-program table, the pools' peaks and the verdict, as text."""
        unit, size = ("GiB", GiB) if self.peak_bytes_per_device >= GiB else ("MiB", 2**20)

        def num(n: float) -> str:
            return f"{n / size:>9.3f}"

        head = (f"{'program':<18} {'pool':<10} {'args':>9} {'outputs':>9} {'temp':>9} "
                f"{'donated':>9} {'resident':>9} {'peak':>9} {'TFLOP':>9} {'compile':>8}")
        lines = [head, "-" * len(head)]
        for p in self.programs:
            lines.append(
                f"{p.name:<18} {p.pool:<10} {num(p.argument_bytes)} {num(p.output_bytes)} "
                f"{num(p.temp_bytes)} {num(p.alias_bytes)} {num(p.resident_bytes)} "
                f"{num(p.peak_bytes)} {p.flops / 1e12:>9.3f} {p.compile_s:>7.1f}s")
        lines.append(f"({unit} per device; resident: the pool's other models and state while "
                     "the program runs; peak = resident + args + outputs - donated + temp)")
        for pool, p in self.pool_peaks().items():
            held = ", ".join(f"{k} {v / size:.3f}" for k, v in self.resident[pool].items())
            lines.append(f"pool {pool}: peak {p.peak_bytes / size:.3f} {unit} in {p.name}; "
                         f"resident {unit}: {held}")
        lines.append(self.verdict())
        return "\n".join(lines)

    def summary(self) -> dict[str, Any]:
        """The verdict and the per-program figures as JSON-able data."""
        return {
            "fits": self.fits,
            "peak_bytes_per_device": self.peak_bytes_per_device,
            "device_memory_bytes": self.device_memory_bytes,
            "worst_program": self.worst.name,
            "target": self.target,
            "num_devices": self.num_devices,
            "compute_dtype": self.compute_dtype,
            "remat_policy": self.remat_policy,
            "min_devices": self.min_devices(),
            "programs": {p.name: {k: getattr(p, k) for k in (
                "pool", "argument_bytes", "output_bytes", "alias_bytes", "temp_bytes",
                "resident_bytes", "peak_bytes", "flops")} for p in self.programs},
        }


def device_bytes(tree: Any) -> int:
    """The most bytes any one device holds of the arrays (or sharded ShapeDtypeStructs) in
    `tree`."""
    per: dict[int, int] = {}
    for x in jax.tree.leaves(tree):
        sharding = getattr(x, "sharding", None)
        if sharding is None:
            continue
        nbytes = math.prod(sharding.shard_shape(x.shape)) * x.dtype.itemsize
        for d in sharding.device_set:
            per[d.id] = per.get(d.id, 0) + nbytes
    return max(per.values(), default=0)


def global_bytes(tree: Any) -> int:
    """The bytes of the arrays (or ShapeDtypeStructs) in `tree`, each counted once, whatever its
    sharding."""
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)
               if hasattr(x, "shape"))


class _Rows:
    """A stand-in batch of `n` rows, for the drivers' decisions that depend on its length."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


def _abstract(shape: tuple[int, ...], dtype, sharding) -> jax.ShapeDtypeStruct:
    # Strings name numpy dtypes; a PRNG key dtype (the sampler's keys) is passed as it is.
    dtype = np.dtype(dtype) if isinstance(dtype, str) else dtype
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


class _Compiler:
    """Compiles programs and keeps their figures, each with its pool's resident state."""

    def __init__(self, resident: dict[str, dict[str, int]], on_program: Callable | None):
        self.resident = resident
        self.on_program = on_program
        self.programs: list[ProgramMemory] = []

    def others(self, pool: str, replaces: Iterable[str]) -> int:
        held = self.resident[pool]
        return sum(held.values()) - sum(held.get(k, 0) for k in replaces)

    def add(self, p: ProgramMemory) -> None:
        self.programs.append(p)
        if self.on_program is not None:
            self.on_program(p)

    def compile(self, name: str, pool: str, fn, args: tuple, replaces: Iterable[str],
                named: dict[str, Any] | None = None) -> Any:
        t0 = time.perf_counter()
        compiled = fn.lower(*args).compile()
        seconds = time.perf_counter() - t0
        m = compiled.memory_analysis()
        resident = self.others(pool, replaces)
        peak = (resident + m.argument_size_in_bytes + m.output_size_in_bytes
                - m.alias_size_in_bytes + m.temp_size_in_bytes)
        self.add(ProgramMemory(
            name, pool, int(m.argument_size_in_bytes), int(m.output_size_in_bytes),
            int(m.alias_size_in_bytes), int(m.temp_size_in_bytes), _flops(compiled), resident,
            int(peak), seconds, {k: device_bytes(v) for k, v in (named or {}).items()}))
        return compiled


    def compile_program(self, p: Program, pool: str) -> Any:
        """Compiles a worker group's listed program (`WorkerGroup.programs`) on `pool`."""
        return self.compile(p.name, pool, p.fn, p.args, p.replaces, p.named)


def _flops(compiled) -> float:
    cost = compiled.cost_analysis()
    if isinstance(cost, list):  # older JAX: one dict per device program
        cost = cost[0] if cost else {}
    return float((cost or {}).get("flops", 0.0))


def choose_remat(cfg, device_memory_bytes: int | None, **kw) -> tuple[str, DryRun | None]:
    """(the remat policy `model.remat_policy=auto` resolves to, the dry run that decided it).

    The rule is `hfjax.models.backend.remat_policy`'s: "none" when no device memory is known
    (nothing to fit: CPU; no dry run) or when the dry run without recomputation peaks under
    `backend.REMAT_HEADROOM` of `device_memory_bytes`; else "full" (per-layer checkpointing),
    whose dry run is returned whether it fits or not. `kw` goes to dry_run.
    """
    reports: dict[str, DryRun] = {}

    def trial(policy: str) -> DryRun:
        c = cfg.copy_and_resolve_references()
        c.model.remat_policy = policy
        reports[policy] = report = dry_run(c, device_memory_bytes=device_memory_bytes, **kw)
        report.remat_policy = policy
        return report

    policy = backend.remat_policy(
        "auto", device_memory_bytes, lambda: trial("none").peak_bytes_per_device)
    if not device_memory_bytes:
        return policy, None
    report = reports.get(policy) or trial(policy)
    logging.info("model.remat_policy=auto: %s (peak %.2f GiB per device of %.2f GiB, headroom "
                 "%.0f%%)", policy, report.peak_bytes_per_device / GiB,
                 device_memory_bytes / GiB, 100 * (1 - backend.REMAT_HEADROOM))
    return policy, report


def dry_run(cfg, *, device_memory_bytes: int | None = None, target: str | None = None,
            platform: str | None = None,
            on_program: Callable[[ProgramMemory], None] | None = None) -> DryRun:
    """Builds the run `cfg` describes on `jax.devices()` from abstract shapes and compiles every
    program it will run; returns their figures and the verdict against `device_memory_bytes`.

    `platform` is the one `model.dtype=auto` is resolved for (a target's, where the devices
    are simulated CPUs; default: the devices'). `on_program` is called with each program's
    figures as soon as it is compiled. Raises ValueError for a bad config, before compiling.
    Every per-backend choice is made for `platform` (`hfjax.models.backend.compiling_for`):
    its storage dtype (bfloat16 attention inputs and KV caches for a bf16 model on a GPU or
    TPU), and its kernels, a GPU or TPU target's fused kernels by their memory-linear stand-in
    (blockwise attention, the chunked cache read).
    With `model.remat_policy=auto` the report is `choose_remat`'s (its `remat_policy` says
    which policy it chose).
    """
    if cfg.model.remat_policy == "auto":
        policy, report = choose_remat(cfg, device_memory_bytes, target=target,
                                      platform=platform, on_program=on_program)
        if report is None:
            trial = cfg.copy_and_resolve_references()
            trial.model.remat_policy = policy
            report = dry_run(trial, device_memory_bytes=device_memory_bytes, target=target,
                             platform=platform, on_program=on_program)
            report.remat_policy = policy
        return report
    platform = backend.canonical(platform or jax.devices()[0].platform)
    with backend.compiling_for(platform):
        return _dry_run(cfg, device_memory_bytes, target, platform, on_program)


def _dry_run(cfg, device_memory_bytes, target, platform, on_program) -> DryRun:
    algo, pools = validate_config(cfg)
    compute = model_source.compute_dtype(cfg, platform)
    actor, tok = _abstract_actor(cfg, pools, compute)
    d, r, c = cfg.data, actor.rollout, cfg
    resident: dict[str, dict[str, int]] = {}
    state: dict[str, int] = {}

    def hold(role: str, group) -> None:
        held = resident.setdefault(group.pool.name, {})
        if isinstance(group, BaseReference):
            # LoRA: the reference reads the actor's base, held once as "actor params".
            held[f"{role} params (= the actor's base)"] = 0
            return
        held[f"{role} params"] = device_bytes(group.params)
        state[group.pool.name] = state.get(group.pool.name, 0) + global_bytes(
            (group.params, group.opt_state))
        if group.opt_state is not None:
            held[f"{role} optimizer"] = device_bytes(group.opt_state)
        tower = getattr(group, "tower", None)
        if tower is not None and not tower.trains:  # a training tower is in the params
            held[f"{role} vision tower (frozen)"] = device_bytes(tower.frozen)
            state[group.pool.name] += global_bytes(tower.frozen)

    hold("actor", actor)
    out = _Compiler(resident, on_program)
    # The warm start: the actor alone, with the SFT optimizer (swapped for RL's below).
    if c.sft.steps > 0:
        sft = StepShape(c.sft.batch_size, d.max_prompt_length, r.response_length)
        _encode(out, actor, cfg, "sft", c.sft.batch_size)  # each batch's pictures
        for p in actor.warm_start_programs(c.sft.batch_size, c.sft.micro_batch_size, sft):
            out.compile_program(p, actor.pool.name)

    w = _groups_around(cfg, algo, actor, tok, pools)
    resident.clear()
    state.clear()
    built = device_groups(w)
    for role, g in built:
        hold(role, g)
    _rollout(out, w, cfg, tok, "rollout", d.train_batch_size, r.n,
             temperature=r.temperature, greedy=False)
    v = cfg.rollout.val_kwargs
    sampler = w.actor.sampler
    val_rows = sampler.padded_batch(d.n_test) * int(v.n)
    # Validation decodes the same widths as the training rollout: with no more rows, the
    # training rollout's programs bound its memory, and compiling its own would only cost time.
    validates = c.trainer.test_freq > 0 or c.trainer.val_before_train
    if validates and val_rows > sampler.padded_batch(d.train_batch_size) * r.n:
        _rollout(out, w, cfg, tok, "validate", d.n_test, int(v.n),
                 temperature=float(v.temperature), greedy=float(v.temperature) == 0.0)
    elif validates and d.n_test > d.train_batch_size:
        _encode(out, w.actor, cfg, "validate", d.n_test)  # more pictures than training's
    shape = step_shape(w, cfg)
    listed = [(p, g.pool.name) for _, g in built for p in g.programs(shape)]
    # In the step's order: the scoring passes, then the updates, the actor's last.
    listed.sort(key=lambda x: (x[0].trains, x[0].trains and x[0].name.startswith("actor.")))
    for p, pool in listed:
        out.compile_program(p, pool)
    return DryRun(out.programs, resident, len(jax.devices()), platform, compute,
                  device_memory_bytes, target, state, remat_policy=c.model.remat_policy)


def abstract_groups(cfg, platform: str | None = None) -> groups.WorkerGroups:
    """The run's worker groups as the dry run builds them on `jax.devices()`: from abstract
    models (parameters and optimizer state are ShapeDtypeStructs with their shardings; reward
    and cost models from their configs, no weight read), with RL's optimizers."""
    algo, pools = validate_config(cfg)
    compute = model_source.compute_dtype(cfg, platform or jax.devices()[0].platform)
    actor, tok = _abstract_actor(cfg, pools, compute)
    return _groups_around(cfg, algo, actor, tok, pools)


def device_groups(w: groups.WorkerGroups) -> list[tuple[str, WorkerGroup]]:
    """(role, group) of every built role with device programs (not the host's rule reward)."""
    built = [(role, getattr(w, role)) for role in w.built_roles()]
    return [(role, g) for role, g in built if isinstance(g, WorkerGroup)]


def step_shape(w: groups.WorkerGroups, cfg) -> StepShape:
    """The widest batch of one RL step of `cfg` (`WorkerGroup.programs`)."""
    spec = StepSpec.of(cfg)
    n_seq = cfg.data.train_batch_size * spec.rollout.n
    return StepShape(n_seq, cfg.data.max_prompt_length, spec.rollout.response_length,
                     dataflow.needs_old_log_prob(w, _Rows(n_seq), spec))


def _abstract_actor(cfg, pools, compute: str):
    """(the actor built from an abstract model with the warm start's optimizer, the task's
    tokenizer)."""
    tok = model_source.task_tokenizer(cfg)
    mcfg = model_source.model_config(cfg, tok, compute)
    loaded = model_source.vision_language(cfg, compute)
    if cfg.model.vision_depth or loaded is not None:
        # A vision-language policy (from scratch or model.path's), built as the trainer does:
        # the tower beside the language model (frozen) or inside it (freeze_vision=False).
        vlm = (qwen2_5_vl.abstract(loaded) if loaded is not None else
               nnx.eval_shape(lambda: model_source.vision_model(cfg, tok, mcfg)))
        lm, tower = qwen2_5_vl.policy(vlm, cfg.actor.freeze_vision)
        return groups.build_actor(cfg, lm, pools, tok.pad_id, tok.eos_id, tokenizer=tok,
                                  tower=tower, vl=vlm.config), tok
    abstract = transformer.abstract(mcfg, "causal_lm")
    return groups.build_actor(cfg, abstract, pools, tok.pad_id, tok.eos_id, tokenizer=tok), tok


def _groups_around(cfg, algo, actor, tok, pools) -> groups.WorkerGroups:
    # Every role the run builds, a reward model (`reward_model.path`) included; around an
    # abstract actor, reward and cost models are built from their configs.
    reward = RuleReward(tok, num_processes=0, home=actor.mesh)
    return groups.build_groups(cfg, actor, reward, run_roles(algo, cfg), pools)


def _rollout(out: _Compiler, w, cfg, tok, name: str, prompts: int, n: int, *,
             temperature: float, greedy: bool) -> None:
    """Compiles the sampler's prefill and decode for `prompts` prompts x `n` samples, and the
    hybrid engine's transitions around them (once, with the training rollout)."""
    a = w.actor
    r = a.rollout  # the RolloutSpec the actor samples with
    engine = a.hybrid
    params = SamplingParams(
        max_new_tokens=r.response_length, temperature=0.0 if greedy else temperature,
        top_k=r.top_k, top_p=r.top_p, min_p=r.min_p, n=n, eos_ids=a.eos_ids)
    sampler = a.sampler
    widest = prompt_bucket(cfg.data.max_prompt_length)
    static = sampler.static_for(sampler.padded_batch(prompts), widest, params)
    # While generating, the decode copy stands in for the training parameters; an offloaded
    # optimizer state waits in host memory.
    replaces = ["actor params"]
    pool = a.pool.name
    if a.trainable is not None:
        # LoRA: the sampler decodes a merged copy of the base (shaped like it), made on the
        # training mesh beside the training params, which stay resident.
        merged = a.base_params()
        state = engine.abstract_decode(merged) if engine is not None else merged
        replaces = []
        if name == "rollout":
            out.compile("rollout.merge_adapters", pool, a.merge_program(), (a.params,), [],
                        {"params": a.params})
    else:
        state = engine.abstract_decode(a.params) if engine is not None else a.params
    if r.offload_optimizer:
        replaces.append("actor optimizer")
    _encode(out, a, cfg, name, prompts)
    if engine is not None and name == "rollout":
        _transition(out, engine, pool, "to_decode", replaces)
    prefill, decode = sampler.programs(static)
    request = sampler.abstract_request(static, params)
    compiled = out.compile(f"{name}.prefill", pool, prefill, (state, *request), replaces,
                           {"params": state})
    shapes = jax.eval_shape(prefill, state, *request)
    carry = jax.tree.map(lambda s, sh: _abstract(s.shape, s.dtype, sh), shapes,
                         compiled.output_shardings)
    out.compile(f"{name}.decode", pool, decode, (state, carry, *request[4:]), replaces,
                {"params": state, "cache and loop state": carry})
    if engine is not None and name == "rollout" and a.trainable is None:
        _transition(out, engine, pool, "to_train", replaces)  # LoRA drops its decode copy


def _encode(out: _Compiler, actor, cfg, name: str, prompts: int) -> None:
    """A vision-language actor's tower over `prompts` prompts' pictures (once per prompt,
    before the params move to the decode layout), each prompt as full of image tokens as
    `data.max_prompt_length` allows."""
    if actor.tower is not None:
        # A frozen tower is an argument, not held again; a training one is part of the params
        # held beside it (its bytes counted twice: a small overestimate).
        passed = [] if actor.tower.trains else ["actor vision tower (frozen)"]
        out.compile(f"{name}.vision_encode", actor.pool.name, actor.tower.encode,
                    vision.abstract_prompts(actor, prompts, cfg.data.max_prompt_length), passed)


def _transition(out: _Compiler, engine, pool: str, direction: str,
                replaces: list[str]) -> None:
    """The hybrid engine's per-parameter programs of one direction as one entry: its peak is
    the largest moment of the sequence (each source buffer is freed after its copy)."""
    progs = engine.transition_programs(direction)
    if not progs:
        return
    to_decode = direction == "to_decode"
    src = [leaf.train if to_decode else leaf.decode for leaf in engine.leaves]
    dst = [leaf.decode if to_decode else leaf.train for leaf in engine.leaves]
    moved = {leaf.name for leaf, _, _ in progs}

    def shard(leaf, sharding) -> int:
        return math.prod(sharding.shard_shape(leaf.shape)) * np.dtype(leaf.dtype).itemsize

    # Parameters that are only re-labelled keep one buffer throughout.
    base = sum(shard(leaf, s) for leaf, s in zip(engine.leaves, src) if leaf.name not in moved)
    before = {leaf.name: shard(leaf, s) for leaf, s in zip(engine.leaves, src)}
    after = {leaf.name: shard(leaf, s) for leaf, s in zip(engine.leaves, dst)}
    args = outs = temp = 0
    flops = seconds = 0.0
    peak_moment = 0
    done_after = 0
    left_before = sum(before[name] for name in moved)
    t0 = time.perf_counter()
    for leaf, program, x in progs:
        compiled = program.lower(x).compile()
        m = compiled.memory_analysis()
        args += m.argument_size_in_bytes
        outs += m.output_size_in_bytes
        temp = max(temp, m.temp_size_in_bytes)
        flops += _flops(compiled)
        moment = base + done_after + left_before + after[leaf.name] + m.temp_size_in_bytes
        peak_moment = max(peak_moment, moment)
        done_after += after[leaf.name]
        left_before -= before[leaf.name]
    seconds = time.perf_counter() - t0
    resident = out.others(pool, replaces)
    out.add(ProgramMemory(
        f"hybrid.{direction}", pool, int(args), int(outs), 0, int(temp), flops, resident,
        int(resident + peak_moment), seconds))


def resolve_remat(cfg):
    """A copy of `cfg` with `model.remat_policy=auto` resolved by `dry_run.choose_remat` against
    device 0's memory ("none" where the runtime reports no limit, as on CPU)."""
    limit = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
    policy, _ = choose_remat(cfg, limit)
    cfg = cfg.copy_and_resolve_references()
    cfg.model.remat_policy = policy
    logging.info("model.remat_policy=auto: %s", policy)
    return cfg
