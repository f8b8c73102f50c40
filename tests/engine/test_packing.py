"""Packed training batches against padded ones: the same log-probs, values, reward-model scores,
losses and gradients (within float32 rounding), on 1 device and on a data=2,fsdp=2,tensor=2 mesh.

The references are the padded computations, which test_hf_parity.py and test_rl_loop.py check
against HF transformers and NumPy; the packing layout itself is checked against a loop over the
sequences. Every batch mixes prompt and response lengths (full and one-token ones), and the
budgets are chosen so that micro-batches hold several sequences per row and there are several
of them.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support import padded_rl_batch

from configs import ppo_arith
from hfjax.engine import grouping, packing, update
from hfjax.engine.spec import RolloutSpec
from hfjax.models import attention, transformer
from hfjax.models.config import ModelConfig
from hfjax.parallel.mesh import ResourcePool
from hfjax.workers.actor import ActorRollout
from hfjax.workers.critic import Critic
from hfjax.workers.score import ModelReward
from hfjax.workers.spec import ActorSpec, CriticSpec, ScoreSpec

P, R, B = 8, 12, 16
CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, tie_word_embeddings=True,
                  max_position_embeddings=64)
MESHES = {"1dev": "fsdp=1", "dp4tp2": "data=2,fsdp=2,tensor=2"}


def _pool(spec):
    n = 1 if spec == "fsdp=1" else 8
    return ResourcePool(f"devices0-{n}", tuple(jax.devices()[:n]))


def padded_batch(seed=0, P=P, R=R):
    """A host batch of B sequences: left-padded prompts of 1..P tokens, right-padded responses
    of 1..R tokens, with advantages, old/reference log-probs, values and returns."""
    return padded_rl_batch(seed, B, P, R, CFG.vocab_size)


def test_layout_matches_a_loop_over_the_sequences():
    batch = padded_batch(1)
    mask = batch["attention_mask"]
    shape = packing.pack_shape(B, P + R, budget=2 * (P + R), dp=2)
    # One row per device and micro-batch, as wide as the budget; the buffers hold the worst
    # case, every sequence P + R tokens long (2 per row).
    assert shape == packing.PackShape(width=2 * (P + R), rows=2, micro=4, span=P + R)
    where = packing.plan(mask, shape)
    packed = packing.pack(batch["input_ids"], mask, where, shape)
    row, start = np.asarray(where.row), np.asarray(where.start)
    ids, seg, pos, scored = (np.asarray(x).reshape(-1, shape.width) for x in packed)
    filled = np.zeros(ids.shape, bool)
    for i in range(B):
        real = batch["input_ids"][i][mask[i] > 0]
        cols = slice(start[i], start[i] + len(real))
        np.testing.assert_array_equal(ids[row[i], cols], real)
        np.testing.assert_array_equal(pos[row[i], cols], np.arange(len(real)))
        assert (seg[row[i], cols] == i + 1).all() and not filled[row[i], cols].any()
        filled[row[i], cols] = True
    assert (seg[~filled] == 0).all()  # nothing else is written
    np.testing.assert_array_equal(scored, filled)  # every real token's output is read
    used = int(filled.any(axis=1).sum())
    assert filled.any(axis=1)[:used].all()  # the rows in use are a prefix
    assert used < B  # rows hold several sequences
    assert int(where.n_micro) == -(-used // shape.rows) > 1


def test_scored_positions_are_those_that_predict_response_tokens():
    batch = padded_batch(1)
    mask = batch["attention_mask"]
    shape = packing.pack_shape(B, P + R, budget=3 * (P + R), dp=2)
    packed, where, row, col = packing.packed_batch(batch["input_ids"], mask, R, shape)
    scored = np.asarray(packed.scored).reshape(-1, shape.width)
    want = np.zeros_like(scored)
    row, start = np.asarray(where.row), np.asarray(where.start)
    for i in range(B):
        plen, rlen = int(mask[i, :P].sum()), int(mask[i, P:].sum())
        want[row[i], start[i] + plen - 1 : start[i] + plen + rlen - 1] = 1
    np.testing.assert_array_equal(scored, want)


@pytest.mark.parametrize("chunk", [4, 7, 128])
def test_a_head_on_the_scored_positions_equals_it_on_all(chunk):
    """`on_scored`: the same outputs and gradients at the scored positions as the head over
    every position, zeros elsewhere; chunks past the fullest row's count are skipped."""
    rng = np.random.default_rng(7)
    g, w, d = 3, 21, 5
    scored = (rng.random((g, w)) < 0.4).astype(np.int32)
    scored[2] = 0  # a row with nothing scored
    x = rng.normal(size=(g, w, d)).astype(np.float32)
    labels = rng.integers(0, d, (g, w)).astype(np.int32)
    runs = []

    def head(h, lab, k):
        jax.debug.callback(lambda: runs.append(1))  # runs only when the chunk is computed
        lp = jax.nn.log_softmax(h * k, axis=-1)
        return jnp.take_along_axis(lp, lab[..., None], axis=-1)[..., 0], jnp.sum(h * h, -1)

    def on_scored(k):
        return packing.on_scored(lambda h, lab: head(h, lab, k), jnp.asarray(scored), x, labels,
                                 chunk=chunk)

    got = jax.block_until_ready(on_scored(1.5))
    jax.effects_barrier()
    # Chunks computed: those holding the fullest row's scored positions, no more.
    assert len(runs) == -(-int(scored.sum(1).max()) // chunk)
    if chunk == 4:
        assert len(runs) < -(-w // chunk)  # some were skipped
    want = head(x, labels, 1.5)
    m = scored > 0
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a)[m], np.asarray(b)[m], rtol=1e-6)
        assert (np.asarray(a)[~m] == 0).all()
    grad = jax.grad(lambda k: sum(jnp.sum(o) for o in on_scored(k)))(1.5)
    want_grad = jax.grad(
        lambda k: sum(jnp.sum(jnp.where(m, o, 0)) for o in head(x, labels, k)))(1.5)
    np.testing.assert_allclose(float(grad), float(want_grad), rtol=1e-5)


def test_a_budget_below_one_sequence_is_refused():
    with pytest.raises(ValueError, match=r"a token budget of 19 per device is smaller than one "
                                         r"sequence \(20 tokens"):
        packing.pack_shape(B, P + R, budget=P + R - 1, dp=1)


def _acfg(mode, budget, micro=B, grouped=False):
    a = ppo_arith.get_config().actor
    a.loss_agg_mode, a.use_kl_loss, a.entropy_coeff = mode, True, 0.01
    a.ppo_mini_batch_size, a.ppo_micro_batch_size = B, micro
    a.use_remove_padding, a.ppo_max_token_len_per_gpu = budget is not None, budget or 0
    a.group_by_length = grouped
    a.shuffle = False
    return a


def _rollout(response_length):
    r = ppo_arith.get_config().rollout
    r.n, r.response_length = 1, response_length
    return RolloutSpec.of(r)


def _actor(mesh, acfg, model, response_length=R):
    return ActorRollout("actor", _pool(mesh), mesh, model, rules="train", sampler=None,
                        spec=ActorSpec.of(acfg), rollout=_rollout(response_length),
                        optimizer=update.make_optimizer(1e-2, grad_clip=0.0))


@pytest.fixture(scope="module")
def model():
    return transformer.build(CFG, "causal_lm", seed=3)


def _twin(model):
    """A model with `model`'s weights in buffers of its own: a group built from a model on
    its own device may share a buffer with it, and updates donate their groups' buffers."""
    return nnx.merge(*nnx.split(jax.tree.map(lambda x: x.copy(), model)))


def test_banded_attention_equals_the_dense_segment_mask(model):
    """Rows wide enough for blocks (`uses_band`): the same hidden states and gradients as
    attention over the whole row with the segment mask."""
    rng = np.random.default_rng(5)
    span, width = P + R, 6 * (P + R)
    assert attention.uses_band(width, span)
    seg = np.zeros((2, width), np.int32)
    pos = np.zeros((2, width), np.int32)
    for b in range(2):
        col, s = 0, 1
        while (n := int(rng.integers(1, span + 1))) <= width - col - 3:  # 3 columns stay empty
            seg[b, col : col + n], pos[b, col : col + n] = s, np.arange(n)
            col, s = col + n, s + 1
    ids = rng.integers(1, CFG.vocab_size, seg.shape).astype(np.int32) * (seg > 0)
    real = seg > 0
    graphdef, state = nnx.split(model)

    def hidden(state, span):
        h, _ = nnx.merge(graphdef, state).model(ids, None, positions=pos, segment_ids=seg,
                                                  segment_span=span)
        return h

    np.testing.assert_allclose(np.asarray(hidden(state, span))[real],
                               np.asarray(hidden(state, None))[real], rtol=1e-5, atol=1e-6)
    grads = [jax.grad(lambda st, sp=sp: (hidden(st, sp) * real[..., None]).sum())(state)
             for sp in (span, None)]
    scale = max(float(np.abs(x).max()) for x in jax.tree.leaves(grads[1]))
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6 * scale)


# Budgets: two sequences' worth (rows attended whole) and six (banded attention).
BUDGETS = {"2seq": 2 * (P + R), "6seq": 6 * (P + R)}


@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("mesh", list(MESHES), ids=list(MESHES))
def test_log_probs_and_entropy_equal_the_padded_ones(model, mesh, budget):
    batch = padded_batch(2)
    padded = _actor(MESHES[mesh], _acfg("token-mean", None), model)
    packed = _actor(MESHES[mesh], _acfg("token-mean", BUDGETS[budget]), model)
    want = padded.compute_log_prob(batch)
    got = packed.compute_log_prob(batch)
    m = batch["response_mask"] > 0
    for key in ("old_log_probs", "entropys"):
        np.testing.assert_allclose(np.asarray(got[key])[m], np.asarray(want[key])[m],
                                   rtol=1e-5, atol=1e-5)
    assert (np.asarray(got["old_log_probs"])[~m] == 0).all()


@pytest.mark.parametrize("mesh", list(MESHES), ids=list(MESHES))
def test_padded_log_probs_in_micro_batches_equal_one_pass(model, mesh):
    """The padded scoring pass takes ppo_micro_batch_size rows at a time (strided, as the
    update): the same log-probs and entropy as the whole batch in one pass."""
    batch = padded_batch(6)
    one = _actor(MESHES[mesh], _acfg("token-mean", None, micro=B), model)
    four = _actor(MESHES[mesh], _acfg("token-mean", None, micro=4), model)
    assert (one.scoring_micro_batches(B), four.scoring_micro_batches(B)) == (1, 4)
    want, got = one.compute_log_prob(batch), four.compute_log_prob(batch)
    for key in ("old_log_probs", "entropys"):
        np.testing.assert_allclose(np.asarray(got[key]), np.asarray(want[key]), rtol=1e-6,
                                   atol=1e-6)


# (mode, token budget): one micro-batch for every mode; several (budget of 2 padded rows per
# device) for the modes whose mini-batch loss does not depend on the grouping (module
# docstring of hfjax.engine.packing).
GRAD_CASES = [(mode, B * (P + R)) for mode in ("token-mean", "seq-mean-token-sum",
                                                "seq-mean-token-mean", "seq-mean-token-sum-norm")]
GRAD_CASES += [("token-mean", 2 * (P + R)), ("seq-mean-token-mean", 2 * (P + R)),
               ("token-mean", 6 * (P + R))]


@pytest.mark.parametrize("mode, budget", GRAD_CASES)
def test_policy_loss_and_gradients_equal_the_padded_ones(model, mode, budget):
    batch = padded_batch(3)
    actor = _actor("fsdp=1", _acfg(mode, budget), model)
    shape = actor.budget.shape(B, P + R, actor.dp_size, "actor")
    arrays = dict(batch.to(actor.mesh).arrays)

    def padded(params, arrays):
        grad_fn = jax.value_and_grad(actor._policy_loss, has_aux=True)
        (loss, metrics), grads = grad_fn(params, arrays, update.normalisers(arrays))
        return grads, {"loss": loss, **metrics}

    def packed(params, arrays):
        return packing.accumulate_grads(actor._policy_loss, params, arrays,
                                        update.normalisers(arrays), shape)

    g_want, m_want = actor.jit(padded)(actor.params, arrays)
    g_got, m_got = actor.jit(packed)(actor.params, arrays)
    single = int(packing.plan(arrays["attention_mask"], shape).n_micro) == 1
    assert single == (budget == B * (P + R))
    for k in m_want:
        if not single and k in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
            continue  # token means weighted by the sequences' share: they depend on the grouping
        np.testing.assert_allclose(float(m_got[k]), float(m_want[k]), rtol=2e-5, atol=1e-6,
                                   err_msg=k)
    scale = max(float(np.abs(x).max()) for x in jax.tree.leaves(g_want))
    for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5 * scale, rtol=1e-4)


def _assert_same_step(metrics, groups, keys, atol=2e-5):
    """Two worker groups took the same optimizer step: equal metrics `keys` and parameters."""
    for k in keys:
        np.testing.assert_allclose(float(metrics[1][k]), float(metrics[0][k]), rtol=1e-4,
                                   err_msg=k)
    for a, b in zip(jax.tree.leaves(groups[1].params), jax.tree.leaves(groups[0].params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol)


# On 1 device the same losses and gradients are checked above; here the whole update program
# (mini-batches, the while loop, the optimizer) on the multi-device mesh.
@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("mesh", ["dp4tp2"])
def test_actor_and_critic_updates_equal_the_padded_ones(model, mesh, budget):
    """One optimizer step each through update_actor / update_critic (several micro-batches in
    both layouts), then the same parameters and metrics."""
    batch = padded_batch(4)
    spec = MESHES[mesh]
    tokens = BUDGETS[budget]
    actors = [_actor(spec, _acfg("token-mean", b, micro=8), _twin(model))
              for b in (None, tokens)]
    metrics = [a.update_actor(batch) for a in actors]
    _assert_same_step(metrics, actors,
                      ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"))

    critics = []
    for remove_padding in (False, True):
        c = ppo_arith.get_config().critic
        c.ppo_mini_batch_size, c.ppo_micro_batch_size, c.shuffle = B, 8, False
        c.use_remove_padding, c.ppo_max_token_len_per_gpu = remove_padding, tokens
        value_model = transformer.build(CFG, "value", seed=4)  # the same weights each time
        critics.append(Critic("critic", _pool(spec), spec, value_model,
                              spec=CriticSpec.of(c), rollout=_rollout(R),
                              optimizer=update.make_optimizer(1e-2, grad_clip=0.0)))
    m = batch["response_mask"] > 0
    values = [np.asarray(c.compute_values(batch)["values"]) for c in critics]
    np.testing.assert_allclose(values[1][m], values[0][m], rtol=1e-5, atol=1e-5)
    metrics = [c.update_critic(batch) for c in critics]
    _assert_same_step(metrics, critics, ("critic/vf_loss", "critic/grad_norm"))


# The whole batch's tokens (0), two sequences' worth and six (banded attention).
SCORE_BUDGETS = {"whole": 0, **BUDGETS}


@pytest.mark.parametrize("budget", list(SCORE_BUDGETS))
@pytest.mark.parametrize("mesh", list(MESHES), ids=list(MESHES))
def test_reward_model_scores_equal_the_padded_ones(mesh, budget):
    """A reward model scores each sequence at the same token packed or padded: its last one
    that is not the pad id, which some responses end in (a pad that doubles as EOS)."""
    batch = padded_batch(5)
    pad = 3
    ids, mask = batch["input_ids"], batch["attention_mask"]
    last = mask.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1)
    mine = np.arange(B) % 3 == 0  # these rows pad with the pad id and end in it
    ids[mine[:, None] & (mask == 0)] = pad
    ids[mine, last[mine]] = pad
    assert (batch["input_ids"][mine, last[mine]] == pad).all()
    cfg = dataclasses.replace(CFG, pad_token_id=pad)
    spec = MESHES[mesh]
    scores = []
    for remove_padding in (False, True):
        s = ppo_arith.get_config().reward_model
        s.use_remove_padding = remove_padding
        s.forward_max_token_len_per_gpu = SCORE_BUDGETS[budget]
        rm = ModelReward("reward_model", _pool(spec), spec,
                         transformer.build(cfg, "score", seed=6), budget=ScoreSpec.of(s).budget)
        assert (rm.budget is None) != remove_padding
        scores.append(np.asarray(rm.compute_score(batch)["rm_scores"]))
    assert scores[0].shape == (B,) and np.abs(scores[0]).max() > 1e-3  # a head that is not zero
    np.testing.assert_allclose(scores[1], scores[0], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_ppo_step_runs_on_packed_batches():
    """The config switches: actor (update, log-prob), reference and critic all pack; the step's
    losses are finite and the update was applied."""
    from support import tiny_rl_config

    from hfjax.run.trainer import Trainer

    c = tiny_rl_config(mesh="fsdp=4,tensor=2")
    # An untrained model scores 0 everywhere, so its advantages are 0: the entropy bonus gives
    # the update a gradient to apply.
    c.actor.use_kl_loss, c.actor.entropy_coeff = True, 0.01
    for role in (c.actor, c.critic):
        role.use_remove_padding, role.ppo_micro_batch_size = True, 4
    t = Trainer(c)
    w = t.workers
    assert w.actor.budget is not None and w.critic.budget is not None
    assert w.ref.budget == w.actor.budget
    before = [np.array(x) for x in jax.tree.leaves(w.actor.params)]  # copies: updates donate
    m = t.train_step()
    for k in ("actor/pg_loss", "actor/kl_loss", "critic/vf_loss", "actor/grad_norm"):
        assert np.isfinite(m[k]), k
    assert m["actor/nonfinite_updates"] == 0 and m["actor/grad_norm"] > 0
    after = [np.asarray(x) for x in jax.tree.leaves(w.actor.params)]
    assert any(not np.array_equal(a, b) for a, b in zip(before, after))


# -- Length-grouped micro-batches (hfjax.engine.grouping) -------------------------------------

# Wide enough that micro-batches get cut: prompts of up to 40 and responses of up to 48 tokens.
GP, GR = 40, 48


def test_the_plan_covers_every_row():
    batch = padded_batch(7, P=GP, R=GR)
    ext = grouping.extents(jnp.asarray(batch["attention_mask"]), GR)
    mask = batch["attention_mask"]
    np.testing.assert_array_equal(ext[0], mask[:, :GP].sum(1))  # contiguous real tokens
    np.testing.assert_array_equal(ext[1], mask[:, GP:].sum(1))
    cuts = grouping.plan(ext, 6, GP, GR)
    assert [len(c.rows) for c in cuts] == [6, 6, 4]
    assert sorted(np.concatenate([c.rows for c in cuts]).tolist()) == list(range(B))
    assert len({c.prompt for c in cuts}) == 1 and ext[0].max() <= cuts[0].prompt <= GP
    for c in cuts:
        assert ext[1, c.rows].max() <= c.response
        assert c.response == GR or c.response & (c.response - 1) == 0  # a power of two
    # Longest responses first, so the later micro-batches are narrower.
    assert [c.response for c in cuts] == sorted((c.response for c in cuts), reverse=True)
    assert cuts[-1].response < GR
    # Rounded up to a multiple of the data-parallel size: every cut splits over the devices.
    assert [len(c.rows) for c in grouping.plan(ext, 6, GP, GR, dp=4)] == [8, 8]


@pytest.mark.parametrize("mesh", list(MESHES), ids=list(MESHES))
def test_grouped_log_probs_equal_the_padded_ones(model, mesh):
    batch = padded_batch(8, P=GP, R=GR)
    spec = MESHES[mesh]
    padded = _actor(spec, _acfg("token-mean", None, micro=4), model, GR)
    # 6 rows: cuts of 6, 6 and 4 on one device, of 8 on four data-parallel devices.
    grouped = _actor(spec, _acfg("token-mean", None, micro=6, grouped=True), model, GR)
    want, got = padded.compute_log_prob(batch), grouped.compute_log_prob(batch)
    m = batch["response_mask"] > 0
    for key in ("old_log_probs", "entropys"):
        np.testing.assert_allclose(np.asarray(got[key])[m], np.asarray(want[key])[m],
                                   rtol=1e-5, atol=1e-5, err_msg=key)


# The default mode and the one whose weights depend on how a mini-batch is cut; the other
# modes' normalisers are the same code for every layout, tested on packed batches (GRAD_CASES)
# and on shared-prompt rows (tests/engine/test_shared_prompt.py).
GROUPED_MODES = ("token-mean", "seq-mean-token-sum-norm")


@pytest.mark.parametrize("mode", GROUPED_MODES)
def test_grouped_updates_equal_the_padded_ones(model, mode):
    """One optimizer step through update_actor on micro-batches of 4 rows, strided full-width
    vs length-grouped and cut: the same metrics and parameters."""
    batch = padded_batch(9, P=GP, R=GR)
    actors = [_actor("fsdp=1", _acfg(mode, None, micro=4, grouped=g), _twin(model), GR)
              for g in (False, True)]
    metrics = [a.update_actor(batch) for a in actors]
    keys = ["actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"]
    if mode == "token-mean":  # per-sequence weighted token means depend on the grouping
        keys += ["actor/pg_clipfrac", "actor/ppo_kl"]
    # Adam's step is about lr = 1e-2 whatever a gradient's size: rounding in a near-zero
    # gradient moves its parameter by up to ~1e-4.
    _assert_same_step(metrics, actors, keys, atol=1e-4)


def test_grouped_actor_and_critic_on_a_multi_device_mesh(model):
    spec = MESHES["dp4tp2"]
    batch = padded_batch(10, P=GP, R=GR)
    actors = [_actor(spec, _acfg("token-mean", None, micro=4, grouped=g), _twin(model), GR)
              for g in (False, True)]
    metrics = [a.update_actor(batch) for a in actors]
    _assert_same_step(metrics, actors, ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"))
    critics = []
    for grouped in (False, True):
        c = ppo_arith.get_config().critic
        c.ppo_mini_batch_size, c.ppo_micro_batch_size, c.shuffle = B, 4, False
        c.group_by_length = grouped
        critics.append(Critic("critic", _pool(spec), spec, transformer.build(CFG, "value", seed=4),
                              spec=CriticSpec.of(c), rollout=_rollout(GR),
                              optimizer=update.make_optimizer(1e-2, grad_clip=0.0)))
    m = batch["response_mask"] > 0
    values = [np.asarray(c.compute_values(batch)["values"]) for c in critics]
    np.testing.assert_allclose(values[1][m], values[0][m], rtol=1e-5, atol=1e-5)
    metrics = [c.update_critic(batch) for c in critics]
    for k in ("critic/vf_loss", "critic/grad_norm"):
        np.testing.assert_allclose(float(metrics[1][k]), float(metrics[0][k]), rtol=1e-4,
                                   err_msg=k)


def test_grouping_and_packing_together_are_refused(model):
    a = _actor("fsdp=1", _acfg("token-mean", 2 * (P + R), micro=4, grouped=True), model)
    with pytest.raises(ValueError, match="group_by_length and use_remove_padding"):
        a.update_actor(padded_batch(11))
