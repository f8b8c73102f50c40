"""3D-HybridEngine on 8 CPU devices: bit-identical round trips, volumes at the lower bound (and
Table 2 for Megatron-style layouts), a free way back, zero-redundancy peaks, the paper's device
order, the actor integration, and clear errors for decode layouts that cannot work."""

import gc
import logging
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support import tiny_rl_config

from hfjax.engine import hybrid
from hfjax.engine.sampler import Sampler, SamplingParams
from hfjax.models import transformer
from hfjax.models.presets import get_preset
from hfjax.parallel import reshard
from hfjax.parallel import sharding as shd
from hfjax.parallel.mesh import MeshSpec

# (training mesh, training rules, decode mesh); "decode" rules on data x tensor = Megatron-style
# (params split over tensor, replicated over data), "nested_train" = FSDP-style.
MEGATRON = [
    ("data=2,tensor=4", "decode", "data=4,tensor=2"),
    ("data=1,tensor=8", "decode", "data=4,tensor=2"),
    ("data=2,tensor=4", "decode", "data=8"),
]
FSDP = [
    ("fsdp=8", "nested_train", "data=4,tensor=2"),
    ("fsdp=4,tensor=2", "nested_train", "data=4,tensor=2"),
    ("fsdp=2,tensor=4", "nested_train", "data=8"),
]
PAIRS = MEGATRON + FSDP

# 8 query and 8 KV heads, so every tensor-parallel dimension splits 8 ways and the only
# replicated tensors are the norms.
SMALL = get_preset("tiny").replace(
    vocab_size=64, hidden_size=16, intermediate_size=32, num_heads=8, num_kv_heads=8,
    head_dim=4, max_position_embeddings=64,
)
# SmolLM2-135M-sized with 8 heads (SmolLM2's 9 divide no tensor size used here).
SMOL_SIZED = get_preset("smollm2-135m").replace(num_heads=8, num_kv_heads=2, head_dim=72)


def table2_bytes(t: int, t_g: int, model_bytes: float) -> float:
    """The paper's Table 2 HybridFlow volume (tp - t_g p_g)/(t_g p_g tp) * M with p = p_g = 1."""
    return (t - t_g) / (t_g * t) * model_bytes


def layout(train, rules):
    return shd.layout(MeshSpec.parse(train).build(jax.devices()), rules)


def place(model, lay):
    """The model's params in `lay`, in buffers of their own: transitions free their inputs, and
    a plain device_put may alias the model's single-device buffers."""
    state = nnx.state(model)
    return jax.tree.map(jnp.copy, jax.device_put(state, lay.state_shardings(state)))


def host(tree):
    return [np.asarray(x).copy() for x in jax.tree.leaves(tree)]


def tp_bytes(cfg, itemsize):
    """(bytes of the vocab/heads/mlp weights, bytes of the KV projections), written out from
    the config: together, every parameter but the norms."""
    L, D, N, K, H, F = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                        cfg.head_dim, cfg.intermediate_size)
    dense = cfg.vocab_size * D + 2 * L * D * N * H + 3 * L * D * F
    return dense * itemsize, 2 * L * D * K * H * itemsize


@pytest.fixture(scope="module")
def small_model():
    return transformer.build(SMALL, seed=3)


@pytest.mark.parametrize("train,rules,decode", PAIRS)
def test_round_trip_is_bit_identical_at_the_lower_bound(small_model, train, rules, decode):
    lay = layout(train, rules)
    params = place(small_model, lay)
    before = host(params)
    want_shardings = jax.tree.leaves(lay.state_shardings(nnx.state(small_model)))
    engine = hybrid.HybridEngine(lay, decode, params)

    # Arrays of earlier tests held only by reference cycles would otherwise be collected, and
    # counted as freed, in the middle of the measurement.
    gc.collect()
    base = reshard.live_bytes()
    dec = engine.to_decode(params)
    to_decode = engine.last
    # The training buffers are freed: the process holds exactly the decode shards instead.
    grown = reshard.live_bytes()
    train_b, dec_b = engine.train_bytes(), engine.decode_bytes()
    assert {d: grown[d] - base[d] for d in base} == {d: dec_b[d] - train_b[d] for d in base}
    assert all(x.sharding == s for x, s in zip(jax.tree.leaves(dec), engine.decode_shardings()))
    assert all(x.is_deleted() for x, s in zip(jax.tree.leaves(params), engine.leaves)
               if s.gathered)

    back = engine.to_train(dec)
    assert all(x.is_deleted() for x, s in zip(jax.tree.leaves(dec), engine.leaves) if s.gathered)
    assert [x.sharding for x in jax.tree.leaves(back)] == want_shardings
    chex.assert_trees_all_equal(before, host(back), strict=True)  # values and dtypes

    # Volume: every device receives exactly its decode shard minus its own training shard.
    moved, bound = engine.bytes_to_decode(), engine.lower_bound()
    assert moved == bound and to_decode.bytes_received == moved
    assert set(engine.bytes_to_train().values()) == {0}
    assert set(engine.last.bytes_received.values()) == {0}
    t, t_g = lay.mesh.shape["tensor"], engine.decode_mesh.shape["tensor"]
    n = 8 if rules == "nested_train" else t
    m = sum(tp_bytes(SMALL, 4))  # 8 KV heads split like the rest
    assert engine.split_bytes() == m
    if rules == "decode":
        assert set(moved.values()) == {table2_bytes(t, t_g, m)}
    assert set(moved.values()) == {m // t_g - m // n}
    # The baselines move more, except when decoding replicates everything (then naive = bound).
    naive, v = engine.naive_bytes(), engine.hybridflow_v_bytes()
    assert set(naive.values()) == {m - m // n}
    assert all(v[d] >= moved[d] for d in moved)
    if t_g > 1:
        assert all(naive[d] > moved[d] for d in moved)

    # Zero redundancy: the peak never exceeds the decode shard plus one tensor's shard.
    largest = engine.largest_shard_bytes()
    for stats in (to_decode, engine.last):
        for d, peak in stats.peak_bytes.items():
            assert peak <= dec_b[d] + largest[d], (stats.direction, d)


def test_decode_mesh_follows_the_paper_device_order():
    # Megatron data=2,tensor=4 -> data=4,tensor=2: decode tensor groups at stride t/t_g = 2
    # inside each training TP group, micro-DP groups (same decode shard) of consecutive ranks.
    engine = hybrid.HybridEngine(layout("data=2,tensor=4", "decode"), "data=4,tensor=2",
                                 nnx.state(transformer.abstract(SMALL)))
    ids = np.vectorize(lambda d: d.id)(engine.decode_mesh.devices).reshape(4, 2)
    np.testing.assert_array_equal(ids, [[0, 2], [1, 3], [4, 6], [5, 7]])
    assert engine.micro_dp == 2
    # Consecutive ranks (HybridFlow-V) do not nest: the busiest device receives more.
    assert reshard.max_bytes(engine.hybridflow_v_bytes()) > reshard.max_bytes(
        engine.bytes_to_decode())


# The 2 KV heads of SMOL_SIZED under nested_train: (ways training splits the KV projections,
# ways decoding splits them). fsdp does not divide 2 heads, so it splits their embed dimension
# instead; decoding keeps whole what training does not split over the decode tensor axis.
NESTED_KV = {"fsdp=8": (8, 1), "fsdp=4,tensor=2": (8, 2), "fsdp=2,tensor=4": (2, 1)}


@pytest.mark.parametrize("train,rules,decode", PAIRS)
def test_smollm2_sized_volumes_match_closed_forms(train, rules, decode):
    cfg = SMOL_SIZED.replace(param_dtype="bfloat16")
    engine = hybrid.HybridEngine(layout(train, rules), decode,
                                 nnx.state(transformer.abstract(cfg)))
    # Megatron-style: 2 KV heads split 4 or 8 ways in no layout here: replicated in both, they
    # move nothing, so M is the other tensor-parallel weights.
    m, kv = tp_bytes(cfg, 2)
    t = MeshSpec.parse(train).resolve(8)["tensor"]
    t_g = MeshSpec.parse(decode).resolve(8)["tensor"]
    n = 8 if rules == "nested_train" else t
    kv_train, kv_decode = NESTED_KV[train] if rules == "nested_train" else (1, 1)
    moved = engine.bytes_to_decode()
    assert moved == engine.lower_bound()
    assert set(moved.values()) == {m // t_g - m // n + kv // kv_decode - kv // kv_train}
    if rules == "decode":
        assert set(moved.values()) == {table2_bytes(t, t_g, m)}
    assert set(engine.bytes_to_train().values()) == {0}
    assert set(engine.naive_bytes().values()) == {m - m // n + kv - kv // kv_train}
    # With fsdp over embed outside the micro-DP tail of tensor x fsdp (fsdp=2,tensor=4 ->
    # data=8) the KV projections nest but move by plain transfers, at the same bytes.
    direct = train == "fsdp=2,tensor=4" and rules == "nested_train"
    assert engine.split_bytes() == m + (kv if kv_train > 1 and not direct else 0)
    assert bool(engine.direct) == direct


@pytest.mark.parametrize("method", hybrid.METHODS)
def test_methods_agree_and_way_back_has_no_collectives(small_model, method):
    lay = layout("fsdp=8", "nested_train")
    params = place(small_model, lay)
    before = host(params)
    engine = hybrid.HybridEngine(lay, "data=4,tensor=2", params, method=method)
    dec = engine.to_decode(params)
    full = [np.asarray(x) for x in jax.tree.leaves(dec)]
    chex.assert_trees_all_equal(before, full, strict=True)
    for i, leaf in enumerate(engine.leaves):
        if leaf.gathered:
            x = jax.tree.leaves(dec)[i]
            hlo = engine._program("slice", i).lower(reshard.relabel(x, leaf.decode_t)).compile()
            text = hlo.as_text()
            assert not any(op in text for op in
                           ("all-gather", "all-reduce", "all-to-all", "collective-permute"))
    back = engine.to_train(dec)
    chex.assert_trees_all_equal(before, host(back), strict=True)


def test_train_rules_nest_after_reordering_but_fsdp_only_cannot(small_model):
    # Under TRAIN_RULES (fsdp splits embed) fsdp x tensor still nests: fsdp joins the micro-DP
    # group and the all-gather runs over embed.
    lay = layout("fsdp=4,tensor=2", "train")
    params = place(small_model, lay)
    before = host(params)
    engine = hybrid.HybridEngine(lay, "data=4,tensor=2", params)
    assert engine.bytes_to_decode() == engine.lower_bound()
    back = engine.to_train(engine.to_decode(params))
    chex.assert_trees_all_equal(before, host(back), strict=True)
    # With fsdp alone, training keeps mlp/heads whole while decoding splits them.
    with pytest.raises(hybrid.LayoutError, match="NESTED_TRAIN_RULES"):
        hybrid.HybridEngine(layout("fsdp=8", "train"), "data=4,tensor=2", params)


def test_decode_layouts_that_cannot_hold_the_model_are_refused():
    smol = nnx.state(transformer.abstract(get_preset("smollm2-135m")))
    with pytest.raises(hybrid.LayoutError, match=r"data=4,tensor=2.*'heads'=9"):
        hybrid.HybridEngine(layout("data=8", "decode"), "data=4,tensor=2", smol)
    small = nnx.state(transformer.abstract(SMALL))
    with pytest.raises(hybrid.LayoutError, match=r"tensor=8.*Megatron-style.*tensor=4"):
        hybrid.HybridEngine(layout("data=2,tensor=4", "decode"), "tensor=8", small)
    with pytest.raises(hybrid.LayoutError, match="only 'data'"):
        hybrid.HybridEngine(layout("fsdp=8", "nested_train"), "fsdp=4,tensor=2", small)


def test_fallback_round_trips_and_logs_the_extra_bytes(small_model, caplog):
    lay = layout("data=2,tensor=4", "decode")
    params = place(small_model, lay)
    before = host(params)
    with caplog.at_level(logging.WARNING):
        engine = hybrid.HybridEngine(lay, "tensor=8", params, allow_fallback=True)
    assert engine.fallback
    back_bytes = reshard.max_bytes(engine.bytes_to_train())
    assert back_bytes > 0
    assert any("extra bytes" in r.getMessage() and str(back_bytes) in r.getMessage()
               for r in caplog.records)
    back = engine.to_train(engine.to_decode(params))
    chex.assert_trees_all_equal(before, host(back), strict=True)


def test_decoding_on_the_engine_layout_matches_the_training_layout(small_model):
    # The sampler on the decode mesh with the engine's params gives the tokens that decoding
    # in the training layout gives.
    lay = layout("fsdp=4,tensor=2", "nested_train")
    params = place(small_model, lay)
    engine = hybrid.HybridEngine(lay, "data=4,tensor=2", params)
    sp = SamplingParams(max_new_tokens=6, temperature=0.0)
    ids = np.tile(np.arange(1, 6, dtype=np.int32), (8, 1))
    mask = np.ones_like(ids)
    plain = Sampler(small_model, mesh=lay.mesh, rules=None).generate(params, ids, mask, sp)
    dec = engine.to_decode(params)
    out = Sampler(small_model, mesh=engine.decode_mesh, rules=None).generate(dec, ids, mask, sp)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(plain.tokens))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(plain.logprobs), atol=1e-5)
    params = engine.to_train(dec)
    assert math.isfinite(float(np.asarray(jax.tree.leaves(params)[0]).sum()))


def engine_config(hybrid_engine):
    # TRAIN_RULES (fsdp over embed) still nest under the engine's device order.
    c = tiny_rl_config()
    c.actor.mesh = "fsdp=4,tensor=2"
    c.rollout.mesh = "data=4,tensor=2"
    c.rollout.hybrid_engine = hybrid_engine
    c.rollout.offload_optimizer = hybrid_engine
    return c


@pytest.mark.slow
def test_actor_generates_through_the_engine_and_keeps_training():
    from hfjax.data.batching import prompt_batch
    from hfjax.run.trainer import Trainer

    on, off = Trainer(engine_config(True)), Trainer(engine_config(False))
    assert off.actor.hybrid is None and on.actor.hybrid is not None
    assert on.actor.sampler.mesh == on.actor.hybrid.decode_mesh
    before = host(on.actor.params)
    rows = on.test_data.rows
    batch = prompt_batch(rows, np.zeros(len(rows), np.int32), on.tok.pad_id,
                         on.cfg.data.max_prompt_length)
    got = on.actor.generate(batch, greedy=True, n=1)
    want = off.actor.generate(batch, greedy=True, n=1)
    np.testing.assert_array_equal(np.asarray(got["responses"]), np.asarray(want["responses"]))
    # The params came back bit-identical, in the training shardings the updates compiled for.
    chex.assert_trees_all_equal(before, host(on.actor.params), strict=True)
    assert all(x.sharding == s for x, s in zip(jax.tree.leaves(on.actor.params),
                                               jax.tree.leaves(on.actor.param_shardings)))
    # The optimizer state went to host memory and came back where the updates expect it.
    assert all(x.sharding == s for x, s in zip(jax.tree.leaves(on.actor.opt_state),
                                               jax.tree.leaves(on.actor.opt_shardings)))
    metrics = on.train_step()
    assert math.isfinite(metrics["actor/pg_loss"])
    assert not any(x.is_deleted() for x in jax.tree.leaves(on.actor.params))


def test_offload_parks_arrays_in_host_memory_and_brings_them_back():
    lay = layout("fsdp=4,tensor=2", "nested_train")
    tree = {"m": jnp.arange(64.0).reshape(8, 8), "count": jnp.int32(3)}
    tree["m"] = jax.device_put(tree["m"], shd.Layout(lay.mesh).sharding(("mlp", None), (8, 8)))
    shardings = jax.tree.map(lambda x: x.sharding, tree)
    want = jax.tree.map(np.asarray, tree)
    parked = reshard.offload(tree)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(parked)} == {"pinned_host"}
    assert all(x.is_deleted() for x in jax.tree.leaves(tree))
    back = reshard.reload(parked, shardings)
    assert jax.tree.map(lambda x: x.sharding, back) == shardings
    for k in want:
        np.testing.assert_array_equal(np.asarray(back[k]), want[k])


def test_parameters_that_cannot_nest_move_by_plain_transfers_and_round_trip():
    # 4 heads on fsdp=4,tensor=2 under the nested rules split over tensor only (8 ways do not
    # divide 4), while a tensor=4 decode splits them 4 ways: the attention weights cannot nest
    # and move by plain transfers; the mlp and vocab, split over tensor x fsdp, still nest.
    cfg = SMALL.replace(num_heads=4, num_kv_heads=4)
    model = transformer.build(cfg, seed=5)
    lay = layout("fsdp=4,tensor=2", "nested_train")
    params = place(model, lay)
    before = host(params)
    engine = hybrid.HybridEngine(lay, "data=2,tensor=4", params)
    direct = {leaf.name for leaf in engine.leaves if leaf.direct}
    assert direct == {f"model.layers.{p}_proj" for p in "qkvo"}
    assert any(leaf.gathered for leaf in engine.leaves)
    dec = engine.to_decode(params)
    assert all(x.sharding == s for x, s in zip(jax.tree.leaves(dec), engine.decode_shardings()))
    chex.assert_trees_all_equal(before, [np.asarray(x) for x in jax.tree.leaves(dec)],
                                strict=True)
    back = engine.to_train(dec)
    chex.assert_trees_all_equal(before, host(back), strict=True)
    assert [x.sharding for x in jax.tree.leaves(back)] == engine.train_shardings()
    # Only the parameters that do not nest cost anything on the way back.
    assert reshard.max_bytes(engine.bytes_to_train()) > 0
    nested = [leaf for leaf in engine.leaves if not leaf.direct]
    assert set(reshard.tree_transfer_bytes(
        [lf.decode for lf in nested], [lf.train for lf in nested],
        [jax.ShapeDtypeStruct(lf.shape, lf.dtype) for lf in nested]).values()) == {0}


@pytest.mark.parametrize("rules", ["train", "nested_train"])
@pytest.mark.parametrize("decode", ["data=2,tensor=4", "data=4,tensor=2", "tensor=8"])
def test_a_sequence_parallel_training_layout_reshards_to_any_decode_layout(
        small_model, rules, decode):
    """Rows split over `sequence` (FSDP spans it): the engine for rollout.mesh reshards to the
    decode layout, nesting what nests and moving the rest by plain transfers, and back."""
    lay = layout("fsdp=2,sequence=4", rules)
    params = place(small_model, lay)
    before = host(params)
    want = [x.sharding for x in jax.tree.leaves(params)]
    engine = hybrid.engine_for(lay, decode, params)
    dec = engine.to_decode(params)
    assert all(x.sharding == s for x, s in zip(jax.tree.leaves(dec), engine.decode_shardings()))
    chex.assert_trees_all_equal(before, host(dec), strict=True)  # same values, decode layout
    back = engine.to_train(dec)
    assert [x.sharding for x in jax.tree.leaves(back)] == want
    chex.assert_trees_all_equal(before, host(back), strict=True)


def test_expert_weights_reshard_at_the_lower_bound():
    """A mixture of experts trained with its experts split over `expert` (and their width over
    tensor x fsdp) decodes on data=4,tensor=2, which keeps every expert on each device (width
    split over tensor): the experts do not nest (the engine moves them by plain on-device
    transfers) but the bytes each device receives are still its decode shard minus its
    training shard, written out from the config, the way back moves nothing, and the round
    trip is bit-identical."""
    cfg = SMALL.replace(model_type="qwen3_moe", qk_norm=True, num_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=8, norm_topk_prob=True)
    lay = layout("fsdp=2,expert=2,tensor=2", "nested_train")
    params = place(transformer.build(cfg, seed=3), lay)
    before = host(params)
    engine = hybrid.HybridEngine(lay, "data=4,tensor=2", params)
    back = engine.to_train(engine.to_decode(params))
    chex.assert_trees_all_equal(before, host(back), strict=True)
    assert engine.bytes_to_decode() == engine.lower_bound()
    assert set(engine.bytes_to_train().values()) == {0}
    experts = [leaf for leaf in engine.leaves if ".expert_" in leaf.name]
    assert len(experts) == 3 and all(leaf.direct for leaf in experts)
    L, E, D, F = cfg.num_layers, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    whole = 3 * L * E * D * F * 4
    moved = reshard.tree_transfer_bytes(
        [leaf.train for leaf in experts], [leaf.decode for leaf in experts],
        [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in experts])
    assert set(moved.values()) == {whole // 2 - whole // 8}  # decode shard - training shard
