"""How a training layout's shards nest in a decode layout, from partition specs and axis sizes
alone: the plan the 3D-HybridEngine (`hfjax.engine.hybrid`) builds its transition mesh from,
and that the planner's virtual layouts (`hfjax.planner.virtual`) price without devices.

`plan_nesting` finds A, the widest tuple of mesh axes over which training splits a dimension
that decoding splits, and gives each parameter its training spec on the transition mesh (axes
rep, gather, micro, tensor_g), or None where its boxes do not fit that order (it then moves by
a plain transfer). `spec_entries` / `to_spec` convert between a `PartitionSpec` and its
per-dimension tuples of mesh axes; `mixed_radix` is a device's index along a tuple of axes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from jax.sharding import PartitionSpec as P

# Transition-mesh axes, slowest to fastest: replicas, axes gathered whole, the low part of the
# split index (the micro-DP position), the decode tensor group.
REP, GATHER, MICRO, TENSOR_G = "rep", "gather", "micro", "tensor_g"
TRANSITION_AXES = (REP, GATHER, MICRO, TENSOR_G)


def _entry(e: Any) -> tuple[str, ...]:
    return () if e is None else (e,) if isinstance(e, str) else tuple(e)


def spec_entries(spec: P, ndim: int) -> list[tuple[str, ...]]:
    """Per dimension of an `ndim`-dimensional array, the mesh axes `spec` splits it over."""
    entries = [_entry(e) for e in spec]
    return entries + [()] * (ndim - len(entries))


def to_spec(entries: Sequence[tuple[str, ...]]) -> P:
    """The `PartitionSpec` of per-dimension mesh axes (`spec_entries`' inverse)."""
    out = [None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries]
    while out and out[-1] is None:
        out.pop()
    return P(*out)


@dataclasses.dataclass(frozen=True)
class NestPlan:
    """How a training layout's shards nest in a decode layout, from specs and axis sizes alone.

    `A`: the widest axis tuple over which training splits a dimension that decoding splits; the
    decode tensor group of a device is its split index over A divided by `lo` = n_a / t_g. `B`:
    an axis tuple disjoint from A that splits dimensions decoding keeps whole (fsdp over embed
    under TRAIN_RULES); it joins the micro-DP groups. `ok`: t_g divides n_a (else nothing
    nests). `leaves[i]`: (leaf i's training spec on the transition mesh, or None when its boxes
    do not fit the order and it moves by a plain transfer; its decode spec, which keeps whole a
    dimension that training does not split over the decode tensor axis).
    """

    A: tuple[str, ...]
    B: tuple[str, ...]
    n_a: int
    lo: int
    t_g: int
    ok: bool
    leaves: tuple[tuple[list[tuple[str, ...]] | None, list[tuple[str, ...]]], ...]


def plan_nesting(
    axes_list: Sequence[Sequence[str | None] | None],
    train_specs: Sequence[Sequence[tuple[str, ...]]],
    decode_specs: Sequence[Sequence[tuple[str, ...]]],
    sizes: Mapping[str, int],
    t_g: int,
    split_logical: set[str],
) -> NestPlan:
    """Returns the NestPlan of leaves with logical `axes_list` split by `train_specs` (per
    dimension, the mesh axes) on a mesh of `sizes`, decoding in `decode_specs` over decode
    tensor size `t_g`; `split_logical` names the logical axes the decode rules split. The
    engine and the planner's virtual layouts both use it, so they agree on what moves."""
    a_set: dict[tuple[str, ...], int] = {}
    b_set: dict[tuple[str, ...], int] = {}
    for axes, entries in zip(axes_list, train_specs):
        for dim, entry in enumerate(entries):
            if entry:
                logical = axes[dim] if axes is not None else None
                target = a_set if logical in split_logical else b_set
                target.setdefault(entry, math.prod(sizes[a] for a in entry))
    A = max(a_set, key=a_set.get, default=())
    B = next((b for b in b_set if not set(b) & set(A)), ())
    n_a = math.prod(sizes[a] for a in A)
    if n_a % t_g:
        return NestPlan(A, B, n_a, 0, t_g, False, ())
    lo = n_a // t_g
    split_a = tuple(a for a, n in ((TENSOR_G, t_g), (MICRO, lo)) if n > 1)
    # A leaf may split a tensor-parallel dimension over the leading axes of A that make up
    # exactly the decode tensor size (28 heads over tensor=2 of A = tensor x fsdp), and another
    # dimension over the trailing axes that make up the micro-DP size (embed over fsdp): the
    # same boxes as one split over A, on two dimensions.
    head_a = next((A[:k] for k in range(1, len(A) + 1)
                   if math.prod(sizes[a] for a in A[:k]) == t_g), None)
    tail_a = A[len(head_a):] if head_a is not None and lo > 1 else None
    leaves = []
    for axes, tr, dc in zip(axes_list, train_specs, decode_specs):
        axes = axes or (None,) * len(tr)
        dc = list(dc)
        tr_t: list[tuple[str, ...]] | None = []
        whole = []
        for dim, e in enumerate(tr):
            split = axes[dim] in split_logical
            if split and e not in ((), A, head_a):
                tr_t = None  # split over other axes than A (e.g. tensor only, A=tensor x fsdp)
                break
            if not e:
                tr_t.append(())
            elif e == A:
                tr_t.append(split_a)
            elif split and e == head_a:
                tr_t.append((TENSOR_G,))
            elif e == B:
                tr_t.append((GATHER,))
            elif e == tail_a:
                tr_t.append((MICRO,))
            else:
                tr_t = None
                break
            if dc[dim] and e not in (A, head_a):
                whole.append(dim)
        if tr_t is not None:
            for dim in whole:
                # Training keeps this dimension whole (e.g. 3 KV heads on 8 devices), or splits
                # another one over A: decoding keeps it whole too, or the way back would gather.
                dc[dim] = ()
        leaves.append((tr_t, dc))
    return NestPlan(A, B, n_a, lo, t_g, True, tuple(leaves))


def mixed_radix(digits: Sequence[int], sizes: Sequence[int]) -> int:
    """The index whose digits along axes of `sizes` (slowest first) are `digits`."""
    out = 0
    for d, n in zip(digits, sizes):
        out = out * n + int(d)
    return out
