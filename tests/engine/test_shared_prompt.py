"""Shared-prompt rows (hfjax.engine.shared_prompt) against padded ones: the same log-probs,
entropies, losses, gradients and optimizer steps (within float32 rounding), on 1 device and on a
data=2,fsdp=2,tensor=2 mesh, on padded and length-grouped micro-batches.

The references are the padded computations (checked against HF transformers in
test_hf_parity.py). Batches hold groups of N rows that share a prompt, as a GRPO batch's
samples do, with prompts and responses of mixed lengths (full and one-token ones).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support import padded_rl_batch

from configs import ppo_arith
from hfjax.engine import grouping, shared_prompt, update
from hfjax.engine.spec import RolloutSpec
from hfjax.models import attention, transformer
from hfjax.models.config import ModelConfig
from hfjax.parallel.mesh import ResourcePool
from hfjax.workers.actor import ActorRollout
from hfjax.workers.logprobs import compact_logprobs, response_logprobs
from hfjax.workers.spec import ActorSpec

N, G, P, R = 4, 4, 20, 24  # samples per prompt, prompts, prompt and response columns
B = N * G
CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, tie_word_embeddings=True,
                  max_position_embeddings=128)
MESHES = {"1dev": "fsdp=1", "dp4tp2": "data=2,fsdp=2,tensor=2"}


def grouped_batch(seed=0):
    """A host batch of G prompts x N samples (rows g*N .. g*N+N-1 share prompt g): left-padded
    prompts of 1..P tokens, right-padded responses of 1..R tokens, with advantages and
    old/reference log-probs."""
    return padded_rl_batch(seed, B, P, R, CFG.vocab_size, samples=N)


@pytest.fixture(scope="module")
def model():
    return transformer.build(CFG, "causal_lm", seed=3)


def _twin(model):
    return nnx.merge(*nnx.split(jax.tree.map(lambda x: x.copy(), model)))


def _pool(spec):
    n = 1 if spec == "fsdp=1" else 8
    return ResourcePool(f"devices0-{n}", tuple(jax.devices()[:n]))


def _actor(mesh, model, *, share, micro=B, mode="token-mean", grouped=False, shuffle=False):
    c = ppo_arith.get_config()
    a = c.actor
    a.loss_agg_mode, a.use_kl_loss, a.entropy_coeff = mode, True, 0.01
    a.ppo_mini_batch_size, a.ppo_micro_batch_size = G, micro
    a.group_by_length, a.share_prompt, a.shuffle = grouped, share, shuffle
    c.rollout.n, c.rollout.response_length = N, R
    return ActorRollout("actor", _pool(mesh), mesh, model, rules="train", sampler=None,
                        spec=ActorSpec.of(a), rollout=RolloutSpec.of(c.rollout),
                        optimizer=update.make_optimizer(1e-2, grad_clip=0.0))


@pytest.mark.parametrize("block", [8, 128], ids=["blocks", "one_block"])
def test_log_probs_and_gradients_equal_the_padded_rows(model, block, monkeypatch):
    """The model on shared rows: each response token's log-prob and entropy, and the gradient
    of their sum, equal the padded rows' (causal query blocks of 8 cut the prompt and every
    response into several)."""
    monkeypatch.setattr(attention, "CAUSAL_BLOCK", block)
    batch = grouped_batch(1)
    ids, mask = jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"])
    m = batch["response_mask"] > 0
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, static_argnums=1)
    def scores(state, samples):
        return response_logprobs(nnx.merge(graphdef, state), ids, mask, R, 0.7, samples)

    for got, want in zip(scores(state, N), scores(state, 1)):
        np.testing.assert_allclose(np.asarray(got)[m], np.asarray(want)[m], rtol=1e-5,
                                   atol=1e-5)
    grad = jax.jit(jax.grad(lambda st, s: jnp.sum(jnp.where(m, scores(st, s)[0], 0))),
                   static_argnums=1)
    grads = [grad(state, s) for s in (N, 1)]
    scale = max(float(np.abs(x).max()) for x in jax.tree.leaves(grads[1]))
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5 * scale)


def _compact(batch, micro=B, dp=1):
    """The length-grouped cuts of `batch` in micro-batches of `micro` rows, compact where
    their groups split over `dp` devices, as micro-batch dicts of device arrays."""
    arrays = {k: jnp.asarray(batch[k]) for k in ("input_ids", "attention_mask", "responses")}
    ext = grouping.extents(arrays["attention_mask"], R)
    cuts = grouping.plan(ext, micro, P, R, dp, group=N)
    return cuts, [grouping.cut(arrays, c, R) for c in cuts]


@pytest.mark.parametrize("block", [8, 128], ids=["blocks", "one_block"])
def test_compact_rows_equal_the_padded_rows(model, block, monkeypatch):
    """Compact rows (each response only as long as it is, laid end to end after the prompt):
    each response token's log-prob and entropy, and the gradient of their sum, equal the
    padded rows'. Query blocks of 8 read the prompt and a band before them."""
    monkeypatch.setattr(attention, "CAUSAL_BLOCK", block)
    monkeypatch.setattr(shared_prompt, "COMPACT_MAX_FRACTION", 1.0)
    batch = grouped_batch(7)
    ids, mask = jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"])
    m = batch["response_mask"] > 0
    (cut,), (mb,) = _compact(batch)
    assert cut.compact is not None and np.array_equal(cut.rows, np.arange(B))
    graphdef, state = nnx.split(model)

    @jax.jit
    def compact(state):
        return compact_logprobs(nnx.merge(graphdef, state), mb, 0.7, N)

    @jax.jit
    def padded(state):
        return response_logprobs(nnx.merge(graphdef, state), ids, mask, R, 0.7)

    for got, want in zip(compact(state), padded(state)):
        np.testing.assert_allclose(np.asarray(got)[m], np.asarray(want)[m], rtol=1e-5,
                                   atol=1e-5)
        assert not np.asarray(got)[~m].any()
    grads = [jax.jit(jax.grad(lambda st, f=f: jnp.sum(jnp.where(m, f(st)[0], 0))))(state)
             for f in (compact, padded)]
    scale = max(float(np.abs(x).max()) for x in jax.tree.leaves(grads[1]))
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5 * scale)


def test_compact_rows_hold_each_token_once(monkeypatch):
    """A compact row: the prompt once, then each response's real tokens back to back; as
    wide as the group's tokens rounded up to a bucket; cuts ordered by their tokens."""
    monkeypatch.setattr(shared_prompt, "COMPACT_MAX_FRACTION", 1.0)
    batch = grouped_batch(8)
    cuts, mbs = _compact(batch, micro=2 * N)
    sizes = [int(batch["attention_mask"][c.rows, P:].sum()) for c in cuts]
    assert sizes == sorted(sizes, reverse=True)
    for mb in mbs:
        ids, mask = np.asarray(mb["input_ids"]), np.asarray(mb["attention_mask"])
        p = ids.shape[1] - R  # the cut's prompt block
        src = np.asarray(mb["compact_src"]).reshape(2, -1)
        blocks = np.asarray(mb["compact_blocks"]).reshape(2, -1)
        pos = np.asarray(mb["compact_positions"]).reshape(2, -1)
        width = src.shape[1] - p
        for gi in range(2):
            rows = slice(gi * N, (gi + 1) * N)
            real = mask[rows] > 0
            tokens = int(real[:, p:].sum())
            assert tokens <= width <= max(16, 2 * tokens) + N
            row_ids = ids[rows].reshape(-1)[src[gi]]
            np.testing.assert_array_equal(row_ids[blocks[gi] == 0], ids[gi * N, :p][real[0, :p]])
            for i in range(N):
                mine = blocks[gi] == i + 1
                np.testing.assert_array_equal(row_ids[mine], ids[gi * N + i, p:][real[i, p:]])
                want = (np.cumsum(real[i]) - 1)[p:][real[i, p:]]
                np.testing.assert_array_equal(pos[gi][mine], want)
            assert (blocks[gi][p + tokens :] == -1).all()


def test_compact_rows_where_they_pay():
    """Cuts whose groups' responses are mostly short get compact rows; one whose groups run
    long keeps shared rows with blocks of its longest response; both take whole groups."""
    batch = grouped_batch(9)
    am = batch["attention_mask"].copy()
    am[:N, P + 2 :] = 0  # group 0: responses of at most 2 tokens
    am[N : 2 * N, P:] = 1  # group 1: every response R tokens long
    ext = grouping.extents(jnp.asarray(am), R)
    cuts = {int(c.rows[0]) // N: c for c in grouping.plan(ext, N, P, R, group=N)}
    assert cuts[0].compact is not None and cuts[0].response == R
    assert cuts[1].compact is None and cuts[1].response == R
    assert all(len(c.rows) == N and c.rows[0] % N == 0 for c in cuts.values())


def test_shared_rows_hold_each_prompt_once():
    batch = grouped_batch(2)
    ids, mask, pos, layout = shared_prompt.group_rows(
        jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"]), R, N)
    assert ids.shape == (G, P + N * R) and layout == (P, N)
    ids, mask, pos = map(np.asarray, (ids, mask, pos))
    for g in range(G):
        np.testing.assert_array_equal(ids[g, :P], batch["input_ids"][g * N, :P])
        for j in range(N):
            row = g * N + j
            cols = slice(P + j * R, P + (j + 1) * R)
            np.testing.assert_array_equal(ids[g, cols], batch["responses"][row])
            np.testing.assert_array_equal(mask[g, cols], batch["response_mask"][row])
            # A response's positions continue its prompt's, as in its padded row.
            real = batch["response_mask"][row] > 0
            padded_pos = np.cumsum(batch["attention_mask"][row]) - 1
            np.testing.assert_array_equal(pos[g, cols][real], padded_pos[P:][real])


@pytest.mark.parametrize("mesh", list(MESHES), ids=list(MESHES))
@pytest.mark.parametrize("micro", [B, 8], ids=["one_pass", "two_micro"])
def test_worker_log_probs_equal_the_padded_ones(model, mesh, micro):
    """compute_log_prob, whole batch or micro-batches of 2 groups. On the 4-way data-parallel
    mesh 2 groups don't split over the devices: those micro-batches fall back to padded rows."""
    spec = MESHES[mesh]
    batch = grouped_batch(3)
    shared = _actor(spec, model, share=True, micro=micro)
    padded = _actor(spec, model, share=False, micro=micro)
    assert (shared.samples, padded.samples) == (N, 1)
    assert shared._sharing(micro) == (1 if (mesh, micro) == ("dp4tp2", 8) else N)
    got, want = shared.compute_log_prob(batch), padded.compute_log_prob(batch)
    m = batch["response_mask"] > 0
    for key in ("old_log_probs", "entropys"):
        np.testing.assert_allclose(np.asarray(got[key])[m], np.asarray(want[key])[m],
                                   rtol=1e-5, atol=1e-5, err_msg=key)


def _assert_same_step(metrics, groups, keys, atol):
    for k in keys:
        np.testing.assert_allclose(float(metrics[1][k]), float(metrics[0][k]), rtol=1e-4,
                                   err_msg=k)
    for a, b in zip(jax.tree.leaves(groups[1].params), jax.tree.leaves(groups[0].params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol)


MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


# Every aggregation mode on strided micro-batches; length-grouped cuts with one.
UPDATE_CASES = [(mode, False) for mode in MODES] + [("seq-mean-token-mean", "compact"),
                                                   ("token-mean", "shared")]

# Length-grouped cuts as compact rows, or as shared rows cut to their longest response.
GROUPED = {"compact": 1.0, "shared": 0.0}


@pytest.mark.parametrize("mode, grouped", UPDATE_CASES)
def test_updates_equal_the_padded_ones(model, mode, grouped, monkeypatch):
    """One optimizer step through update_actor on micro-batches of 2 groups, shared rows
    against padded ones in the same micro-batches: the same metrics and parameters, in every
    aggregation mode, strided or length-grouped."""
    if grouped:
        monkeypatch.setattr(shared_prompt, "COMPACT_MAX_FRACTION", GROUPED[grouped])
    batch = grouped_batch(4)
    actors = [_actor("fsdp=1", _twin(model), share=s, micro=8, mode=mode,
                     grouped=bool(grouped) and s)
              for s in (False, True)]
    # Padded rows take whole-group micro-batches (the same ones on the strided split), so
    # every metric compares; grouped, the shared side's compact rows.
    actors[0].samples = N
    assert actors[0]._sharing(8) == N
    actors[0]._sharing = lambda rows: 1
    metrics = [a.update_actor(batch) for a in actors]
    keys = ["actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"]
    if not grouped:  # means over a micro-batch's tokens: they depend on the cuts
        keys += ["actor/pg_clipfrac", "actor/ppo_kl"]
    # Adam's step is about lr = 1e-2 whatever a gradient's size: rounding in a near-zero
    # gradient moves its parameter by up to ~1e-4.
    _assert_same_step(metrics, actors, keys, atol=1e-4)


@pytest.mark.parametrize("grouped", [False, "compact", "shared"])
def test_update_on_a_multi_device_mesh(model, grouped, monkeypatch):
    """data=2,fsdp=2,tensor=2, micro-batches of 4 groups (one per data-parallel device), two
    mini-batches shuffled by group: the same step as padded rows in the same order."""
    if grouped:
        monkeypatch.setattr(shared_prompt, "COMPACT_MAX_FRACTION", GROUPED[grouped])
    spec = MESHES["dp4tp2"]
    batch = grouped_batch(5)
    actors = []
    for share in (False, True):
        a = _actor(spec, _twin(model), share=share, micro=B, grouped=bool(grouped) and share,
                   shuffle=True)
        actors.append(a)
    actors[0].samples = N  # the same groups, shuffled alike, on padded rows
    actors[0]._sharing = lambda rows: 1
    metrics = [a.update_actor(batch) for a in actors]
    _assert_same_step(metrics, actors, ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"),
                      atol=1e-4)


def test_micro_batches_and_shuffles_keep_groups_whole():
    x = jnp.arange(24)
    mb = update.strided_micro_batches(x, 2, group=3)
    np.testing.assert_array_equal(mb, [[0, 1, 2, 6, 7, 8, 12, 13, 14, 18, 19, 20],
                                       [3, 4, 5, 9, 10, 11, 15, 16, 17, 21, 22, 23]])
    np.testing.assert_array_equal(update._unstride(mb, 3), x)
    np.testing.assert_array_equal(update.strided_micro_batches(x, 4), x.reshape(6, 4).T)
    rows = np.concatenate(list(update.mini_batch_rows(24, 12, 1, True, seed=0, group=4)))
    assert sorted(rows.tolist()) == list(range(24)) and rows.tolist() != list(range(24))
    for g in rows.reshape(-1, 4):
        assert g[0] % 4 == 0 and (np.diff(g) == 1).all()
    # Group 1 shuffles rows as before.
    old = np.random.default_rng(0).permutation(24)
    np.testing.assert_array_equal(next(update.mini_batch_rows(24, 24, 1, True, 0)), old)


def test_when_rows_are_shared():
    def rows(n, micro=8, share=True, packed=False):
        return shared_prompt.samples_per_row(n, micro, share=share, packed=packed)

    assert rows(4) == 4
    assert rows(1) == 1
    assert rows(3) == 1  # micro-batches of 8 split groups of 3
    assert rows(4, packed=True) == 1  # packed rows have their own layout
    assert rows(4, share=False) == 1
    # The actor's spec asks the same question of its section.
    a = ppo_arith.get_config().actor
    a.share_prompt, a.ppo_micro_batch_size = True, 8
    assert ActorSpec.of(a).samples_per_row(4) == 4
    a.use_remove_padding = True
    assert ActorSpec.of(a).samples_per_row(4) == 1
    assert shared_prompt.fits(8, 4, dp=2) and not shared_prompt.fits(8, 4, dp=4)
    assert not shared_prompt.fits(6, 4)


@pytest.mark.parametrize("grouped", [False, True], ids=["strided", "grouped"])
def test_a_batch_of_no_whole_number_of_groups_is_scored_as_padded_rows(model, grouped):
    """Rows that padding for the data-parallel split leaves in no whole number of groups (14
    rows in groups of 4): the scoring passes fall back to padded rows, with the same
    log-probs, rather than sharing a prompt between rows of different prompts."""
    batch = grouped_batch(6).take(np.arange(B - 2))
    shared = _actor("fsdp=1", model, share=True, micro=8, grouped=grouped)
    padded = _actor("fsdp=1", model, share=False, micro=8, grouped=grouped)
    got, want = shared.compute_log_prob(batch), padded.compute_log_prob(batch)
    m = batch["response_mask"] > 0
    np.testing.assert_allclose(np.asarray(got["old_log_probs"])[m],
                               np.asarray(want["old_log_probs"])[m], rtol=1e-5, atol=1e-5)
