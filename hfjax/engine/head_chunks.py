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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

# Scored positions per data-parallel device that the head takes at a time
# (`actor.logprob_chunk`): each row gets an equal share of them. bench/logprob_chunks.py
# measures time and peak memory against the chunk; 0 turns chunking off.
DEFAULT_CHUNK = 2048


def over_tokens(head: Callable[..., Any], budget: int, dp: int, *columns: jax.Array) -> Any:
    """`over_positions` with chunks of about `budget` positions per data-parallel device in
    all: a micro-batch of B rows over `dp` devices takes `budget // ceil(B / dp)` positions
    of every row at a time (at least 1). `budget` <= 0: whole rows."""
    if budget <= 0:
        return head(*columns)
    rows = -(-columns[0].shape[0] // max(dp, 1))
    return over_positions(head, max(1, budget // rows), *columns)


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
