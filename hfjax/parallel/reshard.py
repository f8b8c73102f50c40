"""Byte accounting for resharding: what each device must receive, and what it holds.

A sharding maps every device to a *box* of the global array (one half-open interval per
dimension, from `devices_indices_map`). Moving an array from a source sharding to a destination
sharding, a device must receive whatever part of its destination box it does not already hold:

    bytes received = |destination box| - |destination box ∩ local source box|

This is a lower bound for any transfer scheme that never moves data a device already has, and
it is exactly what the hybrid engine's transitions move. All functions here are pure: they look at
shardings and shapes (or at the shards of live arrays), never at values, so they work on abstract
shapes (`jax.ShapeDtypeStruct`) as well as on real arrays.

Per-device results are dicts keyed by device id.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding

Box = tuple[tuple[int, int], ...]


def _itemsize(dtype: Any) -> int:
    return int(np.dtype(dtype).itemsize)


def _bounds(index: tuple[Any, ...], shape: Sequence[int]) -> Box:
    out = []
    for idx, dim in zip(index, shape):
        start, stop, step = idx.indices(dim) if isinstance(idx, slice) else (idx, idx + 1, 1)
        if step != 1:
            raise ValueError(f"strided shard index {idx} is not a box; shardings give slices")
        out.append((start, stop))
    # Trailing dimensions missing from the index are whole.
    out.extend((0, d) for d in shape[len(out) :])
    return tuple(out)


def boxes(sharding: Sharding, shape: Sequence[int]) -> dict[int, Box]:
    """Returns {device id: box} for every device of `sharding` holding an array of `shape`."""
    shape = tuple(int(d) for d in shape)
    return {d.id: _bounds(idx, shape) for d, idx in sharding.devices_indices_map(shape).items()}


def box_size(box: Box) -> int:
    """Returns the number of elements in `box`."""
    return math.prod(max(0, hi - lo) for lo, hi in box)


def intersect(a: Box, b: Box) -> Box:
    """Returns the box common to `a` and `b` (empty intervals where they do not overlap)."""
    return tuple((max(lo1, lo2), max(max(lo1, lo2), min(hi1, hi2))) for (lo1, hi1), (lo2, hi2)
                 in zip(a, b))


def contains(outer: Box, inner: Box) -> bool:
    """Returns True when `inner` lies inside `outer`."""
    return all(lo1 <= lo2 and hi2 <= hi1 for (lo1, hi1), (lo2, hi2) in zip(outer, inner))


def shard_bytes(sharding: Sharding, shape: Sequence[int], dtype: Any) -> dict[int, int]:
    """Returns {device id: bytes of that device's shard} for an array of `shape` and `dtype`."""
    size = _itemsize(dtype)
    return {dev: box_size(box) * size for dev, box in boxes(sharding, shape).items()}


def transfer_bytes(
    src: Sharding, dst: Sharding, shape: Sequence[int], dtype: Any
) -> dict[int, int]:
    """Returns {device id: bytes it receives} to move an array from `src` to `dst`.

    A device receives its destination box minus the part of it that its own source shard
    already covers; a device absent from `src` holds nothing locally.
    """
    size = _itemsize(dtype)
    have = boxes(src, shape)
    out = {}
    for dev, want in boxes(dst, shape).items():
        local = box_size(intersect(want, have[dev])) if dev in have else 0
        out[dev] = (box_size(want) - local) * size
    return out


def lower_bound_bytes(
    src: Sharding, dst: Sharding, shape: Sequence[int], dtype: Any
) -> dict[int, int]:
    """Returns {device id: |destination shard| - |local source shard|, floored at 0}.

    No scheme can deliver a device's destination shard with fewer bytes than it lacks in
    volume; `transfer_bytes` reaches this bound exactly when every source box lies inside
    (or contains) its destination box.
    """
    dst_b, src_b = shard_bytes(dst, shape, dtype), shard_bytes(src, shape, dtype)
    return {dev: max(0, b - src_b.get(dev, 0)) for dev, b in dst_b.items()}


def nests(src: Sharding, dst: Sharding, shape: Sequence[int]) -> bool:
    """Returns True when every device's `src` box lies inside its `dst` box.

    Then the move to `dst` only adds data, and the way back is a local slice (0 bytes).
    """
    have = boxes(src, shape)
    want = boxes(dst, shape)
    return set(have) == set(want) and all(contains(want[d], have[d]) for d in want)


def add(totals: dict[int, int], more: dict[int, int]) -> dict[int, int]:
    """Returns the per-device sum of two {device id: bytes} dicts."""
    out = dict(totals)
    for dev, b in more.items():
        out[dev] = out.get(dev, 0) + b
    return out


def _avals(leaves: Iterable[Any]) -> list[tuple[tuple[int, ...], Any]]:
    return [(tuple(x.shape), x.dtype) for x in leaves]


def tree_transfer_bytes(
    src: Sequence[Sharding], dst: Sequence[Sharding], leaves: Sequence[Any]
) -> dict[int, int]:
    """Returns {device id: total bytes received} over aligned sequences of shardings and leaves.

    `leaves` are arrays or `jax.ShapeDtypeStruct`s (for example `jax.tree.leaves` of a params
    tree); `src[i]` and `dst[i]` are the shardings of leaf i.
    """
    total: dict[int, int] = {}
    for s, d, (shape, dtype) in zip(src, dst, _avals(leaves), strict=True):
        total = add(total, transfer_bytes(s, d, shape, dtype))
    return total


def tree_lower_bound_bytes(
    src: Sequence[Sharding], dst: Sequence[Sharding], leaves: Sequence[Any]
) -> dict[int, int]:
    """Returns {device id: summed `lower_bound_bytes`} over aligned shardings and leaves."""
    total: dict[int, int] = {}
    for s, d, (shape, dtype) in zip(src, dst, _avals(leaves), strict=True):
        total = add(total, lower_bound_bytes(s, d, shape, dtype))
    return total


def tree_shard_bytes(shardings: Sequence[Sharding], leaves: Sequence[Any]) -> dict[int, int]:
    """Returns {device id: bytes held} when leaf i is placed with `shardings[i]`."""
    total: dict[int, int] = {}
    for s, (shape, dtype) in zip(shardings, _avals(leaves), strict=True):
        total = add(total, shard_bytes(s, shape, dtype))
    return total


def array_bytes(arrays: Iterable[jax.Array]) -> dict[int, int]:
    """Returns {device id: bytes} of the live device buffers behind `arrays`.

    Counts what is actually allocated (deleted arrays count 0), and counts a buffer shared by
    several arrays (zero-copy views) once.
    """
    seen: set[tuple[int, int]] = set()
    out: dict[int, int] = {}
    for x in arrays:
        if not isinstance(x, jax.Array) or x.is_deleted():
            continue
        for shard in x.addressable_shards:
            data = shard.data
            key = (shard.device.id, data.unsafe_buffer_pointer())
            if key in seen:
                continue
            seen.add(key)
            out[shard.device.id] = out.get(shard.device.id, 0) + data.nbytes
    return out


def live_bytes() -> dict[int, int]:
    """Returns {device id: bytes} held by every live jax.Array in the process.

    On CPU `memory_stats()` is None, so this (sampled around an operation) is how peak device
    memory is measured there.
    """
    return array_bytes(jax.live_arrays())


def max_bytes(per_device: dict[int, int]) -> int:
    """Returns the largest per-device figure of a {device id: bytes} dict (0 when empty)."""
    return max(per_device.values(), default=0)
