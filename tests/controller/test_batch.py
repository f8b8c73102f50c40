"""Batch operations and placement onto meshes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support import no_host_round_trip, pool_mesh

from hfjax.controller.batch import Batch


def make_batch(n=6, on_device=True):
    tokens = np.arange(n * 4, dtype=np.int32).reshape(n, 4)
    scores = np.linspace(0.0, 1.0, n, dtype=np.float32)
    arrays = {"tokens": jnp.asarray(tokens) if on_device else tokens, "scores": scores}
    meta = {"ground_truth": [f"gt{i}" for i in range(n)], "extra": [[i, i] for i in range(n)]}
    return Batch(arrays, meta, {"temperature": 1.0})


def rows(x):
    return np.asarray(x).tolist()


# ------------------------------------------------------------------------------- construction


def test_len_getitem_keys_and_meta_conversion():
    b = make_batch()
    assert len(b) == 6
    assert b["tokens"].shape == (6, 4)
    assert b["ground_truth"][2] == "gt2"
    # A list of lists stays one object per sample.
    assert b.meta["extra"].shape == (6,) and b.meta["extra"][1] == [1, 1]
    assert b.keys() == ["tokens", "scores", "ground_truth", "extra"]
    assert "scores" in b and "nope" not in b
    with pytest.raises(KeyError, match="batch has no key 'nope'"):
        b["nope"]
    assert len(Batch()) == 0


def test_mismatched_leading_dims_name_the_keys():
    with pytest.raises(ValueError, match=r"batch array 'b' has 3 rows but 'a' has 4"):
        Batch({"a": np.zeros((4, 2)), "b": np.zeros(3)})
    with pytest.raises(ValueError, match=r"batch meta 'gt' has 2 rows but 'a' has 4"):
        Batch({"a": np.zeros(4)}, {"gt": ["x", "y"]})
    with pytest.raises(ValueError, match=r"'s' is a scalar; .*put non-batched values in info"):
        Batch({"s": np.zeros(())})
    with pytest.raises(ValueError, match=r"keys \['x'\] are both arrays and meta"):
        Batch({"x": np.zeros(2)}, {"x": [1, 2]})
    with pytest.raises(TypeError, match=r"'x' is a list; arrays must be jax.Array or numpy"):
        Batch({"x": [1, 2]})
    with pytest.raises(TypeError, match=r"meta 'gt' must be a per-sample list"):
        Batch({"x": np.zeros(2)}, {"gt": "ab"})


def test_select_and_union():
    b = make_batch()
    s = b.select(["tokens"], meta_keys=[])
    assert list(s.arrays) == ["tokens"] and not s.meta and s.info == b.info
    assert s["tokens"] is b["tokens"]
    with pytest.raises(KeyError, match=r"select: no keys \['missing'\]"):
        b.select(["missing"])

    extra = Batch({"values": jnp.ones((6,))}, info={"step": 3})
    u = b.union(extra)
    assert set(u.arrays) == {"tokens", "scores", "values"}
    assert u.info == {"temperature": 1.0, "step": 3}
    # The same object on both sides is fine; a different one is a conflict.
    assert b.union(b.select(["tokens"]))["tokens"] is b["tokens"]
    with pytest.raises(ValueError, match=r"union: array 'tokens' is in both batches"):
        b.union(Batch({"tokens": jnp.zeros((6, 4), jnp.int32)}))
    with pytest.raises(ValueError, match=r"union: batches have 6 and 2 rows"):
        b.union(Batch({"v": np.zeros(2)}))
    with pytest.raises(ValueError, match=r"union: info 'temperature' differs"):
        b.union(Batch({"v": np.zeros(6)}, info={"temperature": 0.5}))


# -------------------------------------------------------------------------------- reshaping


def test_split_concat_round_trip():
    b = make_batch(7)
    parts = b.split(3)
    assert [len(p) for p in parts] == [3, 3, 1]
    assert rows(parts[1]["tokens"]) == rows(np.asarray(b["tokens"])[3:6])
    assert list(parts[2]["ground_truth"]) == ["gt6"]
    back = Batch.concat(parts)
    assert isinstance(back["tokens"], jax.Array)
    assert isinstance(back["scores"], np.ndarray)
    for key in ("tokens", "scores"):
        np.testing.assert_array_equal(np.asarray(back[key]), np.asarray(b[key]))
    assert list(back["ground_truth"]) == list(b["ground_truth"])
    assert back.info == b.info
    with pytest.raises(ValueError, match="split size must be positive"):
        b.split(0)


def test_concat_errors():
    b = make_batch()
    with pytest.raises(ValueError, match=r"concat: batch 1 has keys"):
        Batch.concat([b, b.select(["tokens"])])
    with pytest.raises(ValueError, match=r"concat: info 'temperature' differs"):
        Batch.concat([b, Batch(b.arrays, b.meta, {"temperature": 2.0})])
    with pytest.raises(ValueError, match="at least one batch"):
        Batch.concat([])


@pytest.mark.parametrize("interleave", [True, False])
def test_repeat(interleave):
    b = make_batch(3)
    r = b.repeat(2, interleave=interleave)
    tokens, gt = np.asarray(b["tokens"]), list(b["ground_truth"])
    if interleave:
        order = [i for i in range(3) for _ in range(2)]  # 0 0 1 1 2 2
    else:
        order = [i for _ in range(2) for i in range(3)]  # 0 1 2 0 1 2
    assert rows(r["tokens"]) == [tokens[i].tolist() for i in order]
    assert rows(r["scores"]) == [float(np.asarray(b["scores"])[i]) for i in order]
    assert list(r["ground_truth"]) == [gt[i] for i in order]
    assert r.meta["extra"][1] == ([0, 0] if interleave else [1, 1])


@pytest.mark.parametrize("n, k, pad", [(6, 4, 2), (3, 8, 5), (8, 4, 0), (1, 3, 2)])
def test_pad_unpad_round_trip(n, k, pad):
    b = make_batch(n)
    padded, got = b.pad_to_multiple(k)
    assert got == pad and len(padded) == n + pad and len(padded) % k == 0
    # Padding repeats rows from the start, wrapping around when pad > n.
    expect = [i % n for i in range(n + pad)]
    assert rows(padded["tokens"]) == [np.asarray(b["tokens"])[i].tolist() for i in expect]
    assert list(padded["ground_truth"]) == [f"gt{i}" for i in expect]
    back = padded.unpad(got)
    np.testing.assert_array_equal(np.asarray(back["tokens"]), np.asarray(b["tokens"]))
    assert list(back["ground_truth"]) == list(b["ground_truth"])
    with pytest.raises(ValueError, match=r"unpad\(99\)"):
        b.unpad(99)


def test_take_index_and_masks():
    b = make_batch(6)
    perm = np.array([5, 0, -1, 2])
    t = b.take(perm)
    expect = [5, 0, 5, 2]
    assert rows(t["tokens"]) == [np.asarray(b["tokens"])[i].tolist() for i in expect]
    assert list(t["ground_truth"]) == [f"gt{i}" for i in expect]
    m = b.index(np.array([True, False, True, False, False, True]))
    assert list(m["ground_truth"]) == ["gt0", "gt2", "gt5"]
    s = b[1:6:2]
    assert list(s["ground_truth"]) == ["gt1", "gt3", "gt5"]
    assert rows(s["tokens"]) == rows(np.asarray(b["tokens"])[1:6:2])
    assert len(b[4:2]) == 0
    with pytest.raises(IndexError, match=r"indices must lie in \[-6, 6\)"):
        b.take([6])
    with pytest.raises(TypeError, match=r"would drop the batch axis"):
        b.index(2)
    with pytest.raises(ValueError, match=r"boolean mask has shape \(2,\), batch has 6 rows"):
        b.index(np.array([True, False]))


def test_device_ops_make_no_implicit_transfers():
    mesh = pool_mesh(0, 4, "data=4")
    b = make_batch(8).to(mesh)
    # "disallow" forbids implicit copies; take's index upload is explicit and allowed.
    with jax.transfer_guard("disallow"):
        parts = b.split(4)
        joined = Batch.concat(parts)
        padded, pad = b.select(["tokens"]).take(np.arange(7)).pad_to_multiple(4)
        rep = b.repeat(3)
        unpadded = padded.unpad(pad)
    assert len(joined) == 8 and len(rep) == 24 and len(unpadded) == 7
    assert isinstance(unpadded["tokens"], jax.Array)
    assert {d.id for d in unpadded["tokens"].devices()} == {0, 1, 2, 3}


# --------------------------------------------------------------------------------- placement


def test_to_mesh_splits_batch_axis_over_dp_axes():
    mesh = pool_mesh(0, 8, "data=2,fsdp=2,tensor=2")
    b = make_batch(8).to(mesh)
    for key in ("tokens", "scores"):
        x = b[key]
        assert isinstance(x, jax.Array)
        assert x.sharding == NamedSharding(mesh, P(("data", "fsdp")))
        # 4 data-parallel ranks of 2 rows each, replicated over tensor.
        assert x.sharding.shard_shape(x.shape)[0] == 2
    np.testing.assert_array_equal(np.asarray(b["tokens"]), np.arange(32).reshape(8, 4))
    assert b.meta["ground_truth"][0] == "gt0"

    rep = make_batch(6).to(mesh, batch_axes=())
    assert rep["tokens"].sharding.is_fully_replicated
    only_data = make_batch(6).to(mesh, batch_axes="data")
    assert only_data["tokens"].sharding.spec == P("data")


def test_to_sharding_mapping_and_function():
    mesh = pool_mesh(4, 8, "fsdp=4")
    b = make_batch(8)
    s = NamedSharding(mesh, P("fsdp"))
    assert b.to(s)["scores"].sharding == s
    mapped = b.to({"tokens": s})
    assert mapped["tokens"].sharding == s
    assert isinstance(mapped["scores"], np.ndarray)  # not in the mapping: stays put
    by_fn = b.to(lambda key, x: NamedSharding(mesh, P("fsdp") if x.ndim == 2 else P()))
    assert by_fn["tokens"].sharding.spec == P("fsdp")
    assert by_fn["scores"].sharding.spec == P()
    with pytest.raises(TypeError, match="batch_axes is only meaningful"):
        b.to(s, batch_axes="fsdp")


def test_to_rejects_batches_that_do_not_divide():
    mesh = pool_mesh(0, 8, "data=2,fsdp=2,tensor=2")
    with pytest.raises(ValueError, match=r"batch array 'tokens' with shape \(6, 4\) cannot be"):
        make_batch(6).to(mesh)


def test_batch_to_other_pool_is_device_to_device():
    b = make_batch(8).to(pool_mesh(0, 4, "fsdp=4"))
    dst = pool_mesh(4, 8, "data=2,tensor=2")
    with no_host_round_trip():
        moved = b.to(dst)
    assert moved["tokens"].sharding == NamedSharding(dst, P("data"))
    assert {d.id for d in moved["scores"].devices()} == {4, 5, 6, 7}
    np.testing.assert_array_equal(np.asarray(moved["tokens"]), np.asarray(b["tokens"]))


def test_fetch_is_the_explicit_host_copy():
    b = make_batch(4)
    host = b.fetch(["tokens"])
    assert isinstance(host["tokens"], np.ndarray)
    assert host["tokens"].tolist() == np.arange(16).reshape(4, 4).tolist()
    with pytest.raises(KeyError, match=r"fetch: no arrays \['gt'\]"):
        b.fetch(["gt"])
