"""Resharding: byte accounting (what each device must receive, and what it holds) and the
device-to-device transfer programs the hybrid engine builds on.

A sharding maps every device to a *box* of the global array (one half-open interval per
dimension, from `devices_indices_map`). Moving an array from a source sharding to a destination
sharding, a device must receive whatever part of its destination box it does not already hold:

    bytes received = |destination box| - |destination box ∩ local source box|

This is a lower bound for any transfer scheme that never moves data a device already has, and
it is exactly what the hybrid engine's transitions move. The accounting functions look at
shardings and shapes (or at the shards of live arrays), never at values, so they work on abstract
shapes (`jax.ShapeDtypeStruct`) as well as on real arrays. Per-device results are dicts keyed by
device id.

The transfer helpers move one array between shardings whose boxes nest (each source box inside
its destination box) without a host round trip: an explicit `shard_map` all-gather, a jitted
reshard, device-to-device copies of peer shards, and the local slice back. `relabel` gives the
same buffers another sharding with equal boxes (no copy), and `offload`/`reload` park arrays in
host memory on purpose. `reshard_in_place` and `ordered_devices` are the same-device reshard and
the mesh-order device list that both `transfer` and `cross_pool` build on.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

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
    arrays = [x for x in arrays if isinstance(x, jax.Array) and not x.is_deleted()]
    # Wait for pending results here, where the wait releases the GIL: reading the buffer pointer
    # of an array still being computed waits holding it, and if a lost peer leaves a collective
    # unfinished that wait never ends and starves this process's other threads (LossWatch,
    # which would report the lost process).
    jax.block_until_ready(arrays)
    seen: set[tuple[int, int]] = set()
    out: dict[int, int] = {}
    for x in arrays:
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


# -- transfers ----------------------------------------------------------------------------------

Gathered = Sequence[tuple[int, tuple[str, ...]]]


def relabel(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """Returns `x`'s device buffers as an array with `sharding`, which must give every device
    the box it already holds (for example the same layout on a mesh with other axis names or
    device order). Nothing is copied; the result shares `x`'s buffers."""
    by_device = {s.device: s.data for s in x.addressable_shards}
    order = sharding.addressable_devices_indices_map(x.shape)
    return jax.make_array_from_single_device_arrays(
        x.shape, sharding, [by_device[d] for d in order]
    )


def shares_buffers(x: jax.Array, y: jax.Array) -> bool:
    """Returns True when `y` holds any of `x`'s device buffers (freeing `x` would break `y`)."""
    mine = {(s.device.id, s.data.unsafe_buffer_pointer()) for s in x.addressable_shards}
    return any((s.device.id, s.data.unsafe_buffer_pointer()) in mine for s in y.addressable_shards)


def reshard_program(out_sharding: Sharding) -> Callable[[jax.Array], jax.Array]:
    """Returns a jitted identity with a fixed output sharding: XLA inserts the collectives."""
    return jax.jit(lambda x: x, out_shardings=out_sharding)


def _identity(x: jax.Array) -> jax.Array:
    return x


@functools.lru_cache(maxsize=512)
def _reshard_fn(sharding: Sharding) -> Callable[[jax.Array], jax.Array]:
    return jax.jit(_identity, out_shardings=sharding)


def reshard_in_place(x: jax.Array, sharding: Sharding) -> jax.Array:
    """`x` on `sharding`, over the same devices (one XLA program)."""
    # An identity program with a fixed output sharding: XLA inserts the collectives, on device.
    return _reshard_fn(sharding)(x)


def ordered_devices(sharding: Sharding) -> list[Any] | None:
    """The devices of `sharding` in mesh order, or None for shardings without one."""
    if isinstance(sharding, NamedSharding):
        return list(sharding.mesh.devices.flat)
    if isinstance(sharding, SingleDeviceSharding):
        return list(sharding.device_set)
    return None


def gather_program(
    mesh: Mesh, in_spec: PartitionSpec, out_spec: PartitionSpec, gathered: Gathered,
    out_sharding: Sharding,
) -> Callable[[jax.Array], jax.Array]:
    """Returns a jitted `shard_map` that all-gathers dimension `dim` over mesh axes `axes` for
    each (dim, axes) in `gathered`, from `in_spec` to `out_spec` on `mesh`."""

    def gather(x):
        for dim, axes in gathered:
            x = jax.lax.all_gather(x, axes if len(axes) > 1 else axes[0], axis=dim, tiled=True)
        return x

    # check_vma off: a tiled all-gather's result is the same on every member of the group, as
    # out_spec states, but the checker cannot infer that.
    body = jax.shard_map(gather, mesh=mesh, in_specs=in_spec, out_specs=out_spec,
                         check_vma=False)
    return jax.jit(body, out_shardings=out_sharding)


def slice_program(
    mesh: Mesh, in_spec: PartitionSpec, out_spec: PartitionSpec, gathered: Gathered,
    out_sharding: Sharding,
) -> Callable[[jax.Array], jax.Array]:
    """Returns the inverse of `gather_program`: each device keeps its own piece of every
    gathered dimension (indexed by its position along the axes). No communication."""

    def local_slice(x):
        for dim, axes in gathered:
            ways = math.prod(mesh.shape[a] for a in axes)
            index = 0
            for a in axes:
                index = index * mesh.shape[a] + jax.lax.axis_index(a)
            size = x.shape[dim] // ways
            x = jax.lax.dynamic_slice_in_dim(x, index * size, size, axis=dim)
        return x

    body = jax.shard_map(local_slice, mesh=mesh, in_specs=in_spec, out_specs=out_spec,
                         check_vma=False)
    return jax.jit(body, out_shardings=out_sharding)


@functools.lru_cache(maxsize=256)
def _concat(axis: int) -> Callable:
    return jax.jit(lambda *xs: jnp.concatenate(xs, axis=axis))


def gather_by_copies(
    x: jax.Array, dst: NamedSharding, dims: Sequence[int]
) -> tuple[jax.Array, dict[int, int]]:
    """All-gathers `x` onto `dst` by device-to-device copies of peer shards and a local concat
    along `dims` (outer first); every source box must lie inside its destination box.

    Returns (the array on `dst`, {device id: bytes of peer pieces staged on it}).
    """
    have = boxes(x.sharding, x.shape)
    want = boxes(dst, x.shape)
    shards = {s.device.id: s.data for s in x.addressable_shards}
    holders: dict[Box, int] = {}
    for dev, box in have.items():
        holders.setdefault(box, dev)
    staged: dict[int, int] = {}
    outs = []
    for dev in dst.addressable_devices_indices_map(x.shape):
        pieces = {}
        for box in sorted(b for b in holders if contains(want[dev.id], b)):
            src = dev.id if have[dev.id] == box else holders[box]
            piece = shards[src]
            if src != dev.id:
                piece = jax.device_put(piece, dev)
                staged[dev.id] = staged.get(dev.id, 0) + piece.nbytes
            pieces[box] = piece
        outs.append(_assemble(pieces, list(dims)))
    return jax.make_array_from_single_device_arrays(x.shape, dst, outs), staged


def _assemble(pieces: Mapping[Box, jax.Array], dims: Sequence[int]) -> jax.Array:
    """Concatenates boxes that tile a larger box along `dims` (outer dims first)."""
    if not dims:
        (only,) = pieces.values()
        return only
    dim, rest = dims[0], dims[1:]
    groups: dict[int, dict[Box, jax.Array]] = {}
    for box, piece in pieces.items():
        groups.setdefault(box[dim][0], {})[box] = piece
    parts = [_assemble(groups[start], rest) for start in sorted(groups)]
    return parts[0] if len(parts) == 1 else _concat(dim)(*parts)


def offload(tree: Any) -> Any:
    """Returns `tree` with every array moved to host memory (memory kind "pinned_host"), same
    sharding; the device copies are freed. Meant for optimizer state during generation on an
    accelerator, where it frees device memory for the KV cache."""

    def one(x):
        if not isinstance(x, jax.Array):
            return x
        y = jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))
        if not shares_buffers(x, y):
            x.delete()
        return y

    return jax.tree.map(one, tree)


def reload(tree: Any, shardings: Any) -> Any:
    """Returns an `offload`ed tree back in device memory with `shardings` (a matching tree);
    the host copies are freed."""

    def one(x, sharding):
        if not isinstance(x, jax.Array):
            return x
        y = jax.device_put(x, sharding)
        if not shares_buffers(x, y):
            x.delete()
        return y

    return jax.tree.map(one, tree, shardings)
