"""Blockwise (flash-style) attention in plain JAX: memory linear in the sequence, on any backend.

Queries go in blocks of `q_block` rows and, for each, keys in blocks of `k_block` columns; a
running softmax (the scores' maximum, the sum of exponentials and the weighted values, all
float32) is carried across the key blocks, so no [T, S] array of scores is ever formed: the
largest temporary is one [B, K, G, q_block, k_block] block of scores. Under `causal`, a query
block stops at the last key block any of its queries sees (a dynamic trip count, since the
queries' offset into the keys may be traced).

The backward pass is written out (`jax.custom_vjp`): it recomputes each block's scores from
q, k and the forward's log-sum-exp instead of storing them, accumulating dq per query block
and dk, dv over the query blocks, the same two loops as the forward.

The mask is that of `hfjax.models.attention`'s dense path, built per block from its factors:
key `s` is seen by query `t` where `key_valid[b, s]`, and with `causal` where
s <= t + `q_offset`, and with segment ids where they are equal. A query that sees no key
returns zeros (nothing reads it: it is padding).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

Q_BLOCK = 512
K_BLOCK = 512


def _pad_to(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, extra)
    return jnp.pad(x, pad, constant_values=value)


def blockwise_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    key_valid: jax.Array,
    *,
    causal: bool,
    q_offset: jax.Array | int = 0,
    q_segments: jax.Array | None = None,
    k_segments: jax.Array | None = None,
    q_block: int | None = None,
    k_block: int | None = None,
) -> jax.Array:
    """Attention of q [B, T, N, H] over k, v [B, S, K, H] (N a multiple of K: query head
    k * G + g reads kv head k) where `key_valid` [B, S] and the causal / segment conditions
    allow; scores and softmax in float32, 1/sqrt(H) scaling. Blocks of `q_block` queries and
    `k_block` keys (default Q_BLOCK, K_BLOCK). Returns [B, T, N, H] in q's dtype.
    """
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    bq, bk = min(q_block or Q_BLOCK, T), min(k_block or K_BLOCK, S)
    tp, sp = -(-T // bq) * bq, -(-S // bk) * bk
    segmented = q_segments is not None
    if segmented != (k_segments is not None):
        raise ValueError("blockwise_attention: give both q_segments and k_segments, or neither")
    qs = q_segments if segmented else jnp.zeros((B, T), jnp.int32)
    ks = k_segments if segmented else jnp.zeros((B, S), jnp.int32)
    # [B, K, G, T, H] and [B, K, S, H]: each kv head's G query heads are stacked rows.
    qh = jnp.transpose(q.reshape(B, T, K, G, H), (0, 2, 3, 1, 4))
    kh, vh = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    qh, qs = _pad_to(qh, 3, tp), _pad_to(qs, 1, tp)
    kh, vh = _pad_to(kh, 2, sp), _pad_to(vh, 2, sp)
    valid, ks = _pad_to(key_valid.astype(bool), 1, sp, False), _pad_to(ks, 1, sp)
    offset = jnp.asarray(q_offset, jnp.int32)
    out = _flash(qh, kh, vh, valid, qs, ks, offset, causal, bq, bk)
    out = out[:, :, :, :T]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(B, T, N, H)


def _key_blocks(causal: bool, i, offset, bq: int, bk: int, nk: int):
    """How many key blocks query block i reads."""
    if not causal:
        return nk
    last = (i + 1) * bq - 1 + offset  # the last key column its last query may see
    return jnp.clip(last // bk + 1, 0, nk)


def _key_block(kh, vh, valid, qs, ks, offset, causal, i, j, bq, bk):
    """Key block j's keys and values and the mask of query block i over it."""
    kb = jax.lax.dynamic_slice_in_dim(kh, j * bk, bk, axis=2)
    vb = jax.lax.dynamic_slice_in_dim(vh, j * bk, bk, axis=2)
    return kb, vb, _block_mask(valid, qs, ks, offset, causal, i, j, bq, bk)


def _block_mask(valid, qs, ks, offset, causal, i, j, bq, bk):
    """[B, 1, 1, bq, bk] mask of query block i against key block j."""
    kv = jax.lax.dynamic_slice_in_dim(valid, j * bk, bk, axis=1)
    m = kv[:, None, :]
    qseg = jax.lax.dynamic_slice_in_dim(qs, i * bq, bq, axis=1)
    kseg = jax.lax.dynamic_slice_in_dim(ks, j * bk, bk, axis=1)
    m = m & (qseg[:, :, None] == kseg[:, None, :])
    if causal:
        t = i * bq + jnp.arange(bq) + offset
        s = j * bk + jnp.arange(bk)
        m = m & (s[None, :] <= t[:, None])[None]
    return m[:, None, None]


def _scores(qb, kb, scale):
    return jnp.einsum("bkgqh,bksh->bkgqs", qb, kb, preferred_element_type=jnp.float32) * scale


def _forward(qh, kh, vh, valid, qs, ks, offset, causal, bq, bk):
    B, K, G, tp, H = qh.shape
    nq, nk = tp // bq, kh.shape[2] // bk
    scale = 1.0 / math.sqrt(H)
    f32 = jnp.float32
    neg = jnp.finfo(f32).min

    def q_step(i, carry):
        out, lse = carry
        qb = jax.lax.dynamic_slice_in_dim(qh, i * bq, bq, axis=3)

        def k_step(j, acc):
            top, total, o = acc
            kb, vb, m = _key_block(kh, vh, valid, qs, ks, offset, causal, i, j, bq, bk)
            s = jnp.where(m, _scores(qb, kb, scale), neg)
            new_top = jnp.maximum(top, jnp.max(s, axis=-1))
            p = jnp.where(m, jnp.exp(s - new_top[..., None]), 0.0)
            rescale = jnp.exp(top - new_top)
            pv = jnp.einsum("bkgqs,bksh->bkgqh", p.astype(qh.dtype), vb,
                            preferred_element_type=f32)
            return new_top, total * rescale + jnp.sum(p, axis=-1), o * rescale[..., None] + pv

        init = (jnp.full((B, K, G, bq), neg, f32), jnp.zeros((B, K, G, bq), f32),
                jnp.zeros((B, K, G, bq, H), f32))
        top, total, o = jax.lax.fori_loop(
            0, _key_blocks(causal, i, offset, bq, bk, nk), k_step, init)
        seen = total > 0
        o = o / jnp.where(seen, total, 1.0)[..., None]
        block_lse = jnp.where(seen, top + jnp.log(jnp.where(seen, total, 1.0)), 0.0)
        out = jax.lax.dynamic_update_slice_in_dim(out, o.astype(out.dtype), i * bq, axis=3)
        lse = jax.lax.dynamic_update_slice_in_dim(lse, block_lse, i * bq, axis=3)
        return out, lse

    init = (jnp.zeros(qh.shape, qh.dtype), jnp.zeros((B, K, G, tp), f32))
    return jax.lax.fori_loop(0, nq, q_step, init)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _flash(qh, kh, vh, valid, qs, ks, offset, causal, bq, bk):
    return _forward(qh, kh, vh, valid, qs, ks, offset, causal, bq, bk)[0]


def _flash_fwd(qh, kh, vh, valid, qs, ks, offset, causal, bq, bk):
    out, lse = _forward(qh, kh, vh, valid, qs, ks, offset, causal, bq, bk)
    return out, (qh, kh, vh, valid, qs, ks, offset, out, lse)


def _flash_bwd(causal, bq, bk, res, g):
    qh, kh, vh, valid, qs, ks, offset, out, lse = res
    B, K, G, tp, H = qh.shape
    nq, nk = tp // bq, kh.shape[2] // bk
    scale = 1.0 / math.sqrt(H)
    f32 = jnp.float32
    # D_t = sum_h dO_t * O_t: the softmax backward's per-query correction.
    delta = jnp.sum(g.astype(f32) * out.astype(f32), axis=-1)

    def q_step(i, carry):
        dq, dk, dv = carry
        qb = jax.lax.dynamic_slice_in_dim(qh, i * bq, bq, axis=3)
        gb = jax.lax.dynamic_slice_in_dim(g, i * bq, bq, axis=3).astype(qh.dtype)
        lb = jax.lax.dynamic_slice_in_dim(lse, i * bq, bq, axis=3)
        db = jax.lax.dynamic_slice_in_dim(delta, i * bq, bq, axis=3)

        def k_step(j, acc):
            dqb, dk, dv = acc
            kb, vb, m = _key_block(kh, vh, valid, qs, ks, offset, causal, i, j, bq, bk)
            p = jnp.where(m, jnp.exp(_scores(qb, kb, scale) - lb[..., None]), 0.0)
            dp = jnp.einsum("bkgqh,bksh->bkgqs", gb, vb, preferred_element_type=f32)
            ds = (p * (dp - db[..., None]) * scale).astype(qh.dtype)
            dqb = dqb + jnp.einsum("bkgqs,bksh->bkgqh", ds, kb, preferred_element_type=f32)
            dkb = jnp.einsum("bkgqs,bkgqh->bksh", ds, qb, preferred_element_type=f32)
            dvb = jnp.einsum("bkgqs,bkgqh->bksh", p.astype(qh.dtype), gb,
                             preferred_element_type=f32)
            dk = jax.lax.dynamic_update_slice_in_dim(
                dk, jax.lax.dynamic_slice_in_dim(dk, j * bk, bk, axis=2) + dkb, j * bk, axis=2)
            dv = jax.lax.dynamic_update_slice_in_dim(
                dv, jax.lax.dynamic_slice_in_dim(dv, j * bk, bk, axis=2) + dvb, j * bk, axis=2)
            return dqb, dk, dv

        init = (jnp.zeros((B, K, G, bq, H), f32), dk, dv)
        dqb, dk, dv = jax.lax.fori_loop(
            0, _key_blocks(causal, i, offset, bq, bk, nk), k_step, init)
        dq = jax.lax.dynamic_update_slice_in_dim(dq, dqb, i * bq, axis=3)
        return dq, dk, dv

    init = (jnp.zeros(qh.shape, f32), jnp.zeros(kh.shape, f32), jnp.zeros(vh.shape, f32))
    dq, dk, dv = jax.lax.fori_loop(0, nq, q_step, init)
    return (dq.astype(qh.dtype), dk.astype(kh.dtype), dv.astype(vh.dtype),
            None, None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)
