"""Prompts with images for the sampler (`hfjax.engine.sampler`): a vision-language policy's
image features, computed by its vision tower once per prompt, enter the prefill in place of
the placeholders' token embeddings, with M-RoPE positions; the prefill's cache fan-out then
shares them with the prompt's `n` samples, and decoded tokens continue at each row's M-RoPE
offset (`hfjax.models.qwen2_5_vl.mrope_positions`)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hfjax.models import qwen2_5_vl, vision
from hfjax.models.qwen2_5_vl import place_images

__all__ = ["ImagePrompts", "VisionPrompts", "place_images", "encode", "encode_together"]


class ImagePrompts(NamedTuple):
    """What the prefill program reads for prompts with images (left-padded to its bucket)."""

    features: jax.Array  # [N, D]: the tower's output for the batch's images, in order
    is_image: jax.Array  # [B, P] bool: the placeholder columns
    positions: jax.Array  # [3, B, P] int32: M-RoPE positions
    offsets: jax.Array  # [B] int32: decoded token j of a row sits at length + offset + j


class VisionPrompts(NamedTuple):
    """A request's images: the model's config, their patch grids (in placeholder order) and the
    tower's features for them (`encode`)."""

    config: qwen2_5_vl.VLConfig
    grids: np.ndarray
    features: jax.Array

    def place(self, ids: np.ndarray, mask: np.ndarray, batch: int) -> ImagePrompts:
        """The `ImagePrompts` of the sampler's padded prompt batch, whose rows past `batch`
        repeat the first prompt (padding to the data-parallel size): they get its images."""
        cfg, grids, features = self.config, [tuple(g) for g in self.grids], self.features
        first = int((ids[0][mask[0].astype(bool)] == cfg.image_token_id).sum())
        if len(ids) > batch and first:
            per_grid = np.cumsum([int(np.prod(g)) // cfg.vision.merge_unit for g in grids])
            n_grids = int(np.searchsorted(per_grid, first)) + 1
            copies = len(ids) - batch
            grids = grids + grids[:n_grids] * copies
            features = jnp.concatenate([features] + [features[:first]] * copies)
        positions, offsets = qwen2_5_vl.mrope_positions(cfg, ids, mask, grids)
        n_marks = int((ids[mask.astype(bool)] == cfg.image_token_id).sum())
        if n_marks != features.shape[0]:
            raise ValueError(f"the prompts hold {n_marks} image placeholders but the images "
                             f"give {features.shape[0]} features")
        return ImagePrompts(features, jnp.asarray((ids == cfg.image_token_id)
                                                  & mask.astype(bool)),
                            jnp.asarray(positions), jnp.asarray(offsets))


def encode(model: qwen2_5_vl.VisionLM, pixels: np.ndarray, grids) -> VisionPrompts:
    """Runs the vision tower once over a request's images (patches [N, patch_dim] of every
    prompt, in placeholder order), for all the samples the sampler will draw from them.

    Image by image: the images of one grid shape are stacked and the tower mapped over them
    (one program per shape), so attention costs each image its own patches squared, and the
    request's cost grows linearly with its images, not with the square of all their patches
    (`encode_together`, the tower over one list, gives the same features)."""
    cfg = model.config
    grids = np.asarray(grids, np.int64).reshape(-1, 3)
    sizes = grids.prod(-1)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    pieces = [None] * len(grids)
    for shape in sorted({tuple(g) for g in grids.tolist()}):
        which = [i for i, g in enumerate(grids.tolist()) if tuple(g) == shape]
        stacked = np.stack([pixels[starts[i]:starts[i + 1]] for i in which])
        lay = vision.layout(cfg.vision, [shape])
        features = _per_image(model.visual, jnp.asarray(stacked), lay)
        for j, i in enumerate(which):
            pieces[i] = features[j]
    features = (jnp.concatenate(pieces) if pieces else
                jnp.zeros((0, cfg.vision.out_hidden_size), jnp.dtype(cfg.vision.dtype)))
    return VisionPrompts(cfg, grids, features)


def encode_together(model: qwen2_5_vl.VisionLM, pixels: np.ndarray, grids) -> VisionPrompts:
    """`encode` as one tower call over all the images' patches (dense attention over the
    request's patches with a mask keeping each image to its own): the reference `encode`
    matches, and what bench/vision.py compares it with."""
    cfg = model.config
    lay = vision.layout(cfg.vision, grids)
    features = _tower(model.visual, jnp.asarray(pixels), lay)
    return VisionPrompts(cfg, np.asarray(grids), features)


@nnx.jit
def _tower(tower, pixels, lay):
    return tower(pixels, lay)


@nnx.jit
def _per_image(tower, stacked, lay):
    return jax.vmap(lambda px: tower(px, lay))(stacked)
