"""Transfer protocols: dispatch/collect round trips on real 8-device meshes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support import no_host_round_trip, pool_mesh

from hfjax.controller.batch import Batch
from hfjax.controller.protocol import (
    DP_COMPUTE,
    ON_HOST,
    get_protocol,
    method,
    protocol_of,
)


def make_batch(n):
    return Batch(
        {
            "tokens": jnp.arange(n * 3, dtype=jnp.int32).reshape(n, 3),
            "mask": np.ones((n, 3), dtype=np.float32),
        },
        {"uid": [f"u{i}" for i in range(n)]},
    )


def row_sums_reference(tokens):
    out = []
    for row in np.asarray(tokens):
        total = 0
        for v in row:
            total += int(v)
        out.append(total)
    return out


@pytest.mark.parametrize(
    "n, spec, dp, pad",
    [
        (6, "data=2,fsdp=2,tensor=2", 4, 2),
        (8, "fsdp=-1", 8, 0),
        (5, "tensor=8", 1, 0),
        (3, "data=4,tensor=2", 4, 1),
    ],
)
def test_dp_compute_round_trip_with_padding(n, spec, dp, pad):
    mesh = pool_mesh(0, 8, spec)
    batch = make_batch(n)
    placed, got = DP_COMPUTE.dispatch(batch, mesh)
    assert got == pad and len(placed) == n + pad and DP_COMPUTE.pad_multiple(mesh) == dp
    expected = DP_COMPUTE.in_sharding(mesh)
    for key in ("tokens", "mask"):
        assert placed[key].sharding == expected
        assert placed[key].sharding.shard_shape(placed[key].shape)[0] == (n + pad) // dp
    assert len(placed.meta["uid"]) == n + pad  # meta is padded alongside, on the host

    @jax.jit
    def score(tokens, mask):
        return {"sums": jnp.sum(tokens * mask, axis=1)}

    out = jax.jit(score, out_shardings=DP_COMPUTE.in_sharding(mesh))(
        placed["tokens"], placed["mask"]
    )
    assert out["sums"].sharding == expected
    collected = DP_COMPUTE.collect(out, got)
    assert collected["sums"].shape == (n,)
    assert np.asarray(collected["sums"]).tolist() == row_sums_reference(batch["tokens"])

    back = DP_COMPUTE.collect(placed, got)
    assert isinstance(back, Batch) and len(back) == n
    assert list(back["uid"]) == list(batch["uid"])


def test_dp_compute_across_disjoint_pools_stays_on_device():
    """Dispatch a device-resident batch from pool 0-3 to pool 4-7 with every host copy banned.

    "disallow_explicit" forbids even deliberate host transfers; on CPU the host-to-device guard is
    the one that catches a round trip (reading a CPU buffer on the host is zero-copy).
    """
    src = pool_mesh(0, 4, "fsdp=4")
    dst = pool_mesh(4, 8, "data=2,tensor=2")
    batch = make_batch(8).to(src)
    batch = batch.take(np.arange(7))  # 7 rows: dispatch must pad to 8 on the way
    with (
        jax.transfer_guard_device_to_host("disallow_explicit"),
        jax.transfer_guard_host_to_device("disallow_explicit"),
    ):
        placed, pad = DP_COMPUTE.dispatch(batch, dst)
        jax.block_until_ready(placed.arrays)
    assert pad == 1
    assert placed["tokens"].sharding == NamedSharding(dst, P("data"))
    assert {d.id for d in placed["tokens"].devices()} == {4, 5, 6, 7}
    got = np.asarray(DP_COMPUTE.collect(placed, pad)["tokens"])
    np.testing.assert_array_equal(got, np.arange(21).reshape(7, 3))


def test_on_host_fetches_inputs_and_places_outputs_on_home():
    batch = make_batch(8).to(pool_mesh(0, 4, "fsdp=4"))
    placed, pad = ON_HOST.dispatch(batch, None)
    assert pad == 0 and isinstance(placed["tokens"], np.ndarray)
    assert list(placed["uid"]) == list(batch["uid"])
    home = pool_mesh(4, 8, "data=2,tensor=2")
    out = ON_HOST.collect(Batch({"sums": placed["tokens"].sum(axis=1)}), 0, home)
    assert out["sums"].sharding == NamedSharding(home, P("data"))
    assert np.asarray(out["sums"]).tolist() == row_sums_reference(batch["tokens"])


_double = jax.jit(lambda x: x * 2)  # the 2 is a compile-time constant: no upload


class Doubler:
    """A worker-group-like object: a mesh to compute on and a home for results."""

    def __init__(self, mesh, home):
        self.mesh, self.home = mesh, home

    @method(DP_COMPUTE, reads=("tokens",))
    def double(self, batch):
        assert set(batch.arrays) == {"tokens"}  # only what the method reads travels
        assert batch["tokens"].sharding == DP_COMPUTE.in_sharding(self.mesh)
        return Batch({"doubled": _double(batch["tokens"])})

    @method(DP_COMPUTE, reads=("tokens",), may_read=("mask", "absent"))
    def summary(self, batch):
        return {"keys": sorted(batch.arrays)}


def test_method_dispatches_to_its_mesh_and_collects_to_home():
    """The caller never places data: a batch on one pool goes to the method's pool and the
    result comes back to the home pool, all device to device, padding dropped."""
    src, mine = pool_mesh(0, 7, "fsdp=7"), pool_mesh(4, 8, "data=4")
    batch = make_batch(7).to(src)  # 7 rows: padded to 8 for data=4
    group = Doubler(mine, home=src)
    with no_host_round_trip():
        out = group.double(batch)
        jax.block_until_ready(out.arrays)
    assert len(out) == 7
    assert out["doubled"].sharding == NamedSharding(src, P("fsdp"))  # home's batch split
    np.testing.assert_array_equal(np.asarray(out["doubled"]), 2 * np.arange(21).reshape(7, 3))
    assert protocol_of(group.double) is DP_COMPUTE
    # Rows that don't split over home's batch axes come back replicated there.
    odd = Doubler(mine, home=pool_mesh(0, 4, "fsdp=4")).double(batch)
    assert odd["doubled"].sharding == NamedSharding(odd["doubled"].sharding.mesh, P())
    assert group.summary(make_batch(4)) == {"keys": ["mask", "tokens"]}
    with pytest.raises(KeyError, match=r"Doubler.double needs batch arrays \['tokens'\]"):
        group.double(Batch({"other": np.zeros((4, 1))}))


def test_protocol_lookup_and_tagging_errors():
    assert protocol_of(Doubler.double) is DP_COMPUTE
    assert protocol_of(Doubler.__init__) is None
    assert get_protocol("on_host") is ON_HOST
    assert get_protocol(DP_COMPUTE) is DP_COMPUTE
    with pytest.raises(ValueError, match=r"unknown transfer protocol 'DP_PROTO'; use one of"):
        get_protocol("DP_PROTO")
    with pytest.raises(TypeError, match=r"write @method\(DP_COMPUTE\)"):

        @method
        def bare(self):
            return None


def test_dispatch_accepts_pytrees_of_arrays():
    mesh = pool_mesh(0, 8, "data=4,tensor=2")
    tree = {"a": jnp.ones((5, 2)), "b": np.arange(5)}
    placed, pad = DP_COMPUTE.dispatch(tree, mesh)
    assert isinstance(placed, dict) and set(placed) == {"a", "b"} and pad == 3
    assert placed["b"].sharding == NamedSharding(mesh, P("data"))
    assert np.asarray(DP_COMPUTE.collect(placed, pad)["b"]).tolist() == [0, 1, 2, 3, 4]

    single, pad = DP_COMPUTE.dispatch(jnp.arange(6), mesh)
    assert single.shape == (8,) and pad == 2
    assert np.asarray(DP_COMPUTE.collect(single, pad)).tolist() == list(range(6))

    pair, pad = DP_COMPUTE.dispatch((jnp.zeros((2, 1)), jnp.ones((2,))), mesh)
    assert isinstance(pair, tuple) and pair[0].shape == (4, 1) and pad == 2
