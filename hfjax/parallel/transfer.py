"""Moving arrays between shardings: the edges of the dataflow.

`transfer` places an array onto another sharding, possibly on other devices, without a host
round trip (plain `jax.device_put` does not guarantee that; see `transfer`). `to_host` is the
deliberate fetch of an array to the host, also when it spans several processes.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, Sharding
from jax.sharding import PartitionSpec as P

from hfjax.parallel import cross_pool
from hfjax.parallel.reshard import ordered_devices, reshard_in_place

Array = jax.Array | np.ndarray

_REPLICA_AXIS = "__hfjax_replica"


def transfer(x: Array, sharding: Sharding) -> Array:
    """Returns `x` placed on `sharding`, moving device data device-to-device only.

    Why not just `jax.device_put`: for a device array, jax (0.10) copies shards directly only when
    each destination shard already exists whole on some source device; otherwise it fetches the
    whole array to the host and uploads it again. So this function first reshapes the data *on the
    source devices* (one XLA program) into shards that exactly match the destination's, then lets
    `jax.device_put` copy those shards across. A host array (numpy) is uploaded explicitly.
    """
    if not isinstance(x, jax.Array):
        return jax.device_put(x, sharding)
    src = x.sharding
    if src == sharding:
        return x
    if cross_pool.needs_collective(x, sharding):  # disjoint pools on different processes
        return cross_pool.send([x], [sharding])[0]
    src_devices = ordered_devices(src)
    dst_devices = ordered_devices(sharding)
    # Multi-process arrays, or shardings we can't order, are left to jax's own transfer rules.
    if (
        src_devices is None
        or dst_devices is None
        or not x.is_fully_addressable
        or not sharding.is_fully_addressable
    ):
        out = jax.device_put(x, sharding)
        if x.is_fully_addressable and len(sharding.addressable_devices) == 1 < len(
                sharding.device_set):
            # jax 0.10's device_put of a process-local array onto a sharding with one device
            # on each process (replicated) builds an array whose own shard claims the whole
            # sharding: `addressable_shards` raises, and Orbax cannot save it. A copy by a
            # program over the sharding is well formed.
            out = jnp.copy(out)
        return out
    if src_devices == dst_devices:
        return reshard_in_place(x, sharding)
    if set(src_devices) == set(dst_devices) or len(src_devices) == 1:
        # Same devices in another order: jax reorders shards on device. One source device:
        # jax slices there and copies the slices out.
        return jax.device_put(x, sharding)
    staged = _stage_for(x, src_devices, sharding)
    return jax.device_put(staged, sharding)


def _stage_for(x: jax.Array, src_devices: list[Any], dst: Sharding) -> jax.Array:
    """Returns `x` resharded on its own devices so each destination shard exists whole."""
    used = _spec_axes(dst)
    m = len(src_devices)
    if used is not None:
        assert isinstance(dst, NamedSharding)
        sizes = [dst.mesh.shape[a] for a in used]
        k = math.prod(sizes)
        if m % k == 0:
            # Same axis names and sizes as the destination, so the same spec yields the same
            # shard boxes; the extra axis replicates the boxes over the spare source devices.
            mesh = Mesh(
                np.asarray(src_devices, dtype=object).reshape(*sizes, m // k),
                (*used, _REPLICA_AXIS),
                axis_types=(AxisType.Auto,) * (len(used) + 1),
            )
            return reshard_in_place(x, NamedSharding(mesh, dst.spec))
    # The destination's shard count doesn't divide the source devices: gather a full copy on the
    # source side and send slices of one device's copy. Costs more bandwidth, but no host hop.
    mesh = Mesh(
        np.asarray(src_devices, dtype=object), (_REPLICA_AXIS,), axis_types=(AxisType.Auto,)
    )
    full = reshard_in_place(x, NamedSharding(mesh, P()))
    return full.addressable_shards[0].data


def _spec_axes(sharding: Sharding) -> list[str] | None:
    if isinstance(sharding, NamedSharding):
        used: list[str] = []
        for entry in sharding.spec:
            if entry is None:
                continue
            if isinstance(entry, str):
                used.append(entry)
            elif isinstance(entry, tuple) and all(isinstance(a, str) for a in entry):
                used.extend(entry)
            else:
                return None
        return used
    if sharding.is_fully_replicated:
        return []
    return None


def mesh_scalar(value, like: jax.Array, dtype=np.float32) -> jax.Array:
    """A host scalar uploaded replicated onto the devices of `like` (a deliberate upload).

    Across processes a scalar must not be left on this process's default device (`jnp.float32`,
    uncommitted) when it joins a program on another pool's devices: on a process that holds
    none of them, jaxlib's cached dispatch (the second call of the program on) copies the
    uncommitted argument onto the executable's devices, none of which is addressable there,
    and the process dies with SIGSEGV. Committed to the program's mesh, every process places
    its own shards (none, where it holds no device)."""
    sharding = like.sharding
    if isinstance(sharding, NamedSharding):
        sharding = NamedSharding(sharding.mesh, P())
    with jax.transfer_guard("allow"):
        return jax.device_put(np.asarray(value, dtype), sharding)


def to_host(x: Array) -> np.ndarray:
    """A host (numpy) copy of the whole of `x`: the caller's deliberate fetch.

    An array that spans several processes is gathered so that every process gets all of it
    (each process then holds the same host value, as a multi-controller program needs).
    """
    if not isinstance(x, jax.Array):
        return np.asarray(x)
    with jax.transfer_guard("allow"):
        if cross_pool.needs_gather(x):  # e.g. the trainer's pool, seen from the rollout's
            return cross_pool.gather([x])[0]
        if x.is_fully_addressable:
            return np.asarray(x)
        if x.is_fully_replicated:  # every process holds all of it
            return np.asarray(x.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def host_values(values: dict[str, Any]) -> dict[str, Any]:
    """`jax.device_get(values)`, also where some arrays sit on devices of other processes
    only (a pool of its own on each process). Those are fetched in one `cross_pool.gather` per
    owner: the arrays one process holds all of go through the key-value store from it (a
    step's metrics mix arrays of both pools: one exchange per pool, no device collective);
    the rest, spread over several processes, by one all-gather."""
    with jax.transfer_guard("allow"):
        far = [k for k, v in values.items()
               if isinstance(v, jax.Array) and cross_pool.needs_gather(v)]
        out = jax.device_get({k: v for k, v in values.items() if k not in far})
    groups: dict[int, list[str]] = {}
    for k in far:
        owners = {d.process_index for d in values[k].sharding.device_set}
        groups.setdefault(owners.pop() if len(owners) == 1 else -1, []).append(k)
    for _, keys in sorted(groups.items()):  # the same order on every process
        out |= dict(zip(keys, cross_pool.gather([values[k] for k in keys]), strict=True))
    return out
