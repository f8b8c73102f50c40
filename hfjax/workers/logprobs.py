"""Per-token log-probs and entropy of the response tokens under a policy: what the actor and
the reference score a batch with (`hfjax.workers.actor`).

One function per row layout: padded rows (`response_logprobs`, shared-prompt rows too with
`samples` > 1), compact shared-prompt rows of length-grouped micro-batches
(`compact_logprobs`) and packed rows (`packed_logprobs`). Only the positions that predict a
response token go through the LM head, a chunk of positions at a time
(`hfjax.engine.head_chunks`). Rows split over the mesh's `sequence` axis (sequence parallelism)
take the `_split_*` paths, which keep each device on its own columns: the head runs on every
position of a device's columns against the next column's token (`_next_column`) and the
response's results are cut out after, since cutting the hidden states first would move them
between devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hfjax.engine import head_chunks, packing, shared_prompt
from hfjax.models import sequence_parallel as sp
from hfjax.numerics import core
from hfjax.parallel import sharding as shd


def response_logprobs(model, input_ids, attention_mask, response_len: int, temperature: float,
                      samples: int = 1, chunk: int = head_chunks.DEFAULT_CHUNK, dp: int = 1):
    """(log-probs [B, R], entropy [B, R]) of the last R tokens, logits divided by temperature.

    `samples` > 1: the rows come in groups of that many sharing one prompt, and are computed
    as shared-prompt rows (`hfjax.engine.shared_prompt`; the caller checks `fits`). The LM
    head runs on about `chunk` positions per one of `dp` data-parallel devices at a time
    (`hfjax.engine.head_chunks.over_tokens`; 0: the whole rows at once)."""
    # Only the positions that predict response tokens go through the LM head.
    s = sp.sequence_size(shd.active_layout())
    if s > 1 and samples > 1:
        return _split_shared_logprobs(model, input_ids, attention_mask, response_len,
                                      temperature, samples, chunk, dp, s)
    if s > 1:
        return _split_response_logprobs(model, input_ids, attention_mask, response_len,
                                        temperature, chunk, dp, s)
    if samples > 1:
        hidden = shared_prompt.response_hidden(model.model, input_ids, attention_mask,
                                               response_len, samples)
    else:
        hidden = model.model(input_ids, attention_mask)[0][:, -response_len - 1 : -1]
    labels = input_ids[:, -response_len:]
    return head_chunks.over_tokens(_head(model, temperature), chunk, dp, hidden, labels)


def _split_response_logprobs(model, input_ids, attention_mask, response_len, temperature,
                             chunk, dp, s):
    """`response_logprobs` of rows split `s` ways over `sequence`: the head runs on every
    position of each device's T / s (a row's prompt positions too, P / (P + R) more head
    work), predicting the next column's token, and only the [B, R] results are cut out.
    Cutting the hidden states to the response first would move them between devices."""
    B, T = input_ids.shape
    W = -(-T // s) * s
    pad = [(0, 0), (0, W - T)]
    hidden, _ = model.model(jnp.pad(input_ids, pad), jnp.pad(attention_mask, pad))
    lp, ent = _next_column(model, temperature, hidden, input_ids, chunk, dp, s)
    cut = slice(T - response_len - 1, T - 1)
    return lp[:, cut], ent[:, cut]


def _next_column(model, temperature, hidden, ids, chunk, dp, s):
    """(log-probs, entropy) [B, W] of hidden [B, W, D], split `s` ways over `sequence`, each
    column predicting the next column's token of ids [B, T] (T <= W; 0 past its end): the head
    on each device's own columns, `chunk` positions per data-parallel device at a time."""
    labels = jnp.pad(ids[:, 1:], [(0, 0), (0, hidden.shape[1] - ids.shape[1] + 1)])
    return head_chunks.over_tokens(_head(model, temperature), chunk, dp, hidden, labels,
                                   split=s)


def _split_shared_logprobs(model, input_ids, attention_mask, response_len, temperature,
                           samples, chunk, dp, s):
    """`response_logprobs` of shared-prompt rows (`samples` per prompt) split `s` ways over
    `sequence`. As for padded rows, the head runs on every position of each device's columns
    against the next column's token, and the [B, R] results are cut out; a response's first
    token is predicted by the prompt's last position instead (shared by the group), so that one
    hidden state per row goes through the head once per sample. Cutting each response's
    predicting hidden states out first (`shared_prompt.predicting`) would gather whole rows."""
    ids, mask, positions, layout = shared_prompt.group_rows(input_ids, attention_mask,
                                                            response_len, samples)
    hidden, _ = model.model(ids, mask, positions=positions, shared_prompt=layout,
                            keep_width=True)
    g, t = ids.shape
    p, n, r = t - samples * response_len, samples, response_len
    lp, ent = _next_column(model, temperature, hidden, ids, chunk, dp, s)
    # Each response's first token, from the prompt's last position (n positions per row).
    last = jnp.broadcast_to(hidden[:, p - 1, None], (g, n, hidden.shape[-1]))
    first_lp, first_ent = _head(model, temperature)(last, ids[:, p::r])  # [G, n]

    def rows(first, rest):  # [G, n] and [G, W] -> [G * n, R]
        rest = rest[:, p:p + n * r].reshape(g, n, r)[:, :, :r - 1]
        out = jnp.concatenate([first[..., None], rest], axis=2).reshape(g * n, r)
        # Left split over `sequence` where it divides R: not all-gathered to whole rows.
        return shd.constrain(out, ("batch", "length")) if r % s == 0 else out

    return rows(first_lp, lp), rows(first_ent, ent)


def _head(model, temperature: float):
    """(hidden [B, C, D], labels [B, C]) -> (log-probs, entropy) [B, C] under `model`'s LM
    head, logits divided by `temperature`."""
    def head(hidden, labels):
        return core.logprobs_and_entropy(model.logits(hidden) / temperature, labels)
    return head


def compact_logprobs(model, mb: dict[str, jax.Array], temperature: float, samples: int,
                     chunk: int = head_chunks.DEFAULT_CHUNK, dp: int = 1):
    """(log-probs, entropy) [B, R] of a micro-batch laid out as compact shared-prompt rows
    (`hfjax.engine.shared_prompt.compact_layout`): only the rows' response tokens go through
    the LM head, about `chunk` positions per data-parallel device at a time (rows split over
    `sequence`: `_split_compact_logprobs`)."""
    s = sp.sequence_size(shd.active_layout())
    if s > 1:
        lp, ent = _split_compact_logprobs(model, mb, temperature, samples, chunk, dp, s)
    else:
        hidden, labels = shared_prompt.compact_response_hidden(model.model, mb, samples)
        lp, ent = head_chunks.over_tokens(_head(model, temperature), chunk, dp, hidden, labels)
    return (shared_prompt.compact_to_rows(lp, mb, samples),
            shared_prompt.compact_to_rows(ent, mb, samples))


def _split_compact_logprobs(model, mb, temperature, samples, chunk, dp, s):
    """(log-probs, entropy) [G, S] of compact shared-prompt rows split `s` ways over
    `sequence`, as `_split_shared_logprobs` takes them from shared rows: the head on every
    position of each device's columns against the next column's token, read at each response
    column's predicting column; a response's first token (its predicting column is the
    prompt's last) from the prompt's last position's distribution, computed once per row."""
    hidden, rows, pred, p = shared_prompt.compact_hidden(model.model, mb, samples,
                                                         keep_width=True)
    lp, ent = _next_column(model, temperature, hidden, rows, chunk, dp, s)
    # A response's first token: one distribution per row, read at each response column.
    logits = model.logits(hidden[:, p - 1]) / temperature  # [G, V]
    first_lp = jnp.take_along_axis(jax.nn.log_softmax(logits), rows[:, p:p + pred.shape[1]],
                                   axis=1)
    first = pred == p - 1
    return (jnp.where(first, first_lp, jnp.take_along_axis(lp, pred, axis=1)),
            jnp.where(first, core.entropy_from_logits(logits)[:, None],
                      jnp.take_along_axis(ent, pred, axis=1)))


def packed_logprobs(model, packed: packing.Packed, span: int, temperature: float):
    """(log-probs, entropy) [G, W] of each scored packed position's next token in its row (0
    elsewhere), logits divided by temperature; only the scored positions (those predicting
    response tokens) go through the LM head (`hfjax.engine.packing.on_scored`)."""
    hidden, _ = packing.apply(model.model, packed, span)

    def head(h, labels):
        logits = model.logits(h) / temperature
        return core.logprobs_and_entropy(logits, labels)

    return packing.on_scored(head, packed.scored, hidden, packing.next_tokens(packed.ids))
