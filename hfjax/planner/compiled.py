"""Compiled prices: the planner's `PriceSource` read from XLA's analysis of compiled programs.

`CompiledPrices` answers `call(model, layout, call)` by compiling the model's own pass for that
call at abstract shapes (nothing is allocated, no weight is read) and reading
`compiled.cost_analysis()` (flops, bytes accessed) and `compiled.memory_analysis()` (argument,
output, aliased and temporary bytes), per device:

- "forward": the scoring pass over one device's rows (`ceil(rows / dp)`): the hidden states, and
  the head's log-probs of the scored positions (values, or the score, for the other heads);
- "train": the gradient of that pass over one device's share of a micro-batch, added into a
  donated accumulator (the runs' gradient accumulation), times the call's micro-batches;
- "prefill": the prompts written into a KV cache of the call's slots, the last position's logits;
- "decode": one token per row against a cache of the call's slots.

Each is compiled on a mesh of the layout's `tensor` devices (of this process's devices) with the
layout's rules, as the workers lay the model out: tensor parallelism splits a device's work, so
its per-device FLOPs and bytes are the compiled program's. The data-parallel and FSDP axes only
decide the rows a device processes and the collectives around its work, which the simulator
prices (`hfjax.planner.simulator`); the parameters are then whole on the tensor group, so FSDP's
gathered weights are counted as arguments, not as the temporaries they are in a run.

XLA's `cost_analysis()` counts a loop body once, so a layer scan would report one layer. The
pass is compiled unrolled with one layer and with two, and every figure is extrapolated to L
layers: f(L) = f(1) + (L - 1) (f(2) - f(1)). That is exact for FLOPs and bytes (the layers are
alike), and for what grows layer by layer in memory (saved activations, gradients, the cache);
temporaries that XLA reuses across layers come out as one layer's, as in the scanned program.
`state(model, layout)` is the closed forms' (parameter shards under the runs' own rules: already
exact).

Where a program cannot be compiled here, the call is priced by the closed forms
(`ClosedFormPrices`), and `fallbacks` says which program and why: a tensor size larger than this
process's devices, shared-prompt rows (the stand-in programs use padded rows), a compile error,
or the compile budget (`budget_s`) spent. Figures are cached per (model, program, per-device
shapes, tensor size, rules): a search over many allocations compiles each program once.

Programs are compiled by XLA:CPU when the planning process runs on CPU devices, for the
target's platform (`hfjax.models.backend.compiling_for`): a 16-bit model's attention inputs and
KV cache are in the target's dtype (bfloat16 for a bf16 model on a GPU or TPU target, as the
closed forms price them; float32 only for a CPU target), and kernels only the target has are
compiled as their portable stand-ins of the same memory behaviour (blockwise attention, the
chunked decode read). What remains different is the compiler: an accelerator's fuses
differently, so its temporaries differ somewhat (XLA:CPU computes bfloat16 element-wise work in
float32 between conversions, which can add float32 temporaries the accelerator does not have).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging
from flax import nnx

from hfjax.models import backend, transformer
from hfjax.parallel import sharding as shd
from hfjax.parallel.mesh import MeshSpec
from hfjax.planner.pricing import (
    Call,
    CallPrice,
    ClosedFormPrices,
    MeshLayout,
    ModelSpec,
    StateBytes,
)

# Layer counts compiled for the extrapolation (unrolled).
_LAYERS = (1, 2)


@dataclasses.dataclass(frozen=True)
class ProgramFigures:
    """One compiled program's per-device figures: FLOPs, bytes accessed, and bytes it holds on
    top of the parameters it reads (arguments + outputs - donated + temporaries - parameters)."""

    flops: float
    bytes_accessed: float
    extra_bytes: float
    compile_s: float


class CompileFailed(Exception):
    """A program could not be compiled here (the message says why)."""


class CompiledPrices:
    """A `PriceSource` from compiled programs, with the closed forms where compiling is not
    possible (module docstring).

    platform: the target's ("gpu", "tpu", "cpu"): attention is compiled as it runs there
    (`hfjax.models.backend.compiling_for`) and the fallback's closed forms are that platform's.
    devices: the devices to compile on (default `jax.devices()`). budget_s: compile seconds
    after which new programs are priced by the closed forms (None: no limit).
    """

    def __init__(self, platform: str = "gpu", devices: Sequence[Any] | None = None,
                 budget_s: float | None = 120.0):
        self.platform = platform
        self.devices = list(devices) if devices is not None else jax.devices()
        self.budget_s = budget_s
        self.closed = ClosedFormPrices(platform)
        self.compile_s = 0.0
        self.compiles = 0  # programs compiled (each of the two layer counts counts once)
        self._cache: dict[tuple, ProgramFigures | str] = {}
        # Program label -> why the closed forms priced it / its compiled figures (labels name
        # the role, not the model: two models of one role share a label).
        self.fallbacks: dict[str, str] = {}
        self.priced: dict[str, ProgramFigures] = {}

    @property
    def programs(self) -> int:
        """Programs priced from compiled figures so far (each compiled at two layer counts)."""
        return sum(1 for v in self._cache.values() if not isinstance(v, str))

    def state(self, model: ModelSpec, layout: MeshLayout) -> StateBytes:
        return self.closed.state(model, layout)

    def call(self, model: ModelSpec, layout: MeshLayout, call: Call) -> CallPrice:
        figures = self.figures(model, layout, call)
        if figures is None:
            return self.closed.call(model, layout, call)
        n = call.rows // call.micro if call.kind == "train" and call.micro else 1
        return CallPrice(n * figures.flops, n * figures.bytes_accessed, figures.extra_bytes)

    def figures(self, model: ModelSpec, layout: MeshLayout, call: Call) -> ProgramFigures | None:
        """The compiled figures of one call's program on one device (one micro-batch for
        "train"), or None where the closed forms price it (`fallbacks` says why)."""
        per_call = (call.micro or call.rows) if call.kind == "train" else call.rows
        rows = math.ceil(per_call / layout.dp)
        t = layout.tensor
        label = (f"{model.role}.{call.kind} [{rows} x {call.seq}"
                 + (f", {call.scored} scored" if call.kind in ("forward", "train") else "")
                 + f"] tensor={t} {layout.rules}")
        key = (repr(model.config), model.head, call.kind, rows, call.seq, call.scored,
               call.samples, t, layout.rules)
        if key not in self._cache:
            self._cache[key] = self._compile(model, layout, call, rows)
            got = self._cache[key]
            if isinstance(got, str):
                self.fallbacks[label] = got
                logging.info("compiled prices: %s priced by the closed forms (%s)", label, got)
            else:
                self.priced[label] = got
        got = self._cache[key]
        return None if isinstance(got, str) else got

    def _compile(self, model: ModelSpec, layout: MeshLayout, call: Call,
                 rows: int) -> ProgramFigures | str:
        """The program's figures, or the reason it was not compiled."""
        t = layout.tensor
        if t > len(self.devices):
            return f"tensor={t} needs {t} devices to compile on; this process has " \
                   f"{len(self.devices)}"
        if call.samples > 1:
            return "shared-prompt rows (compiled programs use padded rows)"
        if self.budget_s is not None and self.compile_s >= self.budget_s:
            return f"compile budget of {self.budget_s:g} s spent"
        t0 = time.perf_counter()
        try:
            parts = [compile_pass(model, layout.rules, self.devices[:t], call, rows, layers,
                                  self.platform) for layers in _LAYERS]
        except CompileFailed as err:
            return str(err)
        except Exception as err:  # noqa: BLE001  (any compiler error: the closed forms price it)
            return f"compile failed: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
        finally:
            self.compile_s += time.perf_counter() - t0
        self.compiles += len(parts)
        n_layers = model.config.num_layers
        (f1, b1, e1), (f2, b2, e2) = parts

        def at_l(one: float, two: float) -> float:
            return one + (n_layers - 1) * (two - one)

        return ProgramFigures(at_l(f1, f2), at_l(b1, b2), max(0.0, at_l(e1, e2)),
                              time.perf_counter() - t0)


def compile_pass(model: ModelSpec, rules: str, devices: Sequence[Any], call: Call, rows: int,
                 layers: int, platform: str) -> tuple[float, float, float]:
    """(FLOPs, bytes accessed, extra bytes) per device of `call`'s program for `rows` rows of a
    `layers`-layer copy of the model (unrolled), laid out under `rules` on a tensor mesh of
    `devices`."""
    cfg = model.config.replace(num_layers=layers, scan_layers=False)
    mesh = MeshSpec.parse(f"tensor={len(devices)}").build(devices)
    try:
        lay = shd.layout(mesh, rules)
        graphdef, state = nnx.split(transformer.abstract(cfg, model.head))
        shardings = lay.state_shardings(state)
    except ValueError as err:
        raise CompileFailed(f"layout: {err}") from None
    params = jax.tree.map(
        lambda sh, var: var.replace(jax.ShapeDtypeStruct(var.get_value().shape,
                                                         var.get_value().dtype, sharding=sh)),
        shardings, state, is_leaf=shd.is_variable)
    whole = lay.replicated()

    def ids(n: int, width: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((n, width), jnp.int32, sharding=whole)

    def scores(params, input_ids, responses):
        m = nnx.merge(graphdef, params)
        mask = jnp.ones_like(input_ids)
        if model.head != "causal_lm":
            return m(input_ids, mask)
        hidden, _ = m.model(input_ids, mask)
        logits = m.logits(hidden[:, -call.scored - 1:-1])
        logp = jax.nn.log_softmax(logits, axis=-1)
        return jnp.take_along_axis(logp, responses[..., None], axis=-1)[..., 0]

    cache_dtype = backend.storage_dtype(cfg.jnp_dtype, platform)  # the target's cache
    kv = jax.ShapeDtypeStruct((layers, rows, call.seq, cfg.num_kv_heads, cfg.head_dim),
                              cache_dtype, sharding=lay.sharding(
                                  (None, None, None, "kv_heads", None),
                                  (layers, rows, call.seq, cfg.num_kv_heads, cfg.head_dim),
                                  "kv_cache"))

    if call.kind == "forward":
        fn, args, donate = scores, (params, ids(rows, call.seq), ids(rows, call.scored)), ()
    elif call.kind == "train":
        def accumulate(params, acc, input_ids, responses):
            grads = jax.grad(lambda p: jnp.sum(scores(p, input_ids, responses)))(params)
            return jax.tree.map(jnp.add, acc, grads)

        fn, donate = accumulate, (1,)
        args = (params, params, ids(rows, call.seq), ids(rows, call.scored))
    else:
        width = call.seq if call.kind == "prefill" else 1
        start = 0 if call.kind == "prefill" else call.seq - 1

        def step(params, k, v, input_ids):
            m = nnx.merge(graphdef, params)
            positions = start + jnp.broadcast_to(jnp.arange(width), input_ids.shape)
            mask = jnp.ones((input_ids.shape[0], call.seq), jnp.int32)
            hidden, cache = m.model(input_ids, mask, positions=positions,
                                    cache=transformer.KVCache(k, v), cache_index=start)
            return m.logits(hidden[:, -1]), cache.k, cache.v

        fn, donate = step, (1, 2)
        args = (params, kv, kv, ids(rows, width))
    with backend.compiling_for(platform):
        compiled = jax.jit(shd.under_layout(lay, fn), donate_argnums=donate).lower(
            *args).compile()
    cost = compiled.cost_analysis()
    if isinstance(cost, list):  # older JAX: one dict per device program
        cost = cost[0] if cost else {}
    cost = cost or {}
    mem = compiled.memory_analysis()
    param_bytes = _device_bytes(params)
    extra = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
             + mem.temp_size_in_bytes - param_bytes)
    return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0)), float(extra)


def _device_bytes(tree) -> int:
    """Bytes the first device holds of `tree`'s abstract arrays."""
    total = 0
    for x in jax.tree.leaves(tree):
        total += math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
    return total
