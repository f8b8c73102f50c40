"""Packed training batches: the real tokens of a batch's sequences laid end to end in
fixed-width rows, and micro-batches cut by a token budget instead of a row count (verl's
`use_remove_padding` with `use_dynamic_bsz`).

A padded batch holds each sequence in its own row [P + R]: the left-padded prompt, then the
right-padded response. In an RL batch whose responses differ widely in length most of those
columns are padding, and every forward and backward pass computes on them. Here a sequence's
real tokens are instead copied into a packed row at some offset; a row holds several sequences
(segments), told apart by segment ids (attention stays inside a segment) and with positions that
restart at 0 in each segment, which are exactly the positions the padded row gives them
(`positions_from_mask`). So every real token sees the same keys at the same RoPE positions as
in the padded batch, and its log-prob, value and gradient are the same up to float rounding.

**Shapes are static, the count is not.** A micro-batch is one packed row per data-parallel
device, `budget` tokens wide (verl's `ppo_max_token_len_per_gpu`, rounded down to the attention
block). A sequence is never split across rows, so a row wastes at most the end that no waiting
sequence fits in. Attention inside a row is banded (`hfjax.models.attention.banded_attention`):
a token only sees its own segment, at most S = P + R tokens (the padded rows' width, the
`span`), so a wide row costs per token what a padded row of S columns does, not its width.
The buffers hold the worst case (every sequence S tokens long); how many micro-batches are in
use depends on the lengths and is decided on device, so the micro-batch loop is a
`lax.while_loop` with that trip count. No length goes to the host and the program compiles once
per (batch, S) shape.

**Packing.** Sequences are placed first-fit in decreasing length order (`plan`), computed on
device by a scan over the sequences; the rows a placement uses are a prefix of the buffer, and
micro-batch i is rows [i*G, (i+1)*G), split over the data-parallel devices like any batch.

**Back to the padded layout.** Losses are computed on [B, R] arrays exactly as in padded mode:
the log-prob (or value) that predicts response token t of sequence b is gathered from the
packed position of the padded column P + t - 1 (`unpack`). A micro-batch's loss is taken over
the whole mini-batch's [B, R] arrays with the response mask cut to that micro-batch's sequences,
so the loss functions and their normalisers are the padded ones.

One aggregation mode depends on the micro-batch grouping in both layouts:
"seq-mean-token-sum-norm" weighs each micro-batch's token sum by its share of the sequences
(as verl does), so its mini-batch loss equals the padded one when both take the mini-batch in
one micro-batch; the other modes are the same for any grouping.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from hfjax.models import attention
from hfjax.parallel import sharding as shd


class PackShape(NamedTuple):
    """Static sizes of a packed batch."""

    width: int  # W: columns of a packed row
    rows: int  # G: packed rows per micro-batch (one per data-parallel device)
    micro: int  # micro-batches the buffers hold (the worst case: every sequence `span` long)
    span: int  # S: the longest a sequence can be (the padded rows' width, P + R)

    @property
    def buffer_rows(self) -> int:
        return self.rows * self.micro


def pack_shape(n_seqs: int, span: int, budget: int, dp: int, who: str = "packing") -> PackShape:
    """The static sizes for `n_seqs` padded rows of `span` columns, `budget` tokens per
    data-parallel device and micro-batch, over `dp` devices.

    Raises ValueError when one sequence does not fit in the budget (before compiling).
    """
    if budget < span:
        raise ValueError(
            f"{who}: a token budget of {budget} per device is smaller than one sequence "
            f"({span} tokens: prompt + response columns); raise ppo_max_token_len_per_gpu to "
            f"at least data.max_prompt_length + rollout.response_length"
        )
    chunk = attention.band_chunk(span)
    width = max(span, budget // chunk * chunk)  # whole attention blocks
    rows_needed = math.ceil(n_seqs / (width // span))  # every sequence `span` long
    return PackShape(width=width, rows=dp, micro=max(1, math.ceil(rows_needed / dp)), span=span)


class Packing(NamedTuple):
    """Where each sequence of a batch goes (device arrays)."""

    row: jax.Array  # [B] packed row
    start: jax.Array  # [B] column of its first real token
    n_micro: jax.Array  # scalar: micro-batches in use


def plan(attention_mask: jax.Array, shape: PackShape) -> Packing:
    """First-fit decreasing placement of the sequences' real tokens (`attention_mask` [B, L])
    into rows of `shape.width` columns; runs on device."""
    lengths = jnp.sum(attention_mask.astype(jnp.int32), axis=1)
    order = jnp.argsort(-lengths, stable=True)
    n_rows, width = shape.buffer_rows, shape.width

    def place(fill, length):
        row = jnp.argmax(fill + length <= width)  # first row with room (every row has W)
        return fill.at[row].add(length), (row, fill[row])

    fill, (rows, starts) = jax.lax.scan(place, jnp.zeros((n_rows,), jnp.int32), lengths[order])
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    used = jnp.sum(fill > 0)  # first fit opens rows in order: the used rows are a prefix
    n_micro = (used + shape.rows - 1) // shape.rows
    return Packing(rows[inverse].astype(jnp.int32), starts[inverse].astype(jnp.int32),
                     n_micro.astype(jnp.int32))


class Packed(NamedTuple):
    """Packed rows [micro, G, W]: token ids, segment ids (0 on padding), positions, and which
    positions' outputs are read (`scored`: every real token, or with `packed_batch` only
    those that predict a response token)."""

    ids: jax.Array
    segments: jax.Array
    positions: jax.Array
    scored: jax.Array


def pack(input_ids: jax.Array, attention_mask: jax.Array, where: Packing,
         shape: PackShape) -> Packed:
    """Copies the real tokens of `input_ids` [B, L] into packed rows, `where` says where."""
    b, length = input_ids.shape
    mask = attention_mask.astype(jnp.int32)
    pos = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)  # as `positions_from_mask`
    flat = where.row[:, None] * shape.width + where.start[:, None] + pos
    size = shape.buffer_rows * shape.width
    flat = jnp.where(mask > 0, flat, size).reshape(-1)  # padding goes out of bounds: dropped
    seg = jnp.broadcast_to(jnp.arange(1, b + 1, dtype=jnp.int32)[:, None], (b, length))

    def scatter(values):
        out = jnp.zeros((size,), values.dtype).at[flat].set(values.reshape(-1), mode="drop")
        out = out.reshape(shape.micro, shape.rows, shape.width)
        return shd.constrain(out, (None, "batch", None))

    segments = scatter(seg)
    return Packed(scatter(input_ids.astype(jnp.int32)), segments, scatter(pos),
                  (segments > 0).astype(jnp.int32))


def apply(model_fn: Callable[..., Any], rows: Packed, span: int) -> Any:
    """`model_fn` (a model's call, its backbone's, or a head's method) on packed rows: token ids
    with their segment ids and per-segment positions, attention banded to `span`."""
    return model_fn(rows.ids, None, positions=rows.positions, segment_ids=rows.segments,
                    segment_span=span)


def micro_batch(packed: Packed, i: jax.Array) -> Packed:
    """Packed micro-batch i: [G, W] arrays."""
    return Packed(*(jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False) for x in packed))


def response_index(attention_mask: jax.Array, where: Packing, response_len: int, shape: PackShape,
                   ) -> tuple[jax.Array, jax.Array]:
    """(packed row, column) [B, R] of the token whose output predicts response token t: the
    padded column P + t - 1 (positions are clipped into the row where it is padding)."""
    pos = jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=1) - 1, 0)
    before = pos[:, -response_len - 1 : -1]
    col = jnp.clip(where.start[:, None] + before, 0, shape.width - 1)
    return jnp.broadcast_to(where.row[:, None], col.shape), col


def unpack(values: jax.Array, row: jax.Array, col: jax.Array, first_row: jax.Array | int = 0,
           ) -> jax.Array:
    """values [G, W] (packed rows first_row .. first_row + G - 1) at [B, R] (row, col); rows
    outside them read clipped, arbitrary values (mask them)."""
    r = jnp.clip(row - first_row, 0, values.shape[0] - 1)
    return values[r, col]


def next_tokens(ids: jax.Array) -> jax.Array:
    """The label of each packed position: the token after it in its row (the last column's,
    and at a segment's end the next segment's first, are never read for a response)."""
    return jnp.concatenate([ids[:, 1:], ids[:, :1]], axis=1)


# Columns of one pass of a head over the scored positions (`on_scored`).
HEAD_CHUNK = 128


def on_scored(head: Callable[..., Any], scored: jax.Array, *columns: jax.Array,
              chunk: int = HEAD_CHUNK) -> Any:
    """`head(*columns)` at the positions `scored` [G, W] marks, 0 elsewhere: a pytree of [G, W]
    arrays from per-position inputs `columns` ([G, W, ...] each; `head` maps [G, C, ...]
    inputs to [G, C] outputs).

    Each row's scored positions are moved to its front (in column order) and the head runs on
    `chunk` columns at a time while any row still has scored positions there: the chunks past
    the fullest row's count are skipped (`lax.cond`, also in the backward pass). An LM head
    over a packed row's prompt tokens, whose outputs nobody reads, is most of what this
    saves. Under a gradient each chunk's head is recomputed in the backward pass
    (`jax.checkpoint`) rather than its [G, C, V] logits kept: on the CPU that is the faster
    of the two (bench/packed_update.py)."""
    g, w = scored.shape
    c = min(chunk, w)
    n = -(-w // c)
    order = jnp.argsort(scored == 0, axis=1, stable=True)  # scored columns first
    count = jnp.max(jnp.sum(scored > 0, axis=1))

    def chunks(x):  # [G, W, ...] -> [n, G, c, ...] in `order`
        x = jnp.take_along_axis(x, order.reshape(order.shape + (1,) * (x.ndim - 2)), axis=1)
        x = jnp.pad(x, [(0, 0), (0, n * c - w)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape((g, n, c) + x.shape[2:]), 1, 0)

    xs = [chunks(x) for x in columns]
    out_shape = jax.eval_shape(head, *(x[0] for x in xs))

    def body(_, inputs):
        j, *cols = inputs
        return None, jax.lax.cond(
            j * c < count, lambda: jax.checkpoint(head)(*cols),
            lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape))

    _, out = jax.lax.scan(body, None, (jnp.arange(n), *xs))
    back = jnp.argsort(order, axis=1)  # column -> its place in `order`

    def unchunk(y):  # [n, G, c] -> [G, W] in column order, 0 where not scored
        y = jnp.moveaxis(y, 0, 1).reshape(g, n * c)[:, :w]
        return jnp.where(scored > 0, jnp.take_along_axis(y, back, axis=1), 0)

    return jax.tree.map(unchunk, out)


PerToken = Callable[[Packed, int], Any]
"""A per-token pass: (packed rows [G, W], span) -> [G, W, ...] arrays; `span` (static) is the
longest a segment can be, for the model's `segment_span`."""


def per_token(fn: PerToken, packed: Packed, where: Packing, span: int) -> Any:
    """`fn` over the micro-batches in use, collected into [micro * G, W, ...] buffers (rows of
    unused micro-batches hold zeros)."""
    out_shape = jax.eval_shape(lambda rows: fn(rows, span), micro_batch(packed, jnp.int32(0)))
    first = jax.tree.map(lambda s: jnp.zeros((packed.ids.shape[0],) + s.shape, s.dtype), out_shape)

    def body(i, acc):
        out = fn(micro_batch(packed, i), span)
        return jax.tree.map(lambda a, o: jax.lax.dynamic_update_index_in_dim(a, o, i, 0), acc, out)

    acc = jax.lax.fori_loop(0, where.n_micro, body, first)
    return jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), acc)


def packed_batch(input_ids: jax.Array, attention_mask: jax.Array, response_len: int,
                 shape: PackShape) -> tuple[Packed, Packing, jax.Array, jax.Array]:
    """A padded batch's placement, packed rows, and (row, column) [B, R] of each response
    token's predicting position (`response_index`)."""
    where = plan(attention_mask, shape)
    packed = pack(input_ids, attention_mask, where, shape)
    row, col = response_index(attention_mask, where, response_len, shape)
    # Only the positions that predict a real response token are read. `max`: a padding
    # column's clipped index may repeat a real one.
    real = (attention_mask[:, -response_len:] > 0).astype(jnp.int32)
    scored = jnp.zeros((shape.buffer_rows, shape.width), jnp.int32).at[row, col].max(real)
    scored = shd.constrain(scored.reshape(packed.scored.shape), (None, "batch", None))
    return packed._replace(scored=scored), where, row, col


def response_values(per_token_fn: PerToken, mb: dict[str, jax.Array]) -> Any:
    """Inside a loss: `per_token_fn` on micro-batch `mb["packed"]`, read back at the
    mini-batch's response tokens [B, R]; 0 where `mb["response_mask"]` (cut to this
    micro-batch's sequences) is 0."""
    mask = mb["response_mask"] > 0
    out = per_token_fn(mb["packed"], mb["input_ids"].shape[1])
    return jax.tree.map(
        lambda v: jnp.where(mask, unpack(v, mb["resp_row"], mb["resp_col"], mb["first_row"]), 0),
        out)


def forward(per_token_fn: PerToken, input_ids: jax.Array, attention_mask: jax.Array,
            response_len: int, shape: PackShape) -> Any:
    """A scoring pass on packed rows: `per_token_fn` over the micro-batches in use, read back
    at the response tokens [B, R] (0 on response padding)."""
    packed, where, row, col = packed_batch(input_ids, attention_mask, response_len, shape)
    out = per_token(per_token_fn, packed, where, shape.span)
    mask = attention_mask[:, -response_len:] > 0
    return jax.tree.map(lambda v: jnp.where(mask, v[row, col], 0), out)


def last_tokens(per_token_fn: PerToken, input_ids: jax.Array, attention_mask: jax.Array,
                shape: PackShape, read: jax.Array) -> Any:
    """A pass on packed rows read back at one position of each sequence [B]: `read` [B], a
    position of the padded row (a reward or cost model's `transformer.pooled_index`), moved to
    where the packing put it."""
    where = plan(attention_mask, shape)
    packed = pack(input_ids, attention_mask, where, shape)
    out = per_token(per_token_fn, packed, where, shape.span)
    real_before = jnp.cumsum(attention_mask.astype(jnp.int32), axis=1)  # as `pack` counts
    rank = jnp.take_along_axis(real_before, read[:, None].astype(jnp.int32), axis=1)[:, 0] - 1
    col = jnp.clip(where.start + rank, 0, shape.width - 1)
    return jax.tree.map(lambda v: v[where.row, col], out)


def accumulate_grads(loss_fn: Callable, params: Any, batch: dict[str, jax.Array], totals: dict,
                     shape: PackShape) -> tuple[Any, dict]:
    """The packed counterpart of the update's micro-batch scan: packs the mini-batch `batch`
    and sums, over the micro-batches in use, the gradients and metrics of
    `loss_fn(params, mb, totals)`. `mb` is `batch` with its `response_mask` cut to micro-batch
    i's sequences, plus `packed` (its packed rows), `first_row`, and `resp_row`/`resp_col`
    (see `response_values`). Returns (summed grads, summed metrics with `loss`)."""
    response_len = batch["responses"].shape[1]
    packed, where, row, col = packed_batch(batch["input_ids"], batch["attention_mask"],
                                           response_len, shape)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def mb_of(i):
        mine = (where.row // shape.rows == i).astype(batch["response_mask"].dtype)
        return {**batch, "response_mask": batch["response_mask"] * mine[:, None],
                "packed": micro_batch(packed, i), "first_row": i * shape.rows,
                "resp_row": row, "resp_col": col}

    first = jax.eval_shape(lambda: loss_fn(params, mb_of(jnp.int32(0)), totals))
    m0 = {"loss": jnp.zeros((), jnp.float32)}
    m0.update({k: jnp.zeros(v.shape, v.dtype) for k, v in first[1].items()})

    def body(i, acc):
        (loss, metrics), grads = grad_fn(params, mb_of(i), totals)
        g_acc, m_acc = acc
        return (jax.tree.map(jnp.add, g_acc, grads),
                jax.tree.map(jnp.add, m_acc, {"loss": loss, **metrics}))

    zeros = jax.tree.map(jnp.zeros_like, params)
    return jax.lax.fori_loop(0, where.n_micro, body, (zeros, m0))


@dataclasses.dataclass(frozen=True)
class TokenBudget:
    """A role's packing setting: `tokens` per data-parallel device and micro-batch (verl's
    `ppo_max_token_len_per_gpu`); 0: as many tokens as `rows` padded rows of the batch hold
    (`ppo_micro_batch_size` sequences over the devices), the padded micro-batch's size."""

    tokens: int
    rows: int  # 0: the whole batch's rows

    def shape(self, n_seqs: int, span: int, dp: int, who: str) -> PackShape:
        budget = self.tokens or max(1, (self.rows or n_seqs) // dp) * span
        return pack_shape(n_seqs, span, budget, dp, who)


def token_budget(remove_padding: bool, tokens: int, rows: int = 0) -> TokenBudget | None:
    """A role's packing setting (`hfjax.workers.spec`); None: padded batches (`remove_padding`,
    the role's `use_remove_padding`, off). `tokens` per data-parallel device and micro-batch
    (`ppo_max_token_len_per_gpu` of a trained role, `forward_max_token_len_per_gpu` of a
    forward-only one); 0: `rows` padded rows' worth (`ppo_micro_batch_size`), or the whole
    batch's padded tokens when `rows` is 0 too."""
    if not remove_padding:
        return None
    return TokenBudget(int(tokens), int(rows))
