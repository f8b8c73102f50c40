"""The LM head over a long row, a chunk of positions at a time.

A row's log-probs and entropy need the softmax over the vocabulary at every scored position:
[B, T, V] float32 logits, plus the exponential and the gradient's temporaries of the same size.
At V = 151,936 (Qwen2.5) a micro-batch of 128 rows of 256 response tokens is 18.5 GiB of
logits, held several times over. `over_positions` runs the head on `chunk` positions of every
row at a time (a `lax.scan` over the chunks), and under a gradient recomputes each chunk's
logits in the backward pass (`jax.checkpoint`) instead of keeping them, so neither pass holds
more than [B, chunk, V] float32 logits. The per-position results are the unchunked ones: each
position's logits are the same dot products, and the weight gradient is the same sum taken
chunk by chunk.

Rows of at most `chunk` positions take the head in one call, the plain program. `over_tokens`
sizes the chunk from a budget of positions per data-parallel device (`actor.logprob_chunk`).

Rows split over the `sequence` mesh axis (`hfjax.models.sequence_parallel`) are chunked within
each device's T / s positions: [B, T] is viewed as [B, s, T / s] with the s axis split, and the
scan runs over the local axis. A scan over chunks of the split T axis itself would cut across
the shards, and XLA then gathers the hidden states whole on every device (s-fold redundant
head work; tests/models/test_sequence_parallel_hlo.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from hfjax.parallel import sharding as shd

# Scored positions per data-parallel device that the head takes at a time
# (`actor.logprob_chunk`): each row gets an equal share of them. bench/logprob_chunks.py
# measures time and peak memory against the chunk; 0 turns chunking off.
DEFAULT_CHUNK = 2048


def over_tokens(head: Callable[..., Any], budget: int, dp: int, *columns: jax.Array,
                split: int = 1) -> Any:
    """`over_positions` with chunks of about `budget` positions per data-parallel device in
    all: a micro-batch of B rows over `dp` devices takes `budget // ceil(B / dp)` positions
    of every row at a time (at least 1). `budget` <= 0: whole rows.

    `split` > 1: the columns' T is split that many ways over `sequence` (T a multiple of it);
    the chunks are taken within each device's T / split positions, and `head` maps
    [B, split, C, ...] inputs to [B, split, C] outputs."""
    if split > 1:
        return _within_shards(head, budget, dp, split, *columns)
    if budget <= 0:
        return head(*columns)
    rows = -(-columns[0].shape[0] // max(dp, 1))
    return over_positions(head, max(1, budget // rows), *columns)


def _within_shards(head, budget, dp, split, *columns):
    b, t = columns[0].shape[:2]
    if t % split:
        raise ValueError(f"over_tokens: {t} positions do not split {split} ways")

    def local(x):  # [B, T, ...] -> [B, s, T / s, ...], the s axis on `sequence`
        x = x.reshape((b, split, t // split) + x.shape[2:])
        return shd.constrain(x, ("batch", "length") + (None,) * (x.ndim - 2))

    cols = tuple(local(x) for x in columns)
    if budget <= 0 or t // split <= budget:
        out = head(*cols)
    else:
        rows = -(-b // max(dp, 1))
        out = _over_local(head, max(1, budget // rows), *cols)
    return jax.tree.map(lambda y: y.reshape((b, t) + y.shape[3:]), out)


def _over_local(head, chunk, *columns):
    """`over_positions` over axis 2 of [B, s, T / s, ...] columns."""
    b, s, t = columns[0].shape[:3]
    if t <= chunk:
        return head(*columns)
    n = -(-t // chunk)

    def chunks(x):  # [B, s, t, ...] -> [n, B, s, chunk, ...]
        x = jnp.pad(x, [(0, 0), (0, 0), (0, n * chunk - t)] + [(0, 0)] * (x.ndim - 3))
        x = jnp.moveaxis(x.reshape((b, s, n, chunk) + x.shape[3:]), 2, 0)
        return shd.constrain(x, (None, "batch", "length") + (None,) * (x.ndim - 3))

    def split(x):  # [B, s, chunk, ...], its s on `sequence`; the gradient's too, else XLA may
        # split the head's cotangent over the features (after the vocabulary-split weight)
        # and trade it back with an all-to-all
        return shd.constrain(x, ("batch", "length") + (None,) * (x.ndim - 2))

    def body(_, cols):
        return None, jax.checkpoint(head)(*(split(x) for x in cols))

    _, out = jax.lax.scan(body, None, tuple(chunks(x) for x in columns))

    def unchunk(y):  # [n, B, s, chunk] -> [B, s, t]
        return jnp.moveaxis(y, 0, 2).reshape((b, s, n * chunk) + y.shape[4:])[:, :, :t]

    return jax.tree.map(unchunk, out)


def over_positions(head: Callable[..., Any], chunk: int, *columns: jax.Array) -> Any:
    """`head(*columns)` computed `chunk` positions at a time: `columns` are [B, T, ...]
    per-position inputs (hidden states, labels) and `head` maps [B, C, ...] inputs to a pytree
    of [B, C] outputs; returns that pytree at [B, T].

    `chunk` <= 0 or >= T: one call of `head` on the whole rows. Otherwise T is padded up to a
    multiple of `chunk` (the pad's outputs are dropped) and the chunks run in a `lax.scan`,
    each under `jax.checkpoint`. The batch axis stays leading in every chunk, so a batch
    sharded over the data-parallel devices stays sharded the same way."""
    b, t = columns[0].shape[:2]
    for x in columns:
        if x.shape[:2] != (b, t):
            raise ValueError(f"over_positions: column of shape {x.shape} does not start with "
                             f"[B, T] = {[b, t]}")
    if chunk <= 0 or t <= chunk:
        return head(*columns)
    n = -(-t // chunk)

    def chunks(x):  # [B, T, ...] -> [n, B, chunk, ...]
        x = jnp.pad(x, [(0, 0), (0, n * chunk - t)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape((b, n, chunk) + x.shape[2:]), 1, 0)

    def body(_, cols):
        return None, jax.checkpoint(head)(*cols)

    _, out = jax.lax.scan(body, None, tuple(chunks(x) for x in columns))

    def unchunk(y):  # [n, B, chunk] -> [B, T]
        return jnp.moveaxis(y, 0, 1).reshape((b, n * chunk) + y.shape[3:])[:, :t]

    return jax.tree.map(unchunk, out)
