"""The attention entry point (hfjax.models.attention): every implementation that runs on CPU
gives the batched-matmul path's logits and gradients, on left-padded prompts followed by
right-padded responses, with grouped kv heads, with and without a KV cache; the blockwise
kernel against a loop in NumPy; the choice by platform."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hfjax.models import attention, blockwise, transformer
from hfjax.models.config import ModelConfig

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8)  # 2 query heads per kv head
B, T = 3, 24
# Rows: [left padding, prompt, response, right padding]; the last row is all real.
FIRST, END = np.array([0, 5, 9]), np.array([24, 19, 22])


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    # Several query blocks of the dense path and several query and key blocks of the
    # blockwise one (with causal skipping) on rows of 24 columns.
    monkeypatch.setattr(attention, "CAUSAL_BLOCK", 8)
    monkeypatch.setattr(blockwise, "Q_BLOCK", 8)
    monkeypatch.setattr(blockwise, "K_BLOCK", 16)  # a key block padded past the row


def batch():
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, CFG.vocab_size, (B, T)), jnp.int32)
    col = np.arange(T)[None, :]
    mask = jnp.asarray((col >= FIRST[:, None]) & (col < END[:, None]), jnp.int32)
    return ids, mask


def model_with(impl: str, dtype: str):
    cfg = dataclasses.replace(CFG, attention_impl=impl, dtype=dtype)
    return transformer.build(cfg, seed=1)


def logits_and_grads(impl: str, dtype: str):
    ids, mask = batch()
    graphdef, state = nnx.split(model_with(impl, dtype))

    def loss(state):
        logits = nnx.merge(graphdef, state)(ids, mask)
        lp = jax.nn.log_softmax(logits)[..., :7]  # a few vocab entries keep the sum varied
        return jnp.sum(jnp.where(mask[..., None] > 0, lp * jnp.arange(7.0), 0.0)), logits

    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
    return np.asarray(logits)[np.asarray(mask) > 0], jax.tree.leaves(grads)


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
@pytest.mark.parametrize("impl", ["xla", "blockwise"])
def test_training_pass_equals_the_dense_path(impl, dtype, tol):
    want_logits, want_grads = logits_and_grads("dense", dtype)
    got_logits, got_grads = logits_and_grads(impl, dtype)
    np.testing.assert_allclose(got_logits, want_logits, rtol=tol, atol=tol)
    for g, w in zip(got_grads, want_grads):
        scale = float(np.max(np.abs(np.asarray(w, np.float32)))) or 1.0
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   atol=tol * scale)


@pytest.mark.parametrize("impl", ["xla", "blockwise"])
def test_bfloat16_operands_equal_the_dense_path(impl):
    """q, k, v in bfloat16 (the attention's dtype on GPUs and TPUs), through the entry point."""
    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, n, 8)), jnp.bfloat16) for n in (4, 2, 2))
    valid = batch()[1] > 0
    want = attention.attention_fn(CFG, valid, T, jnp.bfloat16)(q, k, v)
    cfg = dataclasses.replace(CFG, attention_impl=impl)
    got = attention.attention_fn(cfg, valid, T, jnp.bfloat16)(q, k, v)
    real = np.asarray(valid)
    np.testing.assert_allclose(np.asarray(got, np.float32)[real],
                               np.asarray(want, np.float32)[real], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("impl", ["xla", "blockwise"])
def test_prefill_and_continuation_through_a_cache(impl):
    """The prompt's 16 columns prefilled into a 24-slot cache (the cache's columns past them
    unwritten), then the last 8 columns fed at cache_index 16: the xla implementation takes
    neither (the keys are not the queries' own columns) and runs blockwise."""
    ids, mask = batch()
    pos = transformer.positions_from_mask(mask)

    def run(impl):
        model = model_with(impl, "float32")
        cache = transformer.KVCache.zeros(model.config, B, T)
        first, cache = model(ids[:, :16], mask, positions=pos[:, :16], cache=cache,
                             cache_index=0)
        rest, _ = model(ids[:, 16:], mask, positions=pos[:, 16:], cache=cache, cache_index=16)
        return np.concatenate([first, rest], axis=1)[np.asarray(mask) > 0]

    np.testing.assert_allclose(run(impl), run("dense"), rtol=1e-5, atol=1e-5)
    # The same logits as the pass without a cache.
    whole = np.asarray(model_with("dense", "float32")(ids, mask))[np.asarray(mask) > 0]
    np.testing.assert_allclose(run(impl), whole, rtol=1e-5, atol=1e-5)


def test_prefill_of_the_prompt_alone_uses_the_fused_formulation():
    """A prefill whose cache is as wide as the prompt is self-attention: the xla formulation
    (rolled rows, causal, sequence lengths) gives the dense path's logits."""
    ids, mask = batch()
    mask = mask.at[:, 20:].set(0)  # prompts end at column 20; left padding kept
    pos = transformer.positions_from_mask(mask)

    def run(impl):
        model = model_with(impl, "float32")
        cache = transformer.KVCache.zeros(model.config, B, T)
        logits, _ = model(ids, mask, positions=pos, cache=cache, cache_index=0)
        return np.asarray(logits)[np.asarray(mask) > 0]

    np.testing.assert_allclose(run("xla"), run("dense"), rtol=1e-5, atol=1e-5)


def numpy_attention(q, k, v, allowed):
    """Loop reference: q [B, T, N, H], k, v [B, S, K, H], allowed [B, T, S]."""
    b_, t_, n_, h_ = q.shape
    group = n_ // k.shape[2]
    out = np.zeros(q.shape, np.float64)
    for b in range(b_):
        for t in range(t_):
            cols = np.flatnonzero(allowed[b, t])
            if not len(cols):
                continue
            for n in range(n_):
                s = np.array([q[b, t, n] @ k[b, c, n // group] for c in cols]) / np.sqrt(h_)
                p = np.exp(s - s.max())
                p /= p.sum()
                out[b, t, n] = sum(w * v[b, c, n // group] for w, c in zip(p, cols))
    return out


def test_blockwise_kernel_equals_a_loop():
    """Keys past the queries (a cache offset of 5), packed segments and key padding, blocks
    that do not divide the row."""
    rng = np.random.default_rng(3)
    t_, s_ = 13, 18
    q = rng.normal(size=(2, t_, 4, 8)).astype(np.float32)
    k, v = (rng.normal(size=(2, s_, 2, 8)).astype(np.float32) for _ in range(2))
    valid = rng.random((2, s_)) > 0.2
    seg = rng.integers(1, 3, (2, s_))
    offset = 5
    got = blockwise.blockwise_attention(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(valid), causal=True,
        q_offset=offset, q_segments=jnp.asarray(seg[:, offset:offset + t_]),
        k_segments=jnp.asarray(seg), q_block=4, k_block=5)
    tq, ts = np.arange(t_)[:, None] + offset, np.arange(s_)[None, :]
    allowed = ((ts <= tq)[None] & valid[:, None, :]
               & (seg[:, offset:offset + t_, None] == seg[:, None, :]))
    want = numpy_attention(q, k, v, allowed)
    seen = allowed.any(-1)
    np.testing.assert_allclose(np.asarray(got)[seen], want[seen], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got)[~seen], 0.0)  # sees nothing: zeros


def test_unknown_implementation_is_refused():
    # The choice per platform is hfjax.models.backend's (tests/models/test_backend.py).
    with pytest.raises(ValueError, match="unknown attention_impl 'flash'"):
        dataclasses.replace(CFG, attention_impl="flash")


@pytest.mark.slow  # the interpreter: about 25 s on 2 cores
def test_splash_kernel_in_interpret_mode_equals_the_dense_path():
    """The TPU splash kernel, run by Pallas's interpreter on CPU: forward and gradients of a
    row of 128 columns (the kernel's block) with left and right padding, two query heads on
    one KV head (the interpreter's time grows with rows x heads)."""
    rng = np.random.default_rng(4)
    t_ = attention.SPLASH_BLOCK
    q, k, v = (jnp.asarray(rng.normal(size=(1, t_, n, 16)), jnp.float32) for n in (2, 1, 1))
    col = np.arange(t_)[None, :]
    valid = jnp.asarray((col >= 30) & (col < 100))
    cfg = dataclasses.replace(CFG, head_dim=16, num_heads=2, num_kv_heads=1)
    dense = attention.attention_fn(cfg, valid, t_, jnp.float32)
    w = jnp.asarray(rng.normal(size=q.shape), jnp.float32) * valid[:, :, None, None]

    def splash(q, k, v):
        return attention.splash_attention(q, k, v, key_valid=valid, interpret=True)

    got, want = jax.jit(splash)(q, k, v), dense(q, k, v)
    real = np.asarray(valid)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=1e-5)
    grads = [jax.jit(jax.grad(lambda *a, f=f: jnp.sum(f(*a) * w), (0, 1, 2)))(q, k, v)
             for f in (splash, dense)]
    for g, h in zip(*grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(h), atol=1e-4, rtol=1e-4)


def test_shared_prompt_rows_blockwise_equal_dense():
    """Rows of one left-padded prompt (6 columns) and 3 right-padded responses (5 columns
    each): the blockwise parts give the dense parts' outputs at every real query."""
    from hfjax.models.attention import SharedPrompt, shared_prompt_attention

    rng = np.random.default_rng(5)
    p_, n_, r_ = 6, 3, 5
    t_ = p_ + n_ * r_
    mask = np.ones((2, t_), np.int32)
    mask[0, :2] = 0  # left padding of the first prompt
    for j, length in enumerate((5, 2, 4)):
        mask[1, p_ + j * r_ + length:p_ + (j + 1) * r_] = 0  # right padding of responses
    q, k, v = (jnp.asarray(rng.normal(size=(2, t_, n, 8)), jnp.float32) for n in (4, 2, 2))
    layout = SharedPrompt(p_, n_)
    want = shared_prompt_attention(CFG, jnp.asarray(mask), layout)(q, k, v)
    got = shared_prompt_attention(CFG, jnp.asarray(mask), layout, blockwise=True)(q, k, v)
    real = mask > 0
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=1e-5)
