"""Transfers between pools and layouts never go through the host; `to_host` fetches whole."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support import no_host_round_trip, pool_mesh

from hfjax.parallel.mesh import ResourcePool
from hfjax.parallel.transfer import to_host, transfer

LAYOUTS = [
    # (source pool, source mesh, destination pool, destination mesh, destination spec)
    ((0, 4), "data=4", (4, 8), "data=4", P("data")),
    ((0, 4), "data=4", (4, 8), "data=2,tensor=2", P("data")),
    ((0, 4), "data=4", (4, 8), "fsdp=2,tensor=2", P(None, "tensor")),
    ((0, 4), "data=4", (4, 8), "data=4", P()),
    ((0, 4), "fsdp=4", (4, 6), "data=2", P("data")),
    ((0, 2), "data=2", (2, 8), "data=6", P("data")),
    ((0, 3), "data=3", (3, 7), "data=4", P("data")),  # 4 shards don't divide 3 source devices
    ((0, 4), "data=4", (2, 6), "fsdp=4", P("fsdp")),  # overlapping device sets
    ((0, 4), "data=4", (0, 4), "data=2,tensor=2", P("tensor")),  # same devices, new layout
    ((0, 8), "data=2,tensor=4", (0, 8), "data=8", P("data")),
]


@pytest.mark.parametrize("src, src_spec, dst, dst_spec, pspec", LAYOUTS)
def test_transfer_between_pools_never_touches_host(src, src_spec, dst, dst_spec, pspec):
    value = np.arange(24 * 4, dtype=np.float32).reshape(24, 4)
    src_mesh = pool_mesh(*src, src_spec)
    x = jax.device_put(value, NamedSharding(src_mesh, P(("data", "fsdp"))))
    target = NamedSharding(pool_mesh(*dst, dst_spec), pspec)
    with no_host_round_trip():
        y = transfer(x, target)
        y.block_until_ready()
    assert y.sharding == target
    np.testing.assert_array_equal(np.asarray(y), value)


def test_transfer_to_same_devices_in_another_order():
    value = np.arange(32, dtype=np.float32).reshape(8, 4)
    x = jax.device_put(value, NamedSharding(pool_mesh(0, 4, "data=4"), P("data")))
    reordered = ResourcePool("reversed", tuple(reversed(jax.devices()[:4]))).mesh("data=2,tensor=2")
    target = NamedSharding(reordered, P("tensor"))
    with no_host_round_trip():
        y = transfer(x, target)
        y.block_until_ready()
    assert y.sharding == target
    np.testing.assert_array_equal(np.asarray(y), value)


def test_plain_device_put_reshard_goes_through_host():
    """Why `transfer` exists: jax.device_put stages this layout change through the host.

    If this starts failing, jax learned to do it device to device and `transfer` can shrink.
    """
    x = jax.device_put(np.ones((8, 4)), NamedSharding(pool_mesh(0, 4, "data=4"), P("data")))
    target = NamedSharding(pool_mesh(4, 8, "data=2,tensor=2"), P("data"))
    with pytest.raises(Exception, match="Disallowed host-to-device transfer"):
        with no_host_round_trip():
            jax.device_put(x, target).block_until_ready()


def test_to_host_fetches_the_whole_array_once():
    value = np.arange(32, dtype=np.float32).reshape(8, 4)
    x = jax.device_put(value, NamedSharding(pool_mesh(0, 8, "data=4,tensor=2"), P("data")))
    with jax.transfer_guard("disallow"):
        host = to_host(x)  # allowed inside: the fetch is the function's purpose
    assert isinstance(host, np.ndarray)
    np.testing.assert_array_equal(host, value)
