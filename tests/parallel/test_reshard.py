"""Byte accounting of reshards, checked against a loop-based NumPy reference that marks, element
by element, what each device holds."""

import gc
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hfjax.parallel import reshard


def held_mask(sharding, shape):
    """{device id: bool array, True where the device holds the element} (reference)."""
    out = {}
    for dev, idx in sharding.devices_indices_map(shape).items():
        mask = np.zeros(shape, bool)
        mask[idx] = True
        out[dev.id] = mask
    return out


def reference_received(src, dst, shape, itemsize):
    have, want = held_mask(src, shape), held_mask(dst, shape)
    out = {}
    for dev, w in want.items():
        h = have.get(dev, np.zeros(shape, bool))
        count = 0
        for pos in itertools.product(*(range(n) for n in shape)):
            if w[pos] and not h[pos]:
                count += 1
        out[dev] = count * itemsize
    return out


def mesh(shape, names, order=None):
    devs = jax.devices()
    order = list(range(8)) if order is None else order
    return Mesh(np.asarray([devs[i] for i in order], dtype=object).reshape(shape), names)


SHAPE = (8, 12)
CASES = [
    # (src mesh, src spec, dst mesh, dst spec)
    (((8,), ("x",)), P("x"), ((4, 2), ("a", "b")), P("a", "b")),
    (((8,), ("x",)), P("x"), ((8,), ("x",)), P()),
    (((2, 4), ("a", "b")), P(None, "b"), ((4, 2), ("a", "b")), P(None, "b")),
    (((2, 4), ("a", "b")), P(("b", "a")), ((2, 4), ("a", "b")), P("a")),
    (((8,), ("x",)), P(), ((2, 4), ("a", "b")), P("b", "a")),
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("reorder", [False, True])
def test_transfer_bytes_matches_elementwise_reference(case, reorder):
    (sm, sn), sspec, (dm, dn), dspec = CASES[case]
    order = [3, 0, 6, 1, 7, 2, 5, 4] if reorder else None
    src = NamedSharding(mesh(sm, sn), sspec)
    dst = NamedSharding(mesh(dm, dn, order), dspec)
    got = reshard.transfer_bytes(src, dst, SHAPE, jnp.bfloat16)
    assert got == reference_received(src, dst, SHAPE, 2)


def test_lower_bound_and_nesting():
    # Eighths of rows nest inside the halves of rows when device k's eighth is in its half.
    src = NamedSharding(mesh((8,), ("x",)), P("x"))
    nested = NamedSharding(mesh((2, 4), ("t", "d")), P("t"))  # device k -> half k // 4
    crossed = NamedSharding(mesh((4, 2), ("d", "t")), P("t"))  # device k -> half k % 2
    for dst, nests in ((nested, True), (crossed, False)):
        assert reshard.nests(src, dst, SHAPE) is nests
        got = reshard.transfer_bytes(src, dst, SHAPE, np.float32)
        bound = reshard.lower_bound_bytes(src, dst, SHAPE, np.float32)
        # |half| - |eighth| = 48 - 12 elements, float32.
        assert set(bound.values()) == {(48 - 12) * 4}
        assert (got == bound) is nests
        # The way back from nested halves is free; from crossed ones it is not.
        back = reshard.transfer_bytes(dst, src, SHAPE, np.float32)
        assert (set(back.values()) == {0}) is nests


def test_shard_and_tree_totals():
    s = NamedSharding(mesh((2, 4), ("a", "b")), P("a"))
    r = NamedSharding(mesh((8,), ("x",)), P())
    leaves = [jax.ShapeDtypeStruct((8, 12), jnp.float32), jax.ShapeDtypeStruct((4,), jnp.int8)]
    held = reshard.tree_shard_bytes([s, r], leaves)
    assert held == {d: 4 * 12 * 4 + 4 for d in range(8)}
    moved = reshard.tree_transfer_bytes([s, r], [r, r], leaves)
    assert moved == {d: 4 * 12 * 4 for d in range(8)}
    assert reshard.max_bytes(moved) == 4 * 12 * 4 and reshard.max_bytes({}) == 0


def test_array_bytes_counts_live_buffers_once():
    s = NamedSharding(mesh((8,), ("x",)), P("x"))
    x = jax.device_put(np.zeros((16, 4), np.float32), s)
    # A zero-copy view over the same buffers counts once.
    view = jax.make_array_from_single_device_arrays(
        x.shape, s, [sh.data for sh in x.addressable_shards]
    )
    assert reshard.array_bytes([x, view]) == {d: 2 * 4 * 4 for d in range(8)}
    # live_bytes sees every array of the process: arrays that earlier tests left for the
    # garbage collector must not be freed between the readings.
    gc.collect()
    gc.disable()
    try:
        before = reshard.live_bytes()
        y = jax.device_put(np.zeros((16, 4), np.float32), s)
        grown = reshard.live_bytes()
        assert all(grown[d] - before.get(d, 0) == 32 for d in range(8))
        y.delete()
        assert reshard.array_bytes([y]) == {}
        assert reshard.live_bytes() == before
    finally:
        gc.enable()
