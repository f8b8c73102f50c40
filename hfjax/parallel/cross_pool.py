"""Moving arrays between pools that sit on different processes (docs/async.md, "Across
processes").

Under `jax.distributed` every process runs the same program, and a program on devices that a
process does not hold is a no-op there. Two things then need a program that spans both pools:

- `send`: an array on one set of devices onto a sharding over a disjoint set on other
  processes. XLA:CPU (and jax without its DCN transfer flags) has no cross-host
  `jax.device_put`; a collective has no such limit. The array is first resharded on its own
  devices so that the i-th source device holds exactly the shard the i-th destination device
  needs (the destination's mesh shape and spec over the source devices), then one collective
  permute over the union of the two device sets moves shard i to destination device i: each
  byte crosses once. Pools of different sizes take a gather on the source pool first
  (`_send_uneven`).
- `gather`: a host copy of an array on every process, also on processes that hold none of its
  devices (`multihost_utils.process_allgather` needs a shard on every process). An array whose
  devices all sit on one process is fetched there and handed to the others through the
  distributed runtime's key-value store, so that no other process's devices take part: a
  device collective would wait for whatever those devices run (the rollout's generation, on
  CPU run to its end before anything else), and the two pools would run in turn. Otherwise
  each device's shard is gathered over all devices, and every process assembles the array
  from its copy.

Both are collectives: every process must call them in the same order, which the asynchronous
loop's single-threaded schedule across processes guarantees (`hfjax.run.async_loop`).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, Sharding
from jax.sharding import PartitionSpec as P

from hfjax.parallel.reshard import ordered_devices, reshard_in_place

_AXIS = "__hfjax_pools"


def needs_collective(x: jax.Array, dst: Sharding) -> bool:
    """Whether moving `x` to `dst` crosses processes between disjoint device sets (the case
    `jax.device_put` cannot do). Decided alike on every process, as the collective needs: it
    reads device sets, not which shards are local. An uncommitted array, or one without a mesh,
    is a value each process holds for itself (e.g. a model initialised on the default device),
    which `jax.device_put` places like host data."""
    src = x.sharding
    if not x.committed or not isinstance(src, NamedSharding):
        return False
    a, b = set(src.device_set), set(dst.device_set)
    return not a & b and len({d.process_index for d in a | b}) > 1


def needs_gather(x: jax.Array) -> bool:
    """Whether a host copy of `x` needs `gather`: a pool's array (committed, on a mesh) that
    some process holds no shard of. Decided alike on every process (it reads the device set,
    not which shards are local), as the collective needs."""
    if jax.process_count() == 1 or not x.committed or not isinstance(x.sharding, NamedSharding):
        return False
    return {d.process_index for d in x.sharding.device_set} != set(range(jax.process_count()))


def _rows(x: jax.Array, devices: Sequence, shape, dtype) -> list[jax.Array]:
    """This process's shards of a [len(devices), *shape] array over `devices`: row i is `x`'s
    shard on devices[i] where `x` has one, zeros elsewhere."""
    have = {s.device: s.data for s in x.addressable_shards}
    me = jax.process_index()
    out = []
    for d in devices:
        if d.process_index != me:
            continue
        data = have.get(d)
        out.append(data[None] if data is not None else
                   jax.device_put(np.zeros((1, *shape), dtype), d))
    return out


@functools.cache
def _permute(perm: tuple[tuple[int, int], ...], mesh: Mesh):
    body = functools.partial(jax.lax.ppermute, axis_name=_AXIS, perm=list(perm))
    return jax.jit(jax.shard_map(lambda xs: [body(x) for x in xs], mesh=mesh,
                                 in_specs=P(_AXIS), out_specs=P(_AXIS)))


def send(xs: Sequence[jax.Array], dsts: Sequence[NamedSharding]) -> list[jax.Array]:
    """`xs[i]` placed on `dsts[i]` (over devices on other processes than the source's), by one
    collective permute for all of them where source and destination have as many devices
    (`_send_uneven` for one array otherwise)."""
    if not xs:
        return []
    staged, meshes = [], []
    for x, dst in zip(xs, dsts, strict=True):
        src = ordered_devices(x.sharding)
        if src is None or not isinstance(dst, NamedSharding):
            raise ValueError(f"cannot move an array on {x.sharding} to the devices of other "
                             "processes: both sides need a mesh (NamedSharding)")
        if len(src) != dst.mesh.size:
            return [_send_uneven(x, d) for x, d in zip(xs, dsts, strict=True)]
        # The destination's mesh over the source devices: device i holds destination i's shard.
        stage = NamedSharding(Mesh(np.asarray(src, dtype=object).reshape(dst.mesh.devices.shape),
                                   dst.mesh.axis_names), dst.spec)
        staged.append(reshard_in_place(x, stage))
        meshes.append((tuple(src), tuple(dst.mesh.devices.flat)))
    if len(set(meshes)) != 1:  # one permute per pair of device lists
        return [send([x], [d])[0] for x, d in zip(xs, dsts, strict=True)]
    src, dst_devices = meshes[0]
    union = Mesh(np.asarray(src + dst_devices, dtype=object), (_AXIS,))
    rows = []
    for x, dst in zip(staged, dsts, strict=True):
        shape = dst.shard_shape(x.shape)
        rows.append(jax.make_array_from_single_device_arrays(
            (len(union.devices), *shape), NamedSharding(union, P(_AXIS)),
            _rows(x, union.devices.flat, shape, x.dtype), dtype=x.dtype))
    moved = _permute(tuple((i, len(src) + i) for i in range(len(src))), union)(rows)
    out = []
    for x, dst, y in zip(xs, dsts, moved, strict=True):
        mine = {s.device: s.data[0] for s in y.addressable_shards}
        local = [mine[d] for d in dst.mesh.devices.flat if d.process_index == jax.process_index()]
        out.append(jax.make_array_from_single_device_arrays(x.shape, dst, local, dtype=x.dtype))
    return out


def _send_uneven(x: jax.Array, dst: NamedSharding) -> jax.Array:
    """`send` between pools of different sizes (m source devices, n destination devices; a
    pool spanning 2 of 3 processes and one on the third). Every source device gets a whole
    copy of `x` (one all-gather on the source pool), cuts destination device j's shard from it
    on device j mod m, and ceil(n / m) permutes move those shards, m at a time: each byte
    crosses once, after the source pool's gather."""
    src = ordered_devices(x.sharding)
    m, targets = len(src), list(dst.mesh.devices.flat)
    full = reshard_in_place(x, NamedSharding(Mesh(np.asarray(src, dtype=object), (_AXIS,)),
                                             P()))
    copies = {s.device: s.data for s in full.addressable_shards}
    where, shape = dst.devices_indices_map(x.shape), dst.shard_shape(x.shape)
    union = Mesh(np.asarray(src + targets, dtype=object), (_AXIS,))
    me, local = jax.process_index(), {}
    for first in range(0, len(targets), m):
        now = targets[first:first + m]
        rows = [copies[d][where[now[i]]][None] if i < len(now) else
                jax.device_put(np.zeros((1, *shape), x.dtype), d)
                for i, d in enumerate(src) if d.process_index == me]
        rows += [jax.device_put(np.zeros((1, *shape), x.dtype), d)
                 for d in targets if d.process_index == me]
        stacked = jax.make_array_from_single_device_arrays(
            (len(union.devices), *shape), NamedSharding(union, P(_AXIS)), rows, dtype=x.dtype)
        perm = tuple((i, m + first + i) for i in range(len(now)))
        (moved,) = _permute(perm, union)([stacked])
        local |= {s.device: s.data[0] for s in moved.addressable_shards if s.device in now}
    mine = [local[d] for d in targets if d.process_index == me]
    return jax.make_array_from_single_device_arrays(x.shape, dst, mine, dtype=x.dtype)


@functools.cache
def _gather(mesh: Mesh, count: int):
    return jax.jit(lambda xs: xs, out_shardings=[NamedSharding(mesh, P())] * count)


_ROUNDS = itertools.count()  # gather calls, in the same order on every process
_KV_TIMEOUT_MS = 30 * 60 * 1000  # as long as the slowest step may take to reach its fetch


def _owner(xs: Sequence[jax.Array]) -> int | None:
    """The one process that holds every device of every array of `xs`, or None."""
    owners = {d.process_index for x in xs for d in x.sharding.device_set}
    return owners.pop() if len(owners) == 1 else None


def _through_store(xs: Sequence[jax.Array], owner: int) -> list[np.ndarray]:
    """`gather` of arrays that only `owner` holds: it fetches them and writes one copy per
    other process into the key-value store; each reader takes its copy and deletes it."""
    from jax._src import distributed

    client = distributed.global_state.client
    prefix = f"hfjax/cross_pool/{next(_ROUNDS)}"
    me = jax.process_index()
    if me == owner:
        with jax.transfer_guard("allow"):
            out = [np.asarray(x) for x in jax.device_get(list(xs))]  # one fetch for all
        data = _pack(out)
        for p in range(jax.process_count()):
            if p != owner:
                client.key_value_set_bytes(f"{prefix}/{p}", data)
        return out
    key = f"{prefix}/{me}"
    data = client.blocking_key_value_get_bytes(key, _KV_TIMEOUT_MS)
    client.key_value_delete(key)
    return _unpack(data, xs)


def _pack(arrays: Sequence[np.ndarray]) -> bytes:
    return b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)


def _unpack(data: bytes, like: Sequence[jax.Array]) -> list[np.ndarray]:
    """The arrays `_pack` wrote, read by the shapes and dtypes of `like` (the same arrays'
    descriptions, which every process knows: no dtype or shape goes through the store)."""
    out, at = [], 0
    for x in like:
        count = int(np.prod(x.shape, dtype=np.int64))
        out.append(np.frombuffer(data, x.dtype, count, at).reshape(x.shape).copy())
        at += count * np.dtype(x.dtype).itemsize
    return out


def gather(xs: Sequence[jax.Array]) -> list[np.ndarray]:
    """Host copies of the whole of each of `xs` on every process, also those that hold none
    of it: through the key-value store when one process holds them all, else by one
    all-gather over every device."""
    owner = _owner(xs)
    if owner is not None:
        return _through_store(xs, owner)
    devices = jax.devices()
    mesh = Mesh(np.asarray(devices, dtype=object), (_AXIS,))
    stacked = []
    for x in xs:
        shape = x.sharding.shard_shape(x.shape)
        stacked.append(jax.make_array_from_single_device_arrays(
            (len(devices), *shape), NamedSharding(mesh, P(_AXIS)),
            _rows(x, devices, shape, x.dtype), dtype=x.dtype))
    with jax.transfer_guard("allow"):
        every = [np.asarray(y.addressable_data(0)) for y in _gather(mesh, len(xs))(stacked)]
    index = {d: i for i, d in enumerate(devices)}
    out = []
    for x, rows in zip(xs, every, strict=True):
        host = np.empty(x.shape, x.dtype)
        for d, where in x.sharding.devices_indices_map(x.shape).items():
            host[where] = rows[index[d]]
        out.append(host)
    return out
