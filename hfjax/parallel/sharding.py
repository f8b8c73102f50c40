"""Layouts: a mesh plus rules that map logical parameter axes to mesh axes.

Model code names each parameter dimension once (vocab, embed, heads, kv_heads, head_dim, mlp,
norm, layers). A `Layout` turns those names into `NamedSharding`s on its mesh, so swapping a
mesh or a rule never touches model code.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hfjax.parallel import mesh as mesh_lib

Rule = str | tuple[str, ...] | None

# Training: FSDP over `embed`, tensor parallel over heads / mlp / vocab.
TRAIN_RULES: dict[str, Rule] = {
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "norm": None,
    "layers": None,
    "expert": "expert",  # a mixture of experts' experts (hfjax.models.expert_parallel)
    # A vision tower's own dimensions (hfjax.models.vision), split as the decoder's are.
    "vision_embed": "fsdp",
    "vision_heads": "tensor",
    "vision_mlp": "tensor",
}

# Decoding: tensor parallel only; every other dimension replicated.
DECODE_RULES: dict[str, Rule] = {**TRAIN_RULES, "embed": None, "vision_embed": None}

# Training rules whose shards nest inside DECODE_RULES shards (the hybrid engine's layout):
# `fsdp` splits the same dimensions as `tensor` where it divides them, so a device's training
# shard lies inside its decode shard. A tuple rule takes the longest prefix of its axes that
# divides the dimension (28 heads on tensor=2 x fsdp=4 split over tensor only), and the axes it
# leaves go to `embed` (a single-axis rule is applied after the tuple rules of the same tensor),
# as FSDP over the hidden dimension does: every model divides on some dimension.
NESTED_TRAIN_RULES: dict[str, Rule] = {
    **TRAIN_RULES,
    "embed": "fsdp",
    "vocab": ("tensor", "fsdp"),
    "heads": ("tensor", "fsdp"),
    "kv_heads": ("tensor", "fsdp"),
    "mlp": ("tensor", "fsdp"),
    "vision_heads": ("tensor", "fsdp"),
    "vision_mlp": ("tensor", "fsdp"),
}

RULE_SETS = {"train": TRAIN_RULES, "decode": DECODE_RULES, "nested_train": NESTED_TRAIN_RULES}


def is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def flatten_state(state: Any) -> tuple[list[Any], Any]:
    """(leaves, treedef) of a state whose leaves are nnx Variables or plain arrays."""
    return jax.tree.flatten(state, is_leaf=is_variable)


def leaf_value(leaf: Any) -> Any:
    """The array a `flatten_state` leaf holds."""
    return leaf.get_value() if is_variable(leaf) else leaf


def with_value(leaf: Any, value: Any) -> Any:
    """A `flatten_state` leaf holding `value` instead (a new Variable, or the value itself)."""
    return leaf.replace(value) if is_variable(leaf) else value


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh plus logical-axis rules.

    `replicate_indivisible` lists logical axes that are replicated, with a logged warning, when
    their mesh axes do not divide them (for example 3 KV heads on `tensor=2`: replicating the KV
    projections is the common practice). Any other indivisible dimension is an error.

    `sequence_parallel` ("ulysses" or "ring") is how attention runs when the mesh splits a
    row's tokens over `sequence` (`hfjax.models.sequence_parallel`).
    """

    mesh: Mesh
    rules: Mapping[str, Rule] = dataclasses.field(default_factory=lambda: dict(TRAIN_RULES))
    replicate_indivisible: Sequence[str] = ("kv_heads",)
    sequence_parallel: str = "ulysses"

    def spec(self, axes: Sequence[str | None], shape: Sequence[int], name: str = "?") -> P:
        """The PartitionSpec for one tensor with the given logical axes and shape.

        Dimensions whose rule is a tuple of mesh axes are placed first, in order, each on the
        longest prefix of its axes that divides it; then single-axis rules take what is left.
        Raises ValueError naming the tensor when a single-axis rule does not divide its
        dimension (unless the dimension is in `replicate_indivisible`).
        """
        if len(axes) != len(shape):
            raise ValueError(f"tensor {name}: logical axes {axes} do not match shape {shape}")
        used: set[str] = set()
        out: list[tuple[str, ...]] = [()] * len(shape)
        rules = [self.rules.get(logical) if logical is not None else None for logical in axes]
        order = sorted(range(len(shape)), key=lambda i: not isinstance(rules[i], tuple))
        left: dict[int, tuple[str, ...]] = {}
        for i in order:
            logical, dim, rule = axes[i], shape[i], rules[i]
            mesh_axes = (rule,) if isinstance(rule, str) else tuple(rule or ())
            # A mesh axis of size 1 or already used by an earlier dimension is dropped.
            mesh_axes = tuple(
                a for a in mesh_axes if a not in used and self.mesh.shape.get(a, 1) > 1
            )
            if isinstance(rule, tuple):
                fit = mesh_axes
                while fit and dim % _size(self.mesh, fit):
                    fit = fit[:-1]
                if fit != mesh_axes:
                    left[i] = mesh_axes[len(fit):]
                mesh_axes = fit
            size = _size(self.mesh, mesh_axes)
            if dim % size:
                if logical in self.replicate_indivisible:
                    _warn_replicate(name, logical, dim, mesh_axes, size)
                    mesh_axes = ()
                else:
                    raise ValueError(
                        f"tensor {name}: mesh axes {mesh_axes} (size {size}) do not divide "
                        f"dimension '{logical}'={dim} of shape {tuple(shape)}; pick a mesh whose "
                        f"{'x'.join(mesh_axes)} size divides {dim}"
                    )
            used.update(mesh_axes)
            out[i] = mesh_axes
        for i, rest in left.items():
            idle = tuple(a for a in rest if a not in used)
            if idle:  # no other dimension of this tensor took them: it is replicated over them
                _warn_replicate(name, axes[i], shape[i], rest, _size(self.mesh, rest))
        spec = [e[0] if len(e) == 1 else (e or None) for e in out]
        while spec and spec[-1] is None:
            spec.pop()
        return P(*spec)

    def sharding(self, axes, shape, name="?") -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(axes, shape, name))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def state_shardings(self, state: nnx.State) -> nnx.State:
        """A tree prefix of `state` with one NamedSharding per variable.

        Variables without `logical_axes` metadata are replicated.
        """

        def one(path, var):
            axes = var.get_metadata().get("logical_axes")
            shape = var.get_value().shape
            if axes is None:
                return self.replicated()
            return self.sharding(axes, shape, name=_path_name(path))

        return jax.tree.map_with_path(one, state, is_leaf=is_variable)


# The layout that `constrain` applies while a program is traced (None: no constraints).
_ACTIVE: contextvars.ContextVar[Layout | None] = contextvars.ContextVar(
    "hfjax_activation_layout", default=None
)


@contextlib.contextmanager
def activation_layout(layout: Layout | None):
    """Within this context, `constrain` pins activations to `layout` while jax traces."""
    token = _ACTIVE.set(layout)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_layout() -> Layout | None:
    """The layout `activation_layout` made active (None outside one)."""
    return _ACTIVE.get()


def under_layout(layout: Layout | None, fn: Callable) -> Callable:
    """fn, run with `activation_layout(layout)` active: jit the result, and the model's
    `constrain` calls apply `layout` while it traces."""

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with activation_layout(layout):
            return fn(*args, **kwargs)

    if isinstance(fn, functools.partial):  # keep the program's name (jit__prefill, ...)
        traced.__name__ = traced.__qualname__ = fn.func.__name__
    return traced


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """x with a sharding constraint from its logical axes under the active layout; x itself
    when no layout is active (single device, or code traced outside a worker group's programs).

    Besides the parameter axes, activations may name "batch" (the data-parallel mesh axes) and
    "length" (a row's tokens: the `sequence` axis).
    """
    layout = _ACTIVE.get()
    if layout is None:
        return x
    rules = {**layout.rules, "batch": mesh_lib.dp_axes(layout.mesh), "length": "sequence"}
    return jax.lax.with_sharding_constraint(
        x, dataclasses.replace(layout, rules=rules).sharding(axes, x.shape, "activation")
    )


# The mesh axes a parameter is sharded over only to be stored (FSDP; `sequence` joins `fsdp`
# on a mesh that splits rows): a weight in use is whole along them, split over `tensor` only.
STORAGE_AXES = ("data", "fsdp", "sequence")


def gathered(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """Weight x (logical axes `axes`) as it is used under the active layout: split by its rules'
    tensor-parallel axes only and whole along `STORAGE_AXES`, as FSDP gathers a weight before
    use; x itself when no layout is active.

    Without it XLA may keep a weight split over fsdp x sequence and move the activations
    instead: an embedding lookup in a vocab-split table then looks every token of the
    micro-batch up on each device and all-reduces the whole rows' embeddings.
    """
    layout = _ACTIVE.get()
    if layout is None:
        return x
    rules = {k: _without(r, STORAGE_AXES) for k, r in layout.rules.items()}
    return jax.lax.with_sharding_constraint(
        x, dataclasses.replace(layout, rules=rules).sharding(axes, x.shape, "weight")
    )


def _without(rule: Rule, drop: Sequence[str]) -> Rule:
    """`rule` without the mesh axes in `drop` (None when none is left)."""
    axes = (rule,) if isinstance(rule, str) else tuple(rule or ())
    kept = tuple(a for a in axes if a not in drop)
    return kept if len(kept) > 1 else (kept[0] if kept else None)


def _size(mesh: Mesh, mesh_axes: Sequence[str]) -> int:
    return int(np.prod([mesh.shape[a] for a in mesh_axes])) if mesh_axes else 1


_warned: set[tuple] = set()


def _warn_replicate(name, logical, dim, mesh_axes, size):
    from absl import logging

    key = (logical, dim, mesh_axes)
    if key not in _warned:
        _warned.add(key)
        logging.warning(
            "dimension '%s'=%d is not divisible by mesh axes %s (size %d): replicating it "
            "(first seen on %s)",
            logical,
            dim,
            mesh_axes,
            size,
            name,
        )


def _path_name(path) -> str:
    parts = []
    for k in path:
        parts.append(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))))
    return ".".join(parts)


def layout(mesh: Mesh, rules: str | Mapping[str, Rule] = "train", **kw) -> Layout:
    """A Layout from a mesh and a rule-set name ("train", "decode", "nested_train") or dict."""
    if isinstance(rules, str):
        if rules not in RULE_SETS:
            raise ValueError(f"unknown layout rules {rules!r}; choose one of {sorted(RULE_SETS)}")
        rules = RULE_SETS[rules]
    if mesh.shape.get("sequence", 1) > 1:
        # Sequence parallelism splits rows, not parameters: without this the parameters and
        # optimizer state would be replicated over `sequence`. FSDP spans it too.
        rules = {k: _with_sequence(r) for k, r in rules.items()}
    return Layout(mesh, dict(rules), **kw)


def _with_sequence(rule: Rule) -> Rule:
    """`rule` with `sequence` after each `fsdp` it names."""
    axes = (rule,) if isinstance(rule, str) else tuple(rule or ())
    if "fsdp" not in axes or "sequence" in axes:
        return rule
    i = axes.index("fsdp")
    return axes[:i + 1] + ("sequence",) + axes[i + 1:]
