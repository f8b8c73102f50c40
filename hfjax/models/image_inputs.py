"""Image embeddings handed to the decoder's forward passes by the batch they score.

A vision-language policy's training batch carries, per row, the tower's features of the row's
images (`features` [B, K, D], in placeholder order, zero past the row's own) and every column's
M-RoPE positions (`positions` [B, 3, T]). A worker group traces its scoring and update passes
inside `given(...)`; the decoder (`hfjax.models.transformer.Backbone`) then puts each row's
features at its image placeholders and rotates by those positions, whichever function of the
row layout called it, as `hfjax.models.moe.given_routing` hands recorded routing to the same
passes. Only padded rows carry them: a pass that lays rows out otherwise (shared-prompt,
packed, sequence-split rows) is refused.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp


class GivenImages(NamedTuple):
    """What `given` hands the decoder: the placeholder id and the rows' features and
    positions (rows and columns as the pass's input ids)."""

    token_id: int
    features: jax.Array  # [B, K, D]
    positions: jax.Array  # [B, 3, T] int32


_GIVEN: contextvars.ContextVar[GivenImages | None] = contextvars.ContextVar(
    "hfjax_given_images", default=None)


@contextlib.contextmanager
def given(token_id: int, features: jax.Array | None,
          positions: jax.Array | None) -> Iterator[None]:
    """Within: each decoder forward pass traced without a cache and without its own `embeds`
    takes these rows' image features and M-RoPE positions. `features` None: nothing given."""
    value = None if features is None else GivenImages(token_id, features, positions)
    token = _GIVEN.set(value)
    try:
        yield
    finally:
        _GIVEN.reset(token)


def active() -> GivenImages | None:
    """The images `given` set, if any."""
    return _GIVEN.get()


def place_rows(embeds: jax.Array, is_image: jax.Array, features: jax.Array) -> jax.Array:
    """Token embeddings [B, T, D] whose image placeholders (`is_image` [B, T]) take, row by
    row, the row's features [B, K, D] in order (the k-th placeholder of row b: feature k)."""
    index = jnp.clip(jnp.cumsum(is_image, axis=1) - 1, 0, features.shape[1] - 1)
    placed = jnp.take_along_axis(features.astype(embeds.dtype), index[..., None], axis=1)
    return jnp.where(is_image[..., None], placed, embeds)


def spliced(embeds: jax.Array, input_ids: jax.Array, g: GivenImages):
    """(embeddings with the features placed, positions [3, B, T]) for a pass over
    `input_ids` [B, T]. ValueError when the given rows are not the pass's."""
    B, T = input_ids.shape
    if g.features.shape[0] != B or g.positions.shape[0] != B or g.positions.shape[2] != T:
        raise ValueError(f"image inputs of rows {g.positions.shape[0]} x {g.positions.shape[2]}"
                         f" columns for a pass over {B} x {T}: this row layout does not carry "
                         "images")
    embeds = place_rows(embeds, input_ids == g.token_id, g.features)
    return embeds, jnp.moveaxis(g.positions, 1, 0)
