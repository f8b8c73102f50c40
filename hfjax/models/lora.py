"""Low-rank adapters (LoRA) on the decoder's linear projections.

A target projection W [in, out] (stored stacked over layers, in its logical shape, e.g. q_proj
[layers, embed, heads, head_dim]) gains two adapter arrays in float32:

    <name>_lora_a [layers, *in, rank]     (random, PEFT's Kaiming-uniform bound 1/sqrt(in))
    <name>_lora_b [layers, rank, *out]    (zeros: the adapted model starts as the base)

and the projection computes x @ W + (alpha / rank) * (x @ A) @ B (`hfjax.models.transformer`'s
`_proj`); in a training step with `dropout` > 0, x @ A becomes dropout(x) @ A
(`hfjax.models.lora_dropout`). The adapters are `flax.nnx.LoRAParam` variables (a subclass
of `nnx.Param`), so `nnx.split_state(state, nnx.LoRAParam, ...)` separates what trains from
the frozen base, and the base's own state (everything that is not a LoRAParam) is exactly
the state of the model without adapters: the reference policy reads it under the base
model's graphdef (`base_state`), with no second copy of the weights.

Why not `nnx.LoRA` or Qwix: the decoder keeps each projection as one stacked array that
`lax.scan` slices per layer and `_proj` multiplies as a 2-D matmul (no `nnx.Linear` modules
and no per-layer `dot_general` a library could intercept by module path), so neither wraps
it without rewriting the model; the adapters here are a few arrays next to the base ones,
typed with Flax's own `nnx.LoRAParam`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from hfjax.models import lora_dropout, transformer
from hfjax.models.config import ModelConfig
from hfjax.settings import Check, Float, Int, key

# The linear projections of a decoder layer that can carry adapters, in PEFT's names.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ALL_LINEAR = "all-linear"


def parse_targets(targets: str | Sequence[str]) -> tuple[str, ...]:
    """The projections named by `targets`: "all-linear", a comma-separated string or a list of
    names from TARGETS. Raises ValueError naming an unknown or repeated target."""
    if isinstance(targets, str):
        names = [t.strip() for t in targets.split(",") if t.strip()]
    else:
        names = [str(t).strip() for t in targets]
    if names == [ALL_LINEAR]:
        return TARGETS
    if not names:
        raise ValueError(f"lora.targets is empty; give {ALL_LINEAR!r} or some of "
                         f"{', '.join(TARGETS)}")
    for n in names:
        if n not in TARGETS:
            raise ValueError(f"lora.targets: unknown projection {n!r}; choose {ALL_LINEAR!r} or "
                             f"a list of {', '.join(TARGETS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"lora.targets {','.join(names)} names a projection twice")
    return tuple(n for n in TARGETS if n in names)


_DROPOUT = ("dropout on the adapters' input in training steps (PEFT's lora_dropout); "
            "0: none")


def lora_targets(v) -> str | None:
    if not isinstance(v, str):
        return "needs a string: all-linear or a comma list of projections"
    try:
        parse_targets(v)
    except ValueError as e:
        return str(e).removeprefix("lora.targets: ")
    return None


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """Adapters of `rank` on `targets`, scaled by alpha / rank; `dropout` on their input."""

    # Each field is the config key `<role>.lora.<name>` (`hfjax.config.keys.SPEC_SECTIONS`),
    # whose check is the key's: a config's rank 0 turns the adapters off (`spec_from_config`),
    # its targets are a string (`parse_targets`).
    rank: int = key(Int(0, note="0: train full weights"))
    alpha: float = key(Float(0.0, lo_open=True))
    targets: tuple[str, ...] = key(Check(lora_targets), default=TARGETS)
    dropout: float = key(Float(0.0, 1.0, hi_open=True, note=_DROPOUT), default=0.0)

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"lora.rank={self.rank}; it must be >= 1 (0 turns LoRA off)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout={self.dropout}; it must be in [0, 1)")

    @property
    def scale(self) -> float:
        return float(self.alpha) / float(self.rank)

    def as_dict(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets),
                "dropout": self.dropout}


def spec_from_config(section) -> LoraSpec | None:
    """The LoraSpec of a config section's `lora` entry (`actor.lora`, `critic.lora`), None when
    the section has none (a role without adapters) or its rank is 0. The keys are LoraSpec's
    fields, their defaults the config's (configs/ppo_arith.py): a `lora` entry has all four."""
    lo = section.get("lora") if section is not None else None
    if not lo or not lo.rank:
        return None
    return LoraSpec(rank=int(lo.rank), alpha=float(lo.alpha), targets=parse_targets(lo.targets),
                    dropout=float(lo.dropout))


def projection_axes(cfg: ModelConfig, name: str) -> tuple[tuple, tuple, tuple, tuple]:
    """(in shape, in logical axes, out shape, out logical axes) of projection `name`."""
    D, N, K, H, F = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                     cfg.intermediate_size)
    table = {
        "q_proj": ((D,), ("embed",), (N, H), ("heads", "head_dim")),
        "k_proj": ((D,), ("embed",), (K, H), ("kv_heads", "head_dim")),
        "v_proj": ((D,), ("embed",), (K, H), ("kv_heads", "head_dim")),
        "o_proj": ((N, H), ("heads", "head_dim"), (D,), ("embed",)),
        "gate_proj": ((D,), ("embed",), (F,), ("mlp",)),
        "up_proj": ((D,), ("embed",), (F,), ("mlp",)),
        "down_proj": ((F,), ("mlp",), (D,), ("embed",)),
    }
    return table[name]


def check_targets(cfg: ModelConfig, spec: LoraSpec) -> None:
    """Refuses MLP targets on a mixture of experts (its experts take no adapters)."""
    mlp = [t for t in spec.targets if t in ("gate_proj", "up_proj", "down_proj")]
    if cfg.is_moe and mlp:
        raise ValueError(f"lora.targets {','.join(mlp)} on a mixture-of-experts model: its "
                         "experts take no adapters; target q_proj,k_proj,v_proj,o_proj")


def adapter_shapes(cfg: ModelConfig, spec: LoraSpec) -> dict[str, tuple[int, ...]]:
    """{adapter name: shape} of every adapter array `spec` adds to a model of `cfg`."""
    check_targets(cfg, spec)
    out = {}
    for name in spec.targets:
        ins, _, outs, _ = projection_axes(cfg, name)
        out[f"{name}_lora_a"] = (cfg.num_layers, *ins, spec.rank)
        out[f"{name}_lora_b"] = (cfg.num_layers, spec.rank, *outs)
    return out


def adapter_bytes(cfg: ModelConfig, spec: LoraSpec) -> int:
    """Bytes of the adapters (float32) `spec` adds to a model of `cfg`."""
    return 4 * sum(math.prod(s) for s in adapter_shapes(cfg, spec).values())


def add_adapters(model: nnx.Module, spec: LoraSpec, seed: int = 0) -> nnx.Module:
    """Adds `spec`'s adapters to `model` (a CausalLM, ValueModel or ScoreModel) in place and
    returns it. An abstract model (ShapeDtypeStruct leaves, the dry run) gets abstract
    adapters. Raises ValueError if the model already has adapters."""
    layers = model.model.layers
    if getattr(layers, "lora_scale", None) is not None:
        raise ValueError("the model already carries LoRA adapters")
    cfg = model.config
    check_targets(cfg, spec)
    abstract = isinstance(layers.q_proj.get_value(), jax.ShapeDtypeStruct)
    key = jax.random.key(seed)
    for i, name in enumerate(spec.targets):
        ins, in_axes, outs, out_axes = projection_axes(cfg, name)
        a_shape = (cfg.num_layers, *ins, spec.rank)
        b_shape = (cfg.num_layers, spec.rank, *outs)
        if abstract:
            a = jax.ShapeDtypeStruct(a_shape, jnp.float32)
            b = jax.ShapeDtypeStruct(b_shape, jnp.float32)
        else:
            bound = 1.0 / math.sqrt(math.prod(ins))
            a = jax.random.uniform(jax.random.fold_in(key, i), a_shape, jnp.float32,
                                   -bound, bound)
            b = jnp.zeros(b_shape, jnp.float32)
        setattr(layers, f"{name}_lora_a",
                nnx.LoRAParam(a, logical_axes=("layers", *in_axes, None)))
        setattr(layers, f"{name}_lora_b",
                nnx.LoRAParam(b, logical_axes=("layers", None, *out_axes)))
    layers.lora_scale = spec.scale
    layers.lora_dropout = spec.dropout
    # Training steps draw the adapters' dropout masks from this seed (`dropout_of`).
    layers.lora_seed = int(seed)
    return model


def dropout_of(model: nnx.Module) -> lora_dropout.Dropout | None:
    """The adapter dropout a training step of `model` applies (`hfjax.models.lora_dropout`):
    None without adapters or at lora.dropout 0."""
    layers = model.model.layers
    rate = float(getattr(layers, "lora_dropout", 0.0) or 0.0)
    if getattr(layers, "lora_scale", None) is None or rate == 0.0:
        return None
    return lora_dropout.Dropout(rate, int(layers.lora_seed))


def trainable_filter(state):
    """The NNX filter of what trains in a model state with adapters: the adapters, plus a
    value or score head (`score`, which starts at zero and has no base to keep); None without
    adapters (everything trains)."""
    if not has_adapters(state):
        return None
    return nnx.Any(nnx.LoRAParam, nnx.PathContains("score"))


def has_adapters(state) -> bool:
    """True when a model state holds LoRA adapters."""
    return bool(jax.tree.leaves(nnx.filter_state(state, nnx.LoRAParam)))


def adapter_state(state):
    """The adapters of a model state (its LoRAParam variables)."""
    return nnx.filter_state(state, nnx.LoRAParam)


def base_state(state):
    """The frozen base of a model state: every variable that is not an adapter; the state of
    the same model without adapters."""
    return nnx.filter_state(state, nnx.Not(nnx.LoRAParam))


def base_graphdef(model: nnx.Module) -> nnx.GraphDef:
    """The graphdef of `model` without its adapters (the base model's), for `base_state`."""
    cfg = model.config
    head = {transformer.CausalLM: "causal_lm", transformer.ValueModel: "value",
            transformer.ScoreModel: "score"}[type(model)]
    return nnx.split(transformer.abstract(cfg, head))[0]


def leaf_names(state) -> dict[str, jax.Array]:
    """{pytree path: array} of a state's leaves (the names fingerprints are recorded under)."""
    return {jax.tree_util.keystr(path): x
            for path, x in jax.tree_util.tree_flatten_with_path(state)[0]}


def merge_deltas(arrays: dict[str, jax.Array], scale: float) -> dict[str, jax.Array]:
    """Layer arrays {name: stacked array} with every adapted projection replaced by
    W + scale * A @ B in W's dtype (the product in float32) and the adapters dropped: the
    merged weights a decode step multiplies once instead of three times."""
    out = {k: v for k, v in arrays.items() if "_lora_" not in k}
    for k, a in arrays.items():
        if not k.endswith("_lora_a"):
            continue
        name = k[: -len("_lora_a")]
        b = arrays[f"{name}_lora_b"]
        w = out[name]
        L, r = a.shape[0], a.shape[-1]
        delta = jnp.einsum("lir,lro->lio", a.reshape(L, -1, r).astype(jnp.float32),
                           b.reshape(L, r, -1).astype(jnp.float32)) * scale
        out[name] = (w.astype(jnp.float32) + delta.reshape(w.shape)).astype(w.dtype)
    return out


def merged_state(graphdef: nnx.GraphDef, base_graphdef: nnx.GraphDef, params):
    """The base state of `params` (a state of `graphdef`, with adapters) with every adapted
    projection merged (`merge_deltas`): a state of `base_graphdef`, what a decode step of the
    base model reads. Use inside a jitted program."""
    arrays = nnx.merge(graphdef, params).model.layers.arrays()  # B already scaled
    merged = merge_deltas(arrays, 1.0)
    base = nnx.merge(base_graphdef, base_state(params))
    for name in merged:
        if f"{name}_lora_a" in arrays:
            getattr(base.model.layers, name).set_value(merged[name])
    return nnx.state(base)
