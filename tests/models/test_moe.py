"""Mixtures of experts against transformers (Qwen3-MoE, Mixtral), the dispatches against a
loop-based NumPy reference, router statistics, and the settings refused before anything runs."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_fixtures import MOE, hf_logits, left_padded_batch, make_hf_model

import hfjax.models as M
from hfjax.models import moe
from hfjax.models.config import ModelConfig

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "engine"))


@pytest.fixture(scope="module", params=MOE)
def hf_moe(request, tmp_path_factory):
    d = str(tmp_path_factory.mktemp(request.param))
    return request.param, make_hf_model(request.param, d), d


def _max_diff(a, b, mask):
    return float(np.abs(a - b)[mask.astype(bool)].max())


def test_logits_match_transformers(hf_moe):
    """Uniform layers run under the scan; a mixed model (dense layer 0) runs them unrolled."""
    kind, ref, path = hf_moe
    ids, mask = left_padded_batch(ref.config.vocab_size)
    want = hf_logits(ref, ids, mask)
    model = M.load(path)
    got = np.asarray(jax.jit(lambda i, m: model(i, m))(ids, mask))
    assert _max_diff(got, want, mask) <= 1e-4, kind


def test_export_round_trip(hf_moe, tmp_path):
    """Saved as sharded safetensors (a small shard limit forces an index) and read back by
    transformers and by hfjax. (Mixtral's names, and Qwen3-MoE's with a dense layer whose MLP
    is stacked apart from the experts; plain Qwen3-MoE adds nothing to CI's time.)"""
    import transformers as tf

    kind, ref, path = hf_moe
    if kind == "qwen3_moe":
        pytest.skip("covered by qwen3_moe_mixed")
    model = M.load(path)
    out = M.save_hf(model, str(tmp_path / "export"), max_shard_bytes=64 * 1024)
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    again = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(again) is type(ref)
    ids, mask = left_padded_batch(ref.config.vocab_size, seed=3)
    got = np.asarray(model(ids, mask))
    assert _max_diff(got, hf_logits(again, ids, mask), mask) <= 1e-5
    assert _max_diff(np.asarray(M.load(out)(ids, mask)), got, mask) == 0.0


def test_greedy_rows_match_hf_generate(hf_moe):
    from test_sampler import hf_greedy

    from hfjax.engine import generate

    kind, ref, path = hf_moe
    if kind != "qwen3_moe_mixed":
        # The decode loop runs every model's layers unrolled: the mixed model (a dense layer
        # and two sparse ones, no renormalisation) covers what the others would.
        pytest.skip("covered by qwen3_moe_mixed")
    ids, mask = left_padded_batch(ref.config.vocab_size, lengths=(9, 5, 12, 1))
    want = hf_greedy(ref, ids, mask, 12)
    out = generate(M.load(path), ids, mask, max_new_tokens=12, temperature=0.0, pad_id=0)
    np.testing.assert_array_equal(np.asarray(out.tokens), want, err_msg=kind)


# --- dispatch against a loop-based reference ------------------------------------------------

SMALL = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2,
                    num_heads=2, num_kv_heads=1, head_dim=8, model_type="qwen3_moe",
                    qk_norm=True, num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=12, norm_topk_prob=True)


def _reference(p, x, k, norm, cap=None):
    """Per token, per chosen expert, in plain NumPy; with `cap`, an expert takes the first
    `cap` assignments in (slot, token) order and drops the rest."""
    x = np.asarray(x, np.float64)
    logits = x @ np.asarray(p["router"], np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    load = {}
    order = [(j, n) for j in range(k) for n in range(x.shape[0])]
    chosen = [np.argsort(-probs[n], kind="stable")[:k] for n in range(x.shape[0])]
    for j, n in order:
        e = int(chosen[n][j])
        w = probs[n, chosen[n]]
        w = w / w.sum() if norm else w
        load[e] = load.get(e, 0) + 1
        if cap is not None and load[e] > cap:
            continue
        g = x[n] @ np.asarray(p["expert_gate"][e], np.float64)
        u = x[n] @ np.asarray(p["expert_up"][e], np.float64)
        h = g / (1 + np.exp(-g)) * u
        out[n] += w[j] * (h @ np.asarray(p["expert_down"][e], np.float64))
    return out


@pytest.mark.parametrize("impl, factor", [("ragged", 1.25), ("capacity", 8.0),
                                          ("capacity", 0.5)])
def test_dispatch_matches_loop_reference(impl, factor):
    cfg = SMALL.replace(moe_impl=impl, capacity_factor=factor)
    # Initialisation scale x 20: outputs of order 0.1-1, so the tolerance below means something.
    p = {k: 20 * v[0] for k, v in M.build(cfg).model.layers.arrays().items()}
    x = jax.random.normal(jax.random.key(1), (3, 7, cfg.hidden_size))
    y, stats = jax.jit(lambda p, x: moe.sparse_mlp(cfg, p, x))(p, x)
    cap = moe.capacity(cfg, 21) if impl == "capacity" else None
    want = _reference(p, x.reshape(21, -1), 2, True, cap)
    np.testing.assert_allclose(np.asarray(y).reshape(21, -1), want, atol=2e-5, rtol=1e-4)
    assert int(stats.counts.sum()) == 21 * 2
    if factor < 1:  # half the mean load per expert: something was dropped
        assert np.abs(want - _reference(p, x.reshape(21, -1), 2, True)).max() > 1e-2


def test_blocked_experts_equal_ragged_dot_with_their_gradients():
    """The CPU's grouped matmul (blocks of rows, one expert each) against jax.lax.ragged_dot,
    values and gradients of weights and rows, on uneven groups: one expert empty, one holding
    more than a block, one a single row."""
    cfg = SMALL
    E, D = cfg.num_experts, cfg.hidden_size
    F = cfg.moe_intermediate_size
    keys = jax.random.split(jax.random.key(4), 3)
    p = {"expert_gate": jax.random.normal(keys[0], (E, D, F)),
         "expert_up": jax.random.normal(keys[1], (E, D, F)),
         "expert_down": jax.random.normal(keys[2], (E, F, D)) / F}
    sizes = np.zeros(E, np.int32)
    sizes[:3] = (0, 11, 1)
    sizes[3] = 30 - sizes.sum()
    xs = jax.random.normal(jax.random.key(2), (30, D))
    assert moe.block_rows(30, E) == 8  # expert 3's rows span several blocks

    def ragged(p, xs):
        def mm(x, w):
            return jax.lax.ragged_dot(x, w, jnp.asarray(sizes), preferred_element_type=jnp.float32)
        return mm(jax.nn.silu(mm(xs, p["expert_gate"])) * mm(xs, p["expert_up"]),
                  p["expert_down"])

    def blocked(p, xs):
        return moe.blocked_experts(cfg, p, xs, jnp.asarray(sizes))

    np.testing.assert_allclose(jax.jit(blocked)(p, xs), jax.jit(ragged)(p, xs), atol=1e-4,
                               rtol=1e-5)
    probe = jax.random.normal(jax.random.key(3), (30, D))
    grads = [jax.jit(jax.grad(lambda p, xs, f=f: jnp.sum(f(p, xs) * probe), argnums=(0, 1)))(
        p, xs) for f in (blocked, ragged)]
    for got, want in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        np.testing.assert_allclose(got, want, atol=1e-3, rtol=1e-4)


def test_router_stats_and_replay():
    """Balanced load gives an aux loss of k; replayed ids are the ids used; the statistics
    skip padding tokens."""
    cfg = SMALL
    p = {k: v[0] for k, v in M.build(cfg).model.layers.arrays().items()}
    x = jax.random.normal(jax.random.key(2), (2, 5, cfg.hidden_size))
    valid = jnp.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
    mlp = jax.jit(lambda x, rec, valid: moe.sparse_mlp(cfg, p, x, recorded=rec, valid=valid))
    y, stats = mlp(x, None, valid)
    assert int(stats.counts.sum()) == 8 * 2 and not bool(stats.mismatch.any())
    flipped = (stats.ids + 1) % cfg.num_experts
    y_replay, again = mlp(x, flipped, valid)
    np.testing.assert_array_equal(np.asarray(again.ids), np.asarray(flipped))
    assert np.abs(np.asarray(y) - np.asarray(y_replay)).max() > 1e-4
    assert bool(again.mismatch[valid].all())  # every flipped token's set differs
    # Compared, not replayed: the router's own experts, and the tokens whose set differs;
    # the same set in another order is no mismatch.
    recorded = flipped.at[0, 0].set(stats.ids[0, 0, ::-1]).reshape(10, 2)
    _, own, _, mismatch = moe.route(cfg, x.reshape(10, -1), p["router"], recorded, replay=False)
    np.testing.assert_array_equal(np.asarray(own), np.asarray(stats.ids).reshape(10, 2))
    np.testing.assert_array_equal(np.asarray(mismatch), np.arange(10) > 0)
    logits = jnp.zeros((8, cfg.num_experts))
    ids = jnp.arange(16).reshape(8, 2) % cfg.num_experts
    balanced = moe.router_stats(cfg, logits, ids, jnp.zeros(8, bool), None, (1, 8))
    assert float(balanced.aux_loss) == pytest.approx(2.0)
    assert float(balanced.z_loss) == pytest.approx(np.log(4.0) ** 2, rel=1e-5)


def test_collected_stats_per_sparse_layer_and_gradients_reach_the_router():
    cfg = SMALL
    model = M.build(cfg)
    ids = jnp.ones((2, 6), jnp.int32)
    from flax import nnx

    graphdef, state = nnx.split(model)

    def loss(state):
        with moe.collecting() as found:
            nnx.merge(graphdef, state)(ids)
        (stats,) = found
        return jnp.sum(stats.aux_loss), stats

    (aux, stats), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
    assert stats.counts.shape == (2, cfg.num_experts) and stats.ids.shape == (2, 2, 6, 2)
    assert float(jnp.abs(grads["model"]["layers"]["router"][...]).max()) > 0


@pytest.mark.parametrize("change, message", [
    (dict(num_experts_per_tok=5), "num_experts_per_tok=5 with num_experts=4"),
    (dict(num_experts=0), "is a mixture of experts; set num_experts > 0"),
    (dict(moe_intermediate_size=0), "needs moe_intermediate_size > 0"),
    (dict(mlp_only_layers=(0, 1)), "no layer is sparse"),
    (dict(mlp_only_layers=(7,)), "names layer(s) [7]"),
    (dict(moe_impl="megablox"), "moe_impl='megablox'"),
    (dict(model_type="mixtral", qk_norm=False, norm_topk_prob=False),
     "Mixtral renormalises"),
])
def test_bad_settings_refused_in_one_line(change, message):
    with pytest.raises(ValueError, match=None) as err:
        SMALL.replace(**change)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_replay_on_a_dense_model_refused():
    dense = M.build(ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24,
                                num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8))
    with pytest.raises(ValueError, match="routing replay needs a mixture-of-experts model"):
        dense(jnp.ones((1, 3), jnp.int32), routing=jnp.zeros((1, 1, 3, 2), jnp.int32))


@pytest.mark.parametrize("name, total, active", [
    ("qwen3-30b-a3b", 30_532_122_624, 3.35e9),  # total: the published parameter count
    ("qwen3-235b-a22b", 235.1e9, 22.2e9),
    ("mixtral-8x7b", 46.7e9, 12.9e9),
])
def test_presets_have_the_published_sizes(name, total, active):
    from hfjax.models import presets

    cfg = presets.get_preset(name)
    assert cfg.num_params() == pytest.approx(total, rel=1e-3)
    assert cfg.num_params() == presets.param_bytes(name) // 4
    assert cfg.active_params() == pytest.approx(active, rel=1e-2)
    assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg


def test_flops_and_activations_count_active_experts():
    """The planner prices a token's FLOPs and activations by its k experts, its weights by
    all of them."""
    from hfjax.models import flops, presets

    cfg = presets.get_preset("qwen3-30b-a3b")
    emb = 2 * cfg.vocab_size * cfg.hidden_size
    per_token = flops.layers_flops(cfg, 1, 1, 0)
    assert per_token == pytest.approx(2 * (cfg.active_params() - emb), rel=1e-3)
    assert flops.active_mlp_width(cfg) == 8 * 768
    assert presets.param_bytes(cfg) == 4 * cfg.num_params()
