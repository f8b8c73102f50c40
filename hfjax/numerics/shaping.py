"""Reward shaping and sample filtering: DAPO's overlong penalty and its dynamic-sampling rule,
and the placement of sequence scores on token positions.

Pure jnp functions of arrays, like the rest of `hfjax.numerics`; the driver that uses them
(`hfjax.algorithms.dapo`) decides what to do with their results.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hfjax.numerics.core import Array, mask_like


def overlong_penalty(response_length: Array, max_length: int, buffer_length: int,
                     penalty_factor: float) -> Array:
    """DAPO's soft overlong punishment, one value per response [B] (<= 0).

    A response of L tokens within ``max_length - buffer_length`` gets 0; beyond that, the
    penalty falls linearly, -(L - (max_length - buffer_length)) / buffer_length *
    penalty_factor, reaching -penalty_factor at ``max_length``. A zero-length response gets 0.
    """
    if buffer_length <= 0:
        raise ValueError(f"overlong buffer_length must be positive, got {buffer_length}")
    if buffer_length > max_length:
        raise ValueError(f"overlong buffer_length {buffer_length} is longer than the response "
                         f"length {max_length}; make it at most the response length")
    length = jnp.asarray(response_length, jnp.float32)
    exceed = length - (max_length - buffer_length)
    return jnp.minimum(-exceed / buffer_length * penalty_factor, 0.0)


def last_token_index(response_mask: Array) -> Array:
    """[B] int32: the column of each row's last response (policy) token, -1 in a row with none.

    Not ``sum(mask) - 1``: a multi-turn row's mask has gaps where tool results sit (context,
    not policy tokens), so its last policy token lies beyond its count of policy tokens.
    """
    m = jnp.asarray(response_mask) > 0
    t = m.shape[1]
    last = t - 1 - jnp.argmax(jnp.flip(m, axis=1), axis=1)
    return jnp.where(jnp.any(m, axis=1), last, -1).astype(jnp.int32)


def response_extent(attention_mask: Array, response_width: int) -> Array:
    """[B] int32: how many response columns each row spans, its policy tokens and the tool
    results between them (the response part of ``attention_mask``, right-padded): the length
    a response budget and DAPO's overlong rule measure."""
    resp = jnp.asarray(attention_mask)[:, -response_width:] > 0
    t = resp.shape[1]
    last = t - 1 - jnp.argmax(jnp.flip(resp, axis=1), axis=1)
    return jnp.where(jnp.any(resp, axis=1), last + 1, 0).astype(jnp.int32)


def scores_on_last_token(scores: Array, response_mask: Array) -> Array:
    """[B] sequence scores -> [B, T], each on its row's last response (policy) token (0
    elsewhere, and everywhere in a row with no response token); see `last_token_index`."""
    m = mask_like(response_mask, scores)
    last = jax.nn.one_hot(last_token_index(response_mask), m.shape[1], dtype=m.dtype)
    return last * jnp.asarray(scores, m.dtype)[:, None]  # one_hot(-1) is all zeros


def varied_groups(scores: Array, index: Array, num_groups: int) -> Array:
    """DAPO's dynamic-sampling rule: which samples [B] (bool) belong to a group worth training.

    A group whose scores are all equal has zero advantage under a group-relative estimator and
    is dropped; a group of one is kept, as verl keeps it (its advantage is its own score).
    Equality is exact (max == min), so groups of identical float scores are always dropped.
    ``index`` holds dense group ids in [0, num_groups).
    """
    index = jnp.asarray(index).astype(jnp.int32)
    scores = jnp.asarray(scores, jnp.float32)
    hi = jax.ops.segment_max(scores, index, num_segments=num_groups)
    lo = jax.ops.segment_min(scores, index, num_segments=num_groups)
    count = jax.ops.segment_sum(jnp.ones_like(scores), index, num_segments=num_groups)
    keep = (hi > lo) | (count == 1)
    return keep[index]
