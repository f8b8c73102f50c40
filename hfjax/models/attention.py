"""Attention: one entry point (`attention_fn`) for the model's training, scoring and prefill
passes, and the implementations it chooses between.

The implementation is chosen by `hfjax.models.backend.attention_impl`, from
`ModelConfig.attention_impl` (`model.attention_impl` in a run config) and, for "auto", from the
platform the program is compiled for (`backend.target_platform`: the devices' backend, or the
target a dry run compiles for):

- "dense": the batched-matmul path (`attend`; causal rows by query blocks, `dense_attention`)
  that materialises float32 scores per query block. "auto" on CPU: tuned there.
- "cudnn": `jax.nn.dot_product_attention(implementation="cudnn")`, cuDNN's fused flash
  attention, for bfloat16 / float16 and head dims cuDNN takes (a multiple of 8, at most 256);
  opt-in (`model.attention_impl=cudnn`): on an H200 its programs did not finish compiling
  within 40 s at 16 rows x 2048 columns, so "auto" on GPUs is "blockwise". Padding is
  expressed with linear memory: each row is rolled so that its real tokens start at column 0
  (RoPE is already applied, so rolling q, k and v is exact), then attended with a causal mask
  and per-row sequence lengths, and the output rolled back. That needs each row's real tokens
  to be one contiguous run, which hfjax's rows are (a left-padded prompt followed by a
  right-padded response).
- "xla": the same formulation through `implementation="xla"`: XLA's own lowering (it forms
  the [T, S] mask and scores, so it is no lighter than "dense"), which runs on CPU and is what
  the tests compare the cuDNN formulation against.
- "splash": the TPU Pallas splash attention kernel, with padding as segment ids. "auto" on TPU
  when the kernel imports and the shapes suit it (columns a multiple of 128).
- "blockwise": `hfjax.models.blockwise`, flash-style attention in plain JAX with a written-out
  backward pass; memory linear in the row's width on any backend. "auto" on GPUs (measured
  there: the GRPO update of Qwen2.5-1.5B at 39% MFU, the default job). The fallback wherever the
  fused kernels cannot take a case (float32, odd head dims, a KV cache with an offset), and
  the stand-in for cuDNN / splash when a dry run compiles on CPU for a GPU or TPU target.

The other attention patterns are routed through the same entry point. Shared-prompt rows run
their two parts (the prompt's causal attention, the responses' over prompt and own response)
blockwise wherever the implementation is not "dense"; compact shared-prompt rows and banded
packed rows keep their batched-matmul implementations on every backend for now (their
temporaries are bounded by the longest response and the segment span, not the row's width);
a fused kernel for them would be chosen here too.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hfjax.models import backend
from hfjax.models import sequence_parallel as sp
from hfjax.models.blockwise import blockwise_attention
from hfjax.models.config import ATTENTION_IMPLS, ModelConfig
from hfjax.parallel import sharding as shd

IMPLEMENTATIONS = ATTENTION_IMPLS

def attention_fn(
    cfg: ModelConfig,
    key_valid: jax.Array,
    query_count: int,
    dtype,
    *,
    cache_index: jax.Array | int | None = None,
    segment_ids: jax.Array | None = None,
    segment_span: int | None = None,
    shared_prompt: SharedPrompt | None = None,
    response_blocks: ResponseBlocks | None = None,
    attention_mask: jax.Array | None = None,
):
    """The attention of one forward pass, as fn(q [B, T, N, H], k, v [B, S, K, H]) -> [B, T, N, H].

    `key_valid` [B, S] marks real keys, T = `query_count` and `dtype` is q/k/v's
    (`hfjax.models.backend.storage_dtype`). Without a cache
    (`cache_index` None) the keys are the queries' own columns (S == T) and query t sees keys up
    to t; with one, the T queries sit at cache slots [cache_index, cache_index + T) and see the
    slots up to their own. Packed rows give `segment_ids` [B, T] (a query sees only its own
    segment) and `segment_span` (`banded_attention` where it pays); shared-prompt rows give
    `shared_prompt` (with `attention_mask`) or `response_blocks`.

    Under a layout whose mesh splits rows over `sequence` (no cache: training and scoring),
    q/k/v arrive [B, W, ...] with W >= T a multiple of the sequence size (the row padded at the
    end) and the attention runs across the shards (`hfjax.models.sequence_parallel`): Ulysses
    around this same function, or ring attention over the pattern's mask.
    """
    layout = shd.active_layout()
    if cache_index is None and sp.sequence_size(layout) > 1:
        return _split_attention(cfg, layout, key_valid, query_count, dtype,
                                segment_ids=segment_ids, segment_span=segment_span,
                                shared_prompt=shared_prompt, response_blocks=response_blocks,
                                attention_mask=attention_mask)
    return _attention(cfg, key_valid, query_count, dtype, cache_index=cache_index,
                      segment_ids=segment_ids, segment_span=segment_span,
                      shared_prompt=shared_prompt, response_blocks=response_blocks,
                      attention_mask=attention_mask)


def _split_attention(cfg, layout, key_valid, query_count, dtype, *, segment_ids, segment_span,
                     shared_prompt, response_blocks, attention_mask):
    """`attention_fn` for rows split over `sequence`: the masks go whole to every device, the
    row's own attention (`_attention`, on the per-device heads) runs inside Ulysses, and ring
    attention reads the pattern as column groups (`sequence_parallel.Pattern`)."""
    T = query_count
    masks = {"key_valid": key_valid}
    if segment_ids is not None:
        masks["segment_ids"] = segment_ids
    if attention_mask is not None:
        masks["attention_mask"] = attention_mask
    if response_blocks is not None:
        masks["blocks"] = response_blocks.blocks

    def local(c, key_valid, segment_ids=None, attention_mask=None, blocks=None):
        rb = None if response_blocks is None else response_blocks._replace(blocks=blocks)
        return _attention(c, key_valid, T, dtype, segment_ids=segment_ids,
                          segment_span=segment_span, shared_prompt=shared_prompt,
                          response_blocks=rb, attention_mask=attention_mask)

    pattern = None
    if segment_ids is not None:
        pattern = sp.Pattern(segment_ids)
    elif response_blocks is not None:
        pattern = sp.Pattern(response_blocks.blocks, shared=True)
    elif shared_prompt is not None:
        P, n = shared_prompt
        R = (T - P) // n
        cols = jnp.arange(T)
        groups = jnp.where(cols < P, 0, 1 + (cols - P) // max(R, 1))
        pattern = sp.Pattern(jnp.broadcast_to(groups, key_valid.shape), shared=True)
    return sp.attention(cfg, layout, T, local, masks, pattern)


def _attention(
    cfg: ModelConfig,
    key_valid: jax.Array,
    query_count: int,
    dtype,
    *,
    cache_index: jax.Array | int | None = None,
    segment_ids: jax.Array | None = None,
    segment_span: int | None = None,
    shared_prompt: SharedPrompt | None = None,
    response_blocks: ResponseBlocks | None = None,
    attention_mask: jax.Array | None = None,
):
    """`attention_fn` on rows whole on each device."""
    impl = backend.attention_impl(cfg.attention_impl, dtype, cfg.head_dim)
    if shared_prompt is not None:
        return shared_prompt_attention(cfg, attention_mask, shared_prompt,
                                       blockwise=impl != "dense")
    if response_blocks is not None:
        return compact_attention(cfg, response_blocks)
    T = query_count
    if segment_ids is not None and segment_span and uses_band(T, segment_span):
        return banded_attention(cfg, segment_ids, segment_span)
    self_attention = cache_index is None or (
        isinstance(cache_index, int) and cache_index == 0 and key_valid.shape[1] == T)
    if impl in ("xla", "cudnn", "splash") and (segment_ids is not None or not self_attention):
        backend.log_once(f"attention: {impl} takes self-attention over unpacked rows; packed "
                         "rows and cache offsets use blockwise attention")
        impl = "blockwise"
    if impl == "dense":
        q_slot = jnp.arange(T)[:, None] + (0 if cache_index is None else cache_index)
        causal = jnp.arange(key_valid.shape[1])[None, :] <= q_slot  # [T, S]
        mask = causal[None] & key_valid[:, None, :]  # [B, T, S]
        if segment_ids is not None:
            mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
        return dense_attention(cfg, mask[:, None], causal=cache_index is None)
    if impl == "blockwise":
        offset = 0 if cache_index is None else cache_index
        return functools.partial(_blockwise, key_valid=key_valid, offset=offset,
                                 segment_ids=segment_ids)
    if impl == "splash":
        return functools.partial(splash_attention, key_valid=key_valid)
    return functools.partial(shifted_attention, key_valid=key_valid, implementation=impl)


def _blockwise(q, k, v, *, key_valid, offset, segment_ids):
    return blockwise_attention(q, k, v, key_valid, causal=True, q_offset=offset,
                               q_segments=segment_ids, k_segments=segment_ids)


def shifted_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, key_valid: jax.Array,
                      implementation: str) -> jax.Array:
    """Causal self-attention of rows whose real tokens (`key_valid` [B, T]) are one contiguous
    run, through `jax.nn.dot_product_attention` with linear-memory masking: each row is rolled
    left by its first real column, attended with `is_causal` and its real length as both query
    and key length, and rolled back. Returns [B, T, N, H]; a padding query's output is zeros
    or arbitrary (nothing reads it)."""
    B, T = key_valid.shape
    valid = key_valid.astype(bool)
    first = jnp.argmax(valid, axis=1).astype(jnp.int32)  # 0 for a row with no real token
    length = jnp.sum(valid, axis=1, dtype=jnp.int32)
    cols = jnp.arange(T, dtype=jnp.int32)[None, :]

    def roll(x, shift):  # x [B, T, heads, H], column c <- column (c + shift) mod T
        idx = (cols + shift[:, None]) % T
        return jnp.take_along_axis(x, idx[:, :, None, None], axis=1)

    out = jax.nn.dot_product_attention(
        roll(q, first), roll(k, first), roll(v, first), is_causal=True,
        query_seq_lengths=length, key_value_seq_lengths=length, implementation=implementation)
    return roll(out, -first)


SPLASH_BLOCK = 128


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                     key_valid: jax.Array, interpret: bool = False) -> jax.Array:
    """Causal self-attention through the TPU Pallas splash attention kernel: real tokens are
    segment 1 and padding segment 0, so a real query sees the real keys up to itself (whatever
    the row's padding) and a padding query only padding (its output is not read). Grouped kv
    heads go through the kernel's multi-query form, one kv head at a time. Falls back to
    blockwise attention (one log line) when the row's width is not a multiple of
    SPLASH_BLOCK. `interpret` runs the kernel in Pallas's interpret mode (tests, on CPU)."""
    B, T, N, H = q.shape
    K = k.shape[2]
    G = N // K
    if T % SPLASH_BLOCK:
        backend.log_once(f"attention: splash attention takes rows of a multiple of {SPLASH_BLOCK} "
                         f"columns, not {T}; using blockwise attention")
        return _blockwise(q, k, v, key_valid=key_valid, offset=0, segment_ids=None)
    kernel_lib, mask_lib = backend.splash_module()
    mask = mask_lib.MultiHeadMask([mask_lib.CausalMask((T, T)) for _ in range(G)])
    kernel = kernel_lib.make_splash_mqa(mask, head_shards=1, q_seq_shards=1,
                                        interpret=interpret)
    seg = key_valid.astype(jnp.int32)
    qh = jnp.transpose(q.reshape(B, T, K, G, H), (0, 2, 3, 1, 4)) / math.sqrt(H)
    kh, vh = jnp.transpose(k, (0, 2, 1, 3)), jnp.transpose(v, (0, 2, 1, 3))  # [B, K, T, H]

    def one_row(qr, kr, vr, sr):  # [K, G, T, H], [K, T, H] x 2, [T]
        ids = kernel_lib.SegmentIds(q=sr, kv=sr)
        return jax.vmap(lambda a, b, c: kernel(a, b, c, segment_ids=ids))(qr, kr, vr)

    out = jax.vmap(one_row)(qh.astype(q.dtype), kh, vh, seg)  # [B, K, G, T, H]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(B, T, N, H)


def attend(q: jax.Array, keys_t: jax.Array, values: jax.Array, valid: jax.Array) -> jax.Array:
    """Grouped-query attention on head-major operands.

    q [B, K, G, T, H] (query head k * G + g reads kv head k), keys_t [B, K, H, S] (keys
    transposed), values [B, K, S, H], `valid` bool broadcastable to [B, K, G, T, S]. Scores and
    softmax in float32. Returns [B, K, G, T, H].

    Both products are plain batched matmuls over (B, K) with the G query heads of a group
    stacked as rows; on CPU this runs the training forward + backward about 1.4x faster than
    `jax.nn.dot_product_attention` on [B, T, N, H] operands.
    """
    B, K, G, T, H = q.shape
    scores = jnp.einsum(
        "bkqh,bkhs->bkqs", q.reshape(B, K, G * T, H), keys_t, preferred_element_type=jnp.float32
    ).reshape(B, K, G, T, -1) / math.sqrt(H)
    scores = jnp.where(valid, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype).reshape(B, K, G * T, -1)
    return jnp.einsum("bkqs,bksh->bkqh", probs, values).reshape(B, K, G, T, H)


def _heads(cfg: ModelConfig, q: jax.Array) -> jax.Array:
    """q [B, T, N, H] -> [B, K, G, T, H]: the G query heads that read kv head k, stacked."""
    B, T, N, H = q.shape
    K = cfg.num_kv_heads
    return jnp.transpose(q.reshape(B, T, K, N // K, H), (0, 2, 3, 1, 4))


def _dense_attend(cfg: ModelConfig, q, k, v, m):
    """q [B, T, N, H] over keys and values [B, S, K, H] where m [B, 1, T, S] allows."""
    B, T, N, H = q.shape
    out = attend(_heads(cfg, q), jnp.transpose(k, (0, 2, 3, 1)), jnp.swapaxes(v, 1, 2),
                 m[:, :, None])
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(B, T, N, H)


def dense_attention(cfg: ModelConfig, mask: jax.Array, causal: bool = False, prefix: int = 0):
    """Attention over every key of the row (or cache) where `mask` [B, 1, T, S] allows:
    (q [B, T, N, H], k, v [B, S, K, H]) -> [B, T, N, H].

    `causal`: the keys are `prefix` columns that every query may see, then the queries' own T
    columns, query t seeing those up to t (S == prefix + T, no cache). The queries then go in
    blocks of CAUSAL_BLOCK and each block reads only the keys up to its own last column: for a
    row of 3 blocks that is 6 of 9 blocks of scores. The results are the same, up to float
    rounding, for every query that sees a key (the skipped keys are masked for it); a padding
    query sees none, and its output, which nothing reads, is then the mean of the values its
    block reads rather than of the whole row's."""

    dense = functools.partial(_dense_attend, cfg)

    def fn(q, k, v):
        T = q.shape[1]
        if not causal or T <= CAUSAL_BLOCK:
            return dense(q, k, v, mask)
        blocks = [(s, prefix + min(s + CAUSAL_BLOCK, T)) for s in range(0, T, CAUSAL_BLOCK)]
        return jnp.concatenate(
            [dense(q[:, s : e - prefix], k[:, :e], v[:, :e], mask[:, :, s : e - prefix, :e])
             for s, e in blocks], axis=1)

    return fn


class SharedPrompt(NamedTuple):
    """The layout of rows that hold one prompt and `samples` responses to it: the prompt's
    `prompt` columns (left-padded), then each response's columns in turn (right-padded, all
    the same width). `hfjax.engine.shared_prompt` builds such rows from a padded batch."""

    prompt: int
    samples: int


def shared_prompt_attention(cfg: ModelConfig, attention_mask: jax.Array, layout: SharedPrompt,
                            blockwise: bool = False):
    """Attention in rows of `layout` (`attention_mask` [G, P + n * R] marks real tokens): a
    prompt token sees the prompt's earlier tokens, a response token the whole prompt and its own
    response's earlier tokens, which is what it sees in its own padded row [prompt, response].
    The prompt's keys and values are computed once and read by all n responses. With
    `blockwise`, both parts run as `blockwise_attention` (memory linear in P + R) instead of
    `dense_attention`."""
    G, T = attention_mask.shape
    P, n = layout
    R = (T - P) // n
    valid = attention_mask.astype(bool)
    p_valid, r_valid = valid[:, :P], valid[:, P:].reshape(G * n, R)
    prompt_mask = (jnp.tril(jnp.ones((P, P), bool))[None] & p_valid[:, None, :])[:, None]
    own = jnp.tril(jnp.ones((R, R), bool))[None] & r_valid[:, None, :]  # [G*n, R, R]
    seen = jnp.broadcast_to(jnp.repeat(p_valid, n, axis=0)[:, None, :], (G * n, R, P))
    response_mask = jnp.concatenate([seen, own], axis=2)[:, None]  # [G*n, 1, R, P + R]
    on_prompt = dense_attention(cfg, prompt_mask, causal=True)
    on_responses = dense_attention(cfg, response_mask, causal=True, prefix=P)
    if blockwise:
        # Response query t (column P + t of its padded row) sees keys up to P + t: every prompt
        # column and its own response's up to t.
        response_keys = jnp.concatenate([jnp.repeat(p_valid, n, axis=0), r_valid], axis=1)
        on_prompt = functools.partial(_blockwise, key_valid=p_valid, offset=0, segment_ids=None)
        on_responses = functools.partial(_blockwise, key_valid=response_keys, offset=P,
                                         segment_ids=None)

    def per_response(x):  # [G, P + n*R, heads, H] -> [G*n, R, heads, H], the responses' part
        return x[:, P:].reshape(G * n, R, *x.shape[2:])

    def with_prompt(x):  # [G*n, P + R, heads, H]: each response after its prompt's columns
        return jnp.concatenate([jnp.repeat(x[:, :P], n, axis=0), per_response(x)], axis=1)

    def fn(q, k, v):
        out_p = on_prompt(q[:, :P], k[:, :P], v[:, :P])
        out_r = on_responses(per_response(q), with_prompt(k), with_prompt(v))
        return jnp.concatenate([out_p, out_r.reshape(G, n * R, *q.shape[2:])], axis=1)

    return fn


class ResponseBlocks(NamedTuple):
    """The layout of compact shared-prompt rows (`hfjax.engine.shared_prompt.compact_layout`):
    each column's block, [B, T] (-1 padding, 0 the prompt's tokens, k the k-th response's),
    the prompt's columns (`prompt`, the first of the row) and the most tokens a response has
    (`longest`, static)."""

    blocks: jax.Array
    prompt: int
    longest: int


def compact_attention(cfg: ModelConfig, layout: ResponseBlocks):
    """Attention in compact rows: a prompt token sees the prompt's earlier tokens, a response
    token the prompt and its own response's earlier tokens.

    Queries go in blocks of CAUSAL_BLOCK, and a block past the prompt reads only the prompt's
    keys and the `longest` - 1 columns before its own (its responses start no earlier), so a
    token costs what its padded row's would, not the compact row's width."""
    blocks, p, longest = layout
    T = blocks.shape[1]

    def spans(s: int, e: int) -> list[tuple[int, int]]:  # key columns of queries [s, e)
        lo = max(p, s - longest + 1)
        return [(0, e)] if lo <= p else [(0, p), (lo, e)]

    def fn(q, k, v):
        outs = []
        for s in range(0, T, CAUSAL_BLOCK):
            e = min(s + CAUSAL_BLOCK, T)
            cols = spans(s, e)

            def keys(x, cols=cols):
                return jnp.concatenate([x[:, a:b] for a, b in cols], axis=1)

            key_col = np.concatenate([np.arange(a, b) for a, b in cols])
            causal = key_col[None, :] <= np.arange(s, e)[:, None]  # [C, S]
            kb, qb = keys(blocks)[:, None, :], blocks[:, s:e, None]
            m = causal[None] & (kb >= 0) & ((kb == 0) | (kb == qb))
            outs.append(_dense_attend(cfg, q[:, s:e], keys(k), keys(v), m[:, None]))
        return jnp.concatenate(outs, axis=1)

    return fn


# Query block of causal `dense_attention` (bench/attention.py: 64, 96 and 128 within 4% of
# each other on the CPU for rows of 384 columns, forward + backward about 1.5x unblocked).
CAUSAL_BLOCK = 128


def band_chunk(span: int) -> int:
    """Query block of `banded_attention` for segments of at most `span` tokens."""
    return min(BAND_CHUNK, span)


BAND_CHUNK = 128


def uses_band(width: int, span: int) -> bool:
    """Whether packed rows of `width` columns holding segments of at most `span` tokens are
    attended by blocks (`banded_attention`) rather than over the whole row."""
    c = band_chunk(span)
    return width % c == 0 and width > span + c


def banded_attention(cfg: ModelConfig, segment_ids: jax.Array, span: int):
    """Attention in packed rows whose segments are at most `span` tokens long: a query can only
    see keys of its own segment, so at most `span - 1` columns back. The row is cut into
    blocks of C = `band_chunk(span)` queries and each block attends to its own keys and the
    ceil(span / C) blocks before it, so the cost per token is that of span + C keys whatever
    the row's width (dense attention over a row of W columns costs W keys per token).
    Same results as `dense_attention` with the segment mask: every key outside the window is
    masked there anyway."""
    B, T = segment_ids.shape
    C = band_chunk(span)
    back = -(-span // C)
    nb = T // C
    window = (back + 1) * C

    def windows(x):  # [B, T, ...] -> [B, nb, window, ...]: block i's keys, blocks i-back..i
        pad = [(0, 0), (back * C, 0)] + [(0, 0)] * (x.ndim - 2)
        xp = jnp.pad(x, pad).reshape(B, nb + back, C, *x.shape[2:])
        return jnp.concatenate([xp[:, j : j + nb] for j in range(back + 1)], axis=2)

    seg_q = segment_ids.reshape(B, nb, C)
    seg_k = windows(segment_ids)  # the left padding is segment 0: never a real token's
    # Key w of block i is column i*C - back*C + w; query c is column i*C + c.
    causal = jnp.arange(window)[None, :] <= jnp.arange(C)[:, None] + back * C  # [C, window]
    valid = (seg_q[..., :, None] == seg_k[..., None, :]) & causal  # [B, nb, C, window]
    valid = valid.reshape(B * nb, 1, 1, C, window)

    def fn(q, k, v):
        _, _, N, H = q.shape
        K = cfg.num_kv_heads
        qb = _heads(cfg, q.reshape(B * nb, C, N, H))  # [B*nb, K, G, C, H]
        kw = windows(k).reshape(B * nb, window, K, H)
        vw = windows(v).reshape(B * nb, window, K, H)
        out = attend(qb, jnp.transpose(kw, (0, 2, 3, 1)), jnp.swapaxes(vw, 1, 2), valid)
        return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(B, T, N, H)

    return fn
