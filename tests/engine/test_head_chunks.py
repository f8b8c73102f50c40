"""The LM head a chunk of positions at a time (hfjax.engine.head_chunks) against the whole rows
at once: the same log-probs, entropies and gradients in float32 (1e-6), for padded, shared and
compact rows, and the same scoring pass and optimizer step through the actor worker on a
data=2,fsdp=2,tensor=2 mesh. The unchunked program itself is checked against HF transformers in
tests/models/test_hf_parity.py."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support import padded_rl_batch

from configs import ppo_arith
from hfjax.engine import grouping, head_chunks, shared_prompt, update
from hfjax.engine.spec import RolloutSpec
from hfjax.models import transformer
from hfjax.models.config import ModelConfig
from hfjax.numerics import core
from hfjax.parallel.mesh import ResourcePool
from hfjax.workers.actor import ActorRollout
from hfjax.workers.logprobs import compact_logprobs, response_logprobs
from hfjax.workers.spec import ActorSpec

N, G, P, R = 2, 4, 12, 23  # samples per prompt, prompts, prompt and response columns
B = N * G
CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True,
                  max_position_embeddings=64)
TOL = 1e-6


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def model(request):
    cfg = dataclasses.replace(CFG, tie_word_embeddings=request.param)
    return transformer.build(cfg, "causal_lm", seed=5)


def _assert_close(got, want, atol=TOL):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=TOL, atol=atol)


def _grad_scale(grads):
    return max(float(np.abs(x).max()) for x in jax.tree.leaves(grads))


def test_over_positions_pads_and_restores_the_rows():
    """Chunks of 5 over 23 positions (the last one padded): every output at its position."""
    x = jnp.arange(2 * 23 * 3, dtype=jnp.float32).reshape(2, 23, 3)
    labels = jnp.arange(2 * 23).reshape(2, 23)
    seen = []

    def head(h, lab):
        seen.append(h.shape)
        return jnp.sum(h, axis=-1) + lab, lab * 2

    a, b = head_chunks.over_positions(head, 5, x, labels)
    np.testing.assert_array_equal(a, np.asarray(x).sum(-1) + np.asarray(labels))
    np.testing.assert_array_equal(b, 2 * np.asarray(labels))
    assert seen[-1] == (2, 5, 3)
    with pytest.raises(ValueError, match="does not start with"):
        head_chunks.over_positions(head, 5, x, labels[:, :4])
    # A budget of 10 positions per device: 2 rows on 1 device take 5 of each row at a time,
    # 1 row per device (2 devices) 10; 0 is whole rows.
    for budget, dp, width in ((10, 1, 5), (10, 2, 10), (0, 1, 23), (1, 1, 1)):
        seen.clear()
        head_chunks.over_tokens(lambda h, lab: head(h, lab), budget, dp, x, labels)
        assert seen[-1] == (2, width, 3), (budget, dp)


@pytest.mark.parametrize("chunk", [8, 40, 64])  # positions of all 8 rows: 1, 5, 8 per row
@pytest.mark.parametrize("samples", [1, N], ids=["padded", "shared"])
def test_chunked_log_probs_and_gradients_equal_whole_rows(model, chunk, samples):
    """Padded and shared-prompt rows: log-probs, entropies and the gradient of a loss that
    reads both, chunked against whole rows, within 1e-6 (gradients: 1e-6 of their largest)."""
    batch = padded_rl_batch(1, B, P, R, CFG.vocab_size, samples=N)
    ids, mask = jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"])
    m = jnp.asarray(batch["response_mask"] > 0)
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, static_argnums=1)
    def scores(state, c):
        return response_logprobs(nnx.merge(graphdef, state), ids, mask, R, 0.7, samples, c)

    _assert_close(scores(state, chunk), scores(state, 0))

    def loss(state, c):
        lp, ent = scores(state, c)
        return jnp.sum(jnp.where(m, lp * 1.3 - 0.1 * ent, 0))

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    want = grad(state, 0)
    _assert_close(grad(state, chunk), want, atol=TOL * _grad_scale(want))


def test_chunked_compact_rows_equal_whole_rows(model, monkeypatch):
    monkeypatch.setattr(shared_prompt, "COMPACT_MAX_FRACTION", 1.0)
    batch = padded_rl_batch(2, B, P, R, CFG.vocab_size, samples=N)
    arrays = {k: jnp.asarray(batch[k]) for k in ("input_ids", "attention_mask", "responses")}
    (cut,) = grouping.plan(grouping.extents(arrays["attention_mask"], R), B, P, R, 1, group=N)
    assert cut.compact is not None
    mb = grouping.cut(arrays, cut, R)
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, static_argnums=1)
    def scores(state, c):
        return compact_logprobs(nnx.merge(graphdef, state), mb, 0.7, N, c)

    _assert_close(scores(state, 16), scores(state, 0))  # 4 positions of each compact row
    grad = jax.jit(jax.grad(lambda st, c: jnp.sum(scores(st, c)[0])), static_argnums=1)
    want = grad(state, 0)
    _assert_close(grad(state, 16), want, atol=TOL * _grad_scale(want))


def _actor(model, chunk, mesh="data=2,fsdp=2,tensor=2"):
    c = ppo_arith.get_config()
    a = c.actor
    a.use_kl_loss, a.entropy_coeff = True, 0.01
    a.ppo_mini_batch_size, a.ppo_micro_batch_size = G, B
    a.logprob_chunk = chunk
    c.rollout.n, c.rollout.response_length = N, R
    pool = ResourcePool("devices0-8", tuple(jax.devices()[:8]))
    return ActorRollout("actor", pool, mesh, model, rules="train", sequence_parallel="ring",
                        sampler=None, spec=ActorSpec.of(a), rollout=RolloutSpec.of(c.rollout),
                        optimizer=update.make_optimizer(1e-2, grad_clip=0.0))


@pytest.mark.parametrize("mesh", ["data=2,fsdp=2,tensor=2", "fsdp=2,sequence=4"])
def test_worker_scores_and_update_equal_whole_rows(model, mesh):
    """`actor.logprob_chunk=6` (positions per data-parallel device) on a data=2,fsdp=2,tensor=2
    mesh and on one whose `sequence` axis splits the rows' tokens: compute_log_prob and one
    update_actor step give what whole rows give (metrics within 1e-6, parameters within
    Adam's rounding of near-zero gradients)."""
    batch = padded_rl_batch(3, B, P, R, CFG.vocab_size, samples=N)
    twins = [nnx.merge(*nnx.split(jax.tree.map(lambda x: x.copy(), model))) for _ in range(2)]
    actors = [_actor(twin, chunk, mesh) for twin, chunk in zip(twins, (0, 6))]
    assert [a.chunk for a in actors] == [0, 6]
    m = batch["response_mask"] > 0
    scored = [a.compute_log_prob(batch) for a in actors]
    for key in ("old_log_probs", "entropys"):
        np.testing.assert_allclose(np.asarray(scored[1][key])[m], np.asarray(scored[0][key])[m],
                                   rtol=TOL, atol=TOL, err_msg=key)
    metrics = [a.update_actor(batch) for a in actors]
    for k in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        np.testing.assert_allclose(float(metrics[1][k]), float(metrics[0][k]), rtol=1e-5,
                                   atol=TOL, err_msg=k)
    for a, b in zip(jax.tree.leaves(actors[1].params), jax.tree.leaves(actors[0].params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_a_negative_chunk_is_refused(model):
    with pytest.raises(ValueError, match="logprob_chunk must be >= 0"):
        _actor(model, -1)


def test_a_32k_row_never_holds_its_whole_logits():
    """A 32,768-position row, vocabulary 4,096: compiled (not run) with the default budget, the
    scoring pass and its gradient allocate less than a quarter of the row's [T, V] float32
    logits (512 MiB) in temporaries; whole rows allocate more than all of them."""
    t, d, v = 32768, 32, 4096
    hidden = jax.ShapeDtypeStruct((1, t, d), jnp.float32)
    labels = jax.ShapeDtypeStruct((1, t), jnp.int32)
    w = jax.ShapeDtypeStruct((d, v), jnp.float32)

    def head(h, lab, w):
        return core.logprobs_and_entropy(h @ w, lab)

    def temp(budget, grad):
        def f(h, w, lab):
            lp, ent = head_chunks.over_tokens(lambda x, y: head(x, y, w), budget, 1, h, lab)
            return jnp.sum(lp) + jnp.sum(ent)
        fn = jax.grad(f, argnums=(0, 1)) if grad else f
        return jax.jit(fn).lower(hidden, w, labels).compile().memory_analysis().temp_size_in_bytes

    row = t * v * 4
    for grad in (False, True):
        assert temp(head_chunks.DEFAULT_CHUNK, grad) < row / 4, grad
        assert temp(0, grad) >= row, grad
