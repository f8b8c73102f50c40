"""What one program call of an RLHF step costs a model: the cost source the planner reads.

The planner (`hfjax.planner.search`) prices a model in a layout through two questions:

- `state(model, layout)`: the bytes each device keeps between calls (parameters, and Adam's two
  moments for a trained model);
- `call(model, layout, call)`: for one program call (a forward pass over a batch, one
  mini-batch update, a prefill, one decode step), the FLOPs and HBM bytes per device, and the
  bytes each device holds on top of its state while the call runs.

`PriceSource` is that protocol. `ClosedFormPrices` answers it from the model's shapes with the
formulas below. `hfjax.planner.compiled.CompiledPrices` compiles each program from abstract
shapes and reads XLA's `cost_analysis()` (flops, bytes accessed) and `memory_analysis()`
(arguments, outputs and temporaries, less the parameters), with these formulas where it cannot
compile; the planner takes any `PriceSource` (`plan(..., costs=...)`, or
`hfjax.planner.refine.reprice` for the search's finalists).

## The closed forms

Shapes: V vocab, D hidden, F intermediate, L layers, N query heads, K KV heads, H head dim;
c bytes of the compute dtype, p of the parameter dtype; t the tensor size, dp = data x fsdp the
data-parallel size, r = ceil(rows / dp) the rows one device processes.

Parameters per device: each leaf's shard under the layout's rules (`virtual.leaf_specs`, the
runs' own rules: KV projections that t does not divide are replicated), times p. A trained
model keeps two Adam moments of the same size (optax keeps them in the parameter dtype).

FLOPs (2 per multiply-add, matmuls only; norms, softmax and RoPE are left out):
- one layer, per token, at context length S: 2 W + 4 N H S, with W = D H (2N + 2K) + 3 D F the
  layer's matmul weights; the attention products are dense over all S keys (the model masks a
  causal pass, it does not skip);
- forward over r rows of s tokens, h of them through the head: r s L (2W + 4NHs) plus the head,
  2 D V r h (LM head, only the response positions are scored), 2 D r s (value), 2 D r (score);
- a training step: 3x the forward (backward twice the forward), plus one more forward of the
  layers with remat "full";
- prefill of r prompts of P tokens: the forward at s = P, with the LM head at one position;
- one decode step of r rows over S cache slots: r (L (2W + 4NHS) + 2DV);
- per device, divided by t; scoring and training calls also by the sequence size sp (a device
  holds 1/sp of each row's tokens, and under Ulysses attends N/sp heads over the whole row),
  as are their activations and logits below.

HBM bytes: a compute-bound pass reads its weights (each pass over the model reads the t-shard
of every weight, in the parameter dtype) and writes and reads its activations once; a decode
step reads the decode shard of the weights and the whole KV cache (the loop attends over every
preallocated slot), r S 2 L K H c / t_kv bytes, where t_kv = t when t divides K, else 1.

Activations, bytes per token of one layer (the tensors the layer's backward pass reads):
    a(s) = c (4D + 4F / t) + a ((2N + 3K) H / t + N H / t) + 8 D + N s (4 + a) / t
(two float32 RMSNorm inputs of D, the normed inputs, q/k/v and their RoPE'd copies, scores in
float32 and probabilities, the attention output, the residuals, gate/up/silu/product of the MLP),
with a the bytes of the attention's dtype (`storage_dtype`: c, except float32 for a 16-bit
model on CPU).
- training keeps, per token and layer, a(s) (remat "none"), c D (remat "full": the layer input),
  the matmul outputs a (N + 2K) H / t + c (2F / t + 2D) (remat "dots_no_batch"), plus the
  attention products a N H / t + 4 N s / t (remat "dots"); over the micro-batch's rows on the
  device, plus one layer's a(s) during its backward, the float32 logits (x3: logits, their
  log-softmax, the gradient) of the scored positions, and two gradient buffers the size of the
  parameters (the accumulator and the micro-batch's);
- a forward pass holds one layer's a(s) for all its rows (the log-prob passes run the whole
  batch in one call), two hidden-state buffers, and the scored float32 logits (x2);
- generation holds the KV cache (rows x slots x 2 L K H c / t_kv), a second copy of the decode
  weights (the decode program slices the layers once per call) and the step's logits.

These are estimates of what XLA keeps; the tests check them against hand computations, and a
compiled source replaces them with what XLA reports.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Protocol

import numpy as np

from hfjax.models.backend import storage_dtype
from hfjax.models.config import ModelConfig
from hfjax.models.flops import (  # noqa: F401
    active_mlp_width,
    head_flops,
    layer_matmul_params,
    layers_flops,
)
from hfjax.models.lora import LoraSpec, adapter_bytes
from hfjax.planner import virtual

HEADS = ("causal_lm", "value", "score")
KINDS = ("forward", "train", "prefill", "decode")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One model of a run: its role, shapes, head and whether it trains. `lora`: it trains
    LoRA adapters of this spec (`hfjax.models.lora`) over a frozen base; `shares_base_of`:
    the role whose frozen base this model reads (a LoRA actor's reference), so it holds no
    state of its own and must share that role's pool."""

    role: str
    config: ModelConfig
    head: str = "causal_lm"
    trainable: bool = False
    name: str = ""
    lora: LoraSpec | None = None
    shares_base_of: str = ""

    def __post_init__(self):
        if self.head not in HEADS:
            raise ValueError(f"model {self.role!r}: unknown head {self.head!r}; one of {HEADS}")

    @property
    def label(self) -> str:
        return self.name or f"{self.role} ({self.config.num_params() / 1e9:.2f}B)"


@dataclasses.dataclass(frozen=True)
class MeshLayout:
    """Axis sizes and layout rules of one model's mesh."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    rules: str = "train"
    # Sequence parallelism: each training or scoring row's tokens split this many ways
    # (`hfjax.models.sequence_parallel`); FSDP spans it too.
    sequence: int = 1

    @property
    def n(self) -> int:
        return self.data * self.fsdp * self.sequence * self.tensor

    @property
    def dp(self) -> int:
        return self.data * self.fsdp

    def sizes(self) -> dict[str, int]:
        return virtual.mesh_sizes(self.data, self.fsdp, self.tensor, self.sequence)

    @property
    def mesh(self) -> str:
        """The mesh as a config string, e.g. 'data=2,fsdp=4,tensor=2' (size-1 axes left out)."""
        parts = [f"{a}={s}" for a, s in (("data", self.data), ("fsdp", self.fsdp),
                                          ("sequence", self.sequence), ("tensor", self.tensor))
                 if s > 1]
        return ",".join(parts) or "data=1"


@dataclasses.dataclass(frozen=True)
class Call:
    """The shape of one program call.

    kind: "forward" (a scoring pass over the batch), "train" (one mini-batch update),
    "prefill" (the prompts) or "decode" (one step). rows: the call's global rows; seq: tokens
    per row (decode: cache slots); scored: positions per row through the head; micro: rows per
    micro-batch of a training call (global); samples: responses per row of a scoring or
    training call (`hfjax.engine.shared_prompt`): a row is then one prompt of seq - scored
    tokens followed by `samples` responses of scored / samples tokens each, every response
    attending over the prompt and itself.
    """

    kind: str
    rows: int
    seq: int
    scored: int = 0
    micro: int = 0
    samples: int = 1

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown call kind {self.kind!r}; one of {KINDS}")
        if self.samples < 1 or (self.samples > 1 and self.scored % self.samples):
            raise ValueError(f"samples={self.samples}: rows of {self.scored} scored positions "
                             "don't hold that many equal responses")

    @property
    def context(self) -> int:
        """Keys a response token attends over: the whole row, or with shared-prompt rows the
        prompt and its own response."""
        if self.samples == 1:
            return self.seq
        return self.seq - self.scored + self.scored // self.samples

    def layers_flops(self, cfg: ModelConfig, rows: int) -> float:
        """FLOPs of the decoder layers over `rows` of this call's rows (scoring and training
        calls): every token over the whole row, or with shared-prompt rows the prompt's tokens
        over the prompt and each response's over the prompt and itself."""
        if self.samples == 1:
            return layers_flops(cfg, rows, self.seq, self.seq)
        prompt = self.seq - self.scored
        return (layers_flops(cfg, rows, prompt, prompt)
                + layers_flops(cfg, rows, self.scored, self.context))

    def forward_flops(self, cfg: ModelConfig, head: str, rows: int) -> float:
        """FLOPs of one forward pass over `rows` of this call's rows: the layers and the head."""
        return self.layers_flops(cfg, rows) + head_flops(cfg, head, rows, self.seq, self.scored)


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """Bytes one device keeps between calls."""

    params: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.optimizer


@dataclasses.dataclass(frozen=True)
class CallPrice:
    """Per device, one call: FLOPs, HBM bytes moved, and bytes held on top of the state."""

    flops: float
    bytes_accessed: float
    extra_bytes: float


class PriceSource(Protocol):
    """Answers the planner's two questions about a model in a layout."""

    def state(self, model: ModelSpec, layout: MeshLayout) -> StateBytes: ...

    def call(self, model: ModelSpec, layout: MeshLayout, call: Call) -> CallPrice: ...


# Keyed by repr: a ModelConfig with a dict field (llama3 RoPE scaling) is not hashable.
_LEAVES: dict[str, tuple[virtual.Leaf, ...]] = {}


def model_leaves(model: ModelSpec) -> tuple[virtual.Leaf, ...]:
    """The model's parameters as Leafs, from abstract shapes (nothing is allocated)."""
    from hfjax.models.presets import abstract_state

    key = repr(model.config) + model.head
    if key not in _LEAVES:
        _LEAVES[key] = virtual.leaves_of(abstract_state(model.config, model.head))
    return _LEAVES[key]


@functools.lru_cache(maxsize=16384)
def _param_shard(key: str, leaves: tuple[virtual.Leaf, ...], rules: str, data: int, fsdp: int,
                 tensor: int, sequence: int = 1) -> int:
    del key
    sizes = virtual.mesh_sizes(data, fsdp, tensor, sequence)
    return virtual.shard_bytes(leaves, virtual.leaf_specs(leaves, rules, sizes), sizes)


def param_shard_bytes(model: ModelSpec, layout: MeshLayout) -> int:
    """Bytes of the model's parameters on one device of `layout` (ValueError when the rules
    cannot split a dimension the way the mesh asks)."""
    leaves = model_leaves(model)
    return _param_shard(repr(model.config) + model.head, leaves, layout.rules, layout.data,
                        layout.fsdp, layout.tensor, layout.sequence)


def lora_shard_bytes(model: ModelSpec, layout: MeshLayout) -> int:
    """Bytes of the model's float32 LoRA adapters on one device of `layout` (split like the
    weights they adapt: over fsdp and tensor), 0 without adapters."""
    if model.lora is None:
        return 0
    return math.ceil(adapter_bytes(model.config, model.lora) / (layout.fsdp * layout.tensor))


def forward_flops(cfg: ModelConfig, head: str, rows: int, seq: int, scored: int) -> float:
    """FLOPs of one forward pass over rows x seq tokens (global, before any split)."""
    return Call("forward", rows, seq, scored).forward_flops(cfg, head, rows)


def kv_bytes_per_token(cfg: ModelConfig, platform: str = "gpu") -> int:
    """KV-cache bytes per token over all layers on `platform`: 2 L K H c, c the size of the
    cache's dtype there (`hfjax.models.backend.storage_dtype`: a 16-bit model's cache is
    float32 on CPU)."""
    c = storage_dtype(cfg.jnp_dtype, platform).itemsize
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * c


def kv_split(cfg: ModelConfig, tensor: int) -> int:
    """How many ways the KV cache splits over `tensor` (1 when tensor does not divide K)."""
    return tensor if cfg.num_kv_heads % tensor == 0 else 1


def layer_activation_bytes(cfg: ModelConfig, seq: int, tensor: int,
                           platform: str = "gpu") -> float:
    """a(s): bytes per token of one layer's activations on `platform` (module docstring)."""
    c, a = _itemsize(cfg.dtype), _attention_itemsize(cfg, platform)
    # A mixture of experts' activations are its k active experts' (`active_mlp_width`).
    d, f, n, k, h = (cfg.hidden_size, active_mlp_width(cfg), cfg.num_heads, cfg.num_kv_heads,
                     cfg.head_dim)
    return (c * (4 * d + 4 * f / tensor) + a * ((2 * n + 3 * k) * h + n * h) / tensor + 8 * d
            + n * seq * (4 + a) / tensor)


def saved_activation_bytes(cfg: ModelConfig, seq: int, tensor: int,
                           platform: str = "gpu") -> float:
    """Bytes per token of one layer that training keeps for the backward pass on `platform`,
    by remat policy (module docstring)."""
    c, a = _itemsize(cfg.dtype), _attention_itemsize(cfg, platform)
    # A mixture of experts' activations are its k active experts' (`active_mlp_width`).
    d, f, n, k, h = (cfg.hidden_size, active_mlp_width(cfg), cfg.num_heads, cfg.num_kv_heads,
                     cfg.head_dim)
    policy = cfg.remat_policy
    if policy == "none":
        return layer_activation_bytes(cfg, seq, tensor, platform)
    if policy == "full":
        return float(c * d)
    dots = a * (n + 2 * k) * h / tensor + c * (2 * f / tensor + 2 * d)
    if policy == "dots_no_batch":
        return float(dots)
    return dots + a * n * h / tensor + 4 * n * seq / tensor


def _attention_itemsize(cfg: ModelConfig, platform: str) -> int:
    """Bytes per element of q/k/v, the attention and its output on `platform`
    (`hfjax.models.backend.storage_dtype`: float32 for a 16-bit model on CPU)."""
    return int(storage_dtype(cfg.jnp_dtype, platform).itemsize)


def _itemsize(dtype: str) -> int:
    return int(np.dtype(dtype).itemsize)


class ClosedFormPrices:
    """The `PriceSource` of the closed forms in this module's docstring, for devices of
    `platform` ("gpu", "tpu" or "cpu": it decides the KV cache's dtype)."""

    def __init__(self, platform: str = "gpu"):
        self.platform = platform

    def state(self, model: ModelSpec, layout: MeshLayout) -> StateBytes:
        if model.shares_base_of:
            return StateBytes(0, 0)  # reads the other role's base, held there
        params = param_shard_bytes(model, layout)
        if model.lora is not None:
            # The frozen base, plus float32 adapters and their two Adam moments.
            adapters = lora_shard_bytes(model, layout)
            return StateBytes(params + adapters, 2 * adapters if model.trainable else 0)
        return StateBytes(params, 2 * params if model.trainable else 0)

    def call(self, model: ModelSpec, layout: MeshLayout, call: Call) -> CallPrice:
        cfg, t = model.config, layout.tensor
        weights = sum(leaf.nbytes for leaf in model_leaves(model)) / t  # one pass reads these
        r = math.ceil(call.rows / layout.dp)
        if call.kind == "decode":
            kv = r * call.seq * kv_bytes_per_token(cfg, self.platform) / kv_split(cfg, t)
            logits = r * cfg.vocab_size * 4 / t
            flops = (layers_flops(cfg, r, 1, call.seq) + 2.0 * cfg.hidden_size * cfg.vocab_size
                     * r) / t
            shard = param_shard_bytes(model, layout)
            return CallPrice(flops, shard + kv + logits, kv + shard + 2 * logits)
        act = layer_activation_bytes(cfg, call.context, t, self.platform)
        if call.kind == "prefill":
            flops = (layers_flops(cfg, r, call.seq, call.seq)
                     + 2.0 * cfg.hidden_size * cfg.vocab_size * r) / t
            kv = r * call.seq * kv_bytes_per_token(cfg, self.platform) / kv_split(cfg, t)
            working = r * call.seq * act
            return CallPrice(flops, weights + 2 * r * call.seq * cfg.num_layers * act,
                            working + kv)
        # Sequence parallelism: a device holds 1/sp of each row's tokens (and computes 1/sp of
        # its attention: Ulysses gives it N/sp heads over the whole row).
        sp = layout.sequence
        logits = _head_bytes(cfg, model.head, r, call.seq, call.scored, t) / sp
        if call.kind == "forward":
            flops = call.forward_flops(cfg, model.head, r) / (t * sp)
            traffic = weights + 2 * r * call.seq * cfg.num_layers * act / sp
            hidden = 2 * r * call.seq * cfg.hidden_size * _itemsize(cfg.dtype) / sp
            return CallPrice(flops, traffic, r * call.seq * act / sp + hidden + 2 * logits)
        # train: one mini-batch of call.rows rows in micro-batches of call.micro rows.
        micro = call.micro or call.rows
        n_micro = call.rows // micro
        m = math.ceil(micro / layout.dp)
        fwd = call.forward_flops(cfg, model.head, m)
        extra = call.layers_flops(cfg, m) if cfg.remat_policy == "full" else 0.0
        flops = n_micro * (3 * fwd + extra) / (t * sp)
        passes = 3 + (cfg.remat_policy == "full")
        traffic = n_micro * (passes * weights + 2 * m * call.seq * cfg.num_layers * act / sp)
        per_token = saved_activation_bytes(cfg, call.context, t, self.platform)
        saved = m * call.seq * cfg.num_layers * per_token / sp
        grads = (lora_shard_bytes(model, layout) if model.lora is not None
                 else 2 * param_shard_bytes(model, layout))
        held = saved + m * call.seq * act / sp + 3 * _head_bytes(cfg, model.head, m, call.seq,
                                                                 call.scored, t) / sp + grads
        return CallPrice(flops, traffic, held)


def _head_bytes(cfg: ModelConfig, head: str, rows: int, seq: int, scored: int,
                tensor: int) -> float:
    """Bytes of the head's float32 outputs: logits of the scored positions (split over the
    vocabulary by `tensor`), or one value per position."""
    if head == "causal_lm":
        return rows * scored * cfg.vocab_size * 4 / tensor
    return rows * seq * 4.0
