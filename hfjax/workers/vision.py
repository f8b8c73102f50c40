"""A vision-language policy's images in the worker groups (docs/vision.md, "Training").

The rollout runs the vision tower once per prompt (`tower_rows` over the prompts' patches) and
the batch then carries, per row, what every later pass needs (`IMAGES`):
- `image_features` [B, K, D]: the tower's output for the row's images in placeholder order
  (zero past them), repeated for the prompt's `rollout.n` samples, not recomputed;
- `mrope_positions` [B, 3, T]: each column's M-RoPE positions (`joined_positions`);
- only while the tower trains (`actor.freeze_vision=False`): the row's patches and their
  layout (`image_patches`, `image_layout`, `image_order`), from which a group whose model
  holds the tower recomputes the features inside its pass, so gradients reach the tower.

A group traces its passes inside `seeing(...)` (`hfjax.models.image_inputs.given`): the
actor's log-probs and update, the reference and a critic then see the same image embeddings
the sampler's prefill put in the cache. A frozen tower is not part of the actor's parameters
at all: no optimizer state, and the hybrid engine never moves it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from PIL import Image

from hfjax.controller.batch import Batch
from hfjax.data import batching
from hfjax.data import images as image_data
from hfjax.data.dataset import render_prompt
from hfjax.engine.images import VisionPrompts
from hfjax.models import image_inputs, vision
from hfjax.models.qwen2_5_vl import VLConfig, mrope_positions
from hfjax.parallel.transfer import transfer

# The batch arrays of a vision-language rollout (see the module docstring).
FEATURES = ("image_features", "mrope_positions")
PIXELS = ("image_patches", "image_layout", "image_order")
IMAGES = FEATURES + PIXELS
# What a host prompt batch carries for its images (`prompt_images`).
HOST = ("image_patches", "image_grids")


def images_of(arrays) -> dict:
    """The image arrays (`IMAGES`) among a batch's or micro-batch's arrays."""
    return {k: arrays[k] for k in IMAGES if k in arrays}


def prompt_images(cfg: VLConfig, pictures, blank: bool = False) -> dict[str, np.ndarray]:
    """Host arrays of the prompts' pictures (one list of images per prompt, as the dataset's
    `images` hold them): `image_patches` [B, N, patch_dim] (each row's patches, zero past
    them) and `image_grids` [B, G, 3] (each row's grids in placeholder order, zero past
    them). `blank`: every picture replaced by a white one of its size (the control that shows
    what a policy learns without seeing)."""
    v = cfg.vision
    per_row = []
    for row in pictures:
        if blank:
            row = [Image.new("RGB", image_data.open_image(p).size, "white") for p in row]
        if len(row):
            per_row.append(image_data.preprocess(
                row, patch_size=v.patch_size, merge_size=v.spatial_merge_size,
                temporal_patch_size=v.temporal_patch_size))
        else:
            per_row.append((np.zeros((0, v.patch_dim), np.float32), np.zeros((0, 3), np.int64)))
    n = max(max(len(p) for p, _ in per_row), v.merge_unit)
    g = max(max(len(gr) for _, gr in per_row), 1)
    patches = np.zeros((len(per_row), n, v.patch_dim), np.float32)
    grids = np.zeros((len(per_row), g, 3), np.int64)
    for b, (p, gr) in enumerate(per_row):
        patches[b, :len(p)], grids[b, :len(gr)] = p, gr
    return {"image_patches": patches, "image_grids": grids}


def row_grids(grids: np.ndarray) -> list[list[tuple[int, int, int]]]:
    """Each row's image grids, without the zero padding."""
    return [[tuple(int(x) for x in g) for g in row if g[0] > 0] for row in np.asarray(grids)]


def row_layouts(cfg: vision.VisionConfig, grids: np.ndarray, n_patches: int):
    """(layout [B, N, 4]: each patch's row, column, window and frame; order [B, N / merge
    unit]: its merged units in window order) of each row's images (`vision.layout`), for
    `tower_rows`. Patches past a row's own attend only to themselves."""
    rows = row_grids(grids)
    u = cfg.merge_unit
    layout = np.zeros((len(rows), n_patches, 4), np.int32)
    order = np.tile(np.arange(n_patches // u, dtype=np.int32), (len(rows), 1))
    pad = -1 - np.arange(n_patches, dtype=np.int32)  # a segment of its own per padding patch
    for b, gr in enumerate(rows):
        layout[b, :, 2] = layout[b, :, 3] = pad
        if not gr:
            continue
        lay = vision.layout(cfg, gr)
        n = len(lay.positions)
        layout[b, :n, :2] = lay.positions
        layout[b, :n, 2], layout[b, :n, 3] = lay.window_segments, lay.frame_segments
        order[b, :n // u] = lay.window_order
    return layout, order


def tower_rows(tower: vision.VisionTower, patches, layout, order) -> jax.Array:
    """The tower's features [B, N / merge unit, D] of each row's patches [B, N, patch_dim],
    row by row (a row's patches attend within the row only)."""
    def one(px, lay, odr):
        return tower(px, vision.VisionLayout(lay[:, :2], odr, lay[:, 2], lay[:, 3]))

    return jax.vmap(one)(patches, layout, order)


def flat_index(grids: np.ndarray, merge_unit: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, slot) of every image feature of the batch in placeholder order: what the
    sampler's prefill takes as one [N, D] list (`hfjax.engine.images.VisionPrompts`)."""
    rows, slots = [], []
    for b, gr in enumerate(row_grids(grids)):
        k = sum(int(np.prod(g)) // merge_unit for g in gr)
        rows += [b] * k
        slots += range(k)
    return np.asarray(rows, np.int32), np.asarray(slots, np.int32)


def joined_positions(cfg: VLConfig, prompts, prompt_mask, grids, response_len: int):
    """M-RoPE positions [B, 3, P + R] (int32) of left-padded prompts [B, P] followed by R
    response columns: the prompt's from its layout (`mrope_positions`), response token j at
    the row's next position + j, all three components equal (as the sampler decodes)."""
    flat = [g for row in row_grids(grids) for g in row]
    pos, offsets = mrope_positions(cfg, prompts, prompt_mask, flat)
    n_real = np.asarray(prompt_mask).astype(bool).sum(1)
    start = (n_real + offsets)[:, None] + np.arange(response_len)[None]
    resp = np.broadcast_to(start[None], (3, *start.shape))
    return np.moveaxis(np.concatenate([pos, resp], axis=2), 0, 1).astype(np.int32)


def seeing(name: str, cfg: VLConfig | None, model, images: dict):
    """The context a group traces a pass of `model` over rows with `images` in
    (`image_inputs.given`): the features the batch carries, or, when `model` holds the tower
    (it trains), the tower's features of the rows' patches. No images: no context. ValueError
    for images sent to a text-only group."""
    if not images:
        return contextlib.nullcontext()
    if cfg is None:
        raise ValueError(f"{name}: a batch with images for a text-only model; train a "
                         "vision-language model (model.vision) or drop the images")
    features = images["image_features"]
    tower = getattr(model, "visual", None)
    if tower is not None:
        if "image_patches" not in images:
            raise ValueError(f"{name} trains its vision tower, but the batch carries no "
                             "image_patches (the rollout adds them with freeze_vision=False)")
        features = tower_rows(tower, images["image_patches"], images["image_layout"],
                              images["image_order"])
    return image_inputs.given(cfg.image_token_id, features, images["mrope_positions"])


def check_rows(name: str, *, packed: bool, grouped: bool, samples: int, mesh) -> None:
    """Refuses, in one line, a row layout that does not carry images (only padded rows do)."""
    bad = [k for k, on in (("use_remove_padding", packed), ("group_by_length", grouped),
                           ("share_prompt", samples > 1),
                           ("a mesh with sequence > 1", mesh.shape.get("sequence", 1) > 1))
           if on]
    if bad:
        raise ValueError(f"{name}: rows with images are scored as padded rows only; turn off "
                         f"{', '.join(bad)}")


@dataclasses.dataclass
class Tower:
    """An actor's vision tower: `trains` when it is the model's own `visual` (part of the
    params, `actor.freeze_vision=False`), else frozen beside the params, in the actor's
    layout; `encode` runs it over a prompt batch's rows (`tower_rows`)."""

    trains: bool
    frozen: Any  # the frozen tower's state, or None
    encode: Callable

    @classmethod
    def of(cls, group, frozen: nnx.Module | None) -> Tower | None:
        """The tower of `group` (an actor): `frozen`, or the model's own; None for neither."""
        own = getattr(group.model(), "visual", None)
        if own is None and frozen is None:
            return None
        if group.vl is None:
            raise ValueError(f"{group.name}: a vision tower needs the model's VLConfig (vl=)")
        if own is not None and frozen is not None:
            raise ValueError(f"{group.name}: the model holds a vision tower already; a frozen "
                             "one goes only beside a language model without one")
        graphdef, state = nnx.split(own if frozen is None else frozen)
        if frozen is not None:
            state = jax.tree.map(lambda sh, v: v.replace(_place(v.get_value(), sh)),
                                 group.layout.state_shardings(state), state,
                                 is_leaf=lambda x: isinstance(x, nnx.Variable))
        encode = group.jit(lambda t, px, lay, odr: tower_rows(nnx.merge(graphdef, t), px, lay,
                                                              odr))
        return cls(own is not None, None if own is not None else state, encode)

    def state(self, params):
        """The tower's parameters now (out of the actor's `params` when it trains)."""
        return params["visual"] if self.trains else self.frozen


def _place(x, sharding):
    """`x` on `sharding`; an abstract leaf (the dry run's model) stays abstract there."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return transfer(x, sharding)


def abstract_prompts(group, prompts: int, max_prompt_length: int) -> tuple:
    """Abstract (tower state, patches, layout, order) of the actor's `encode` for `prompts`
    prompts whose every token could be an image token (the most patches `max_prompt_length`
    allows): what the dry run compiles the tower's program with."""
    v = group.vl.vision
    n = max_prompt_length * v.merge_unit
    # As `prompt_features` places them: split over the data-parallel devices, or everywhere
    # when the prompts do not divide.
    split = group.abstract_rows(prompts, n).sharding
    if prompts % group.dp_size:
        split = NamedSharding(group.mesh, P())
    shapes = ((n, v.patch_dim, jnp.float32), (n, 4, jnp.int32), (n // v.merge_unit, jnp.int32))
    arrays = [jax.ShapeDtypeStruct((prompts, *s[:-1]), s[-1], sharding=split) for s in shapes]
    return (group.tower.state(group.params), *arrays)


def prompt_features(group, batch: Batch):
    """(the sampler's `VisionPrompts`, the per-prompt arrays the rollout batch carries) of a
    host prompt batch with images (`HOST`), the actor's tower run once per prompt; None for
    a batch without images. ValueError for images sent to a text-only actor."""
    if "image_grids" not in batch:
        return None
    if group.tower is None:
        raise ValueError(f"{group.name}: prompts with images for a text-only model; train a "
                         "vision-language model or drop the images")
    v = group.vl.vision
    patches, grids = batch["image_patches"], batch["image_grids"]
    layout, order = row_layouts(v, grids, patches.shape[1])
    rows, slots = flat_index(grids, v.merge_unit)
    axes = None if len(patches) % group.dp_size == 0 else ()
    # The prompts' pictures: the rollout's deliberate upload, as its prompts are.
    with jax.transfer_guard("allow"):
        placed = Batch({"image_patches": patches, "image_layout": layout,
                        "image_order": order}).to(group.mesh, batch_axes=axes)
        features = group.tower.encode(group.tower.state(group.params), *placed.arrays.values())
        flat = features[rows, slots]
    flat_grids = np.asarray([g for row in row_grids(grids) for g in row]).reshape(-1, 3)
    carried = {"image_features": features}
    if group.tower.trains:
        carried |= placed.arrays
    return VisionPrompts(group.vl, flat_grids, flat), carried


def rollout_rows(group, batch: Batch, carried: dict, n: int, response_len: int) -> dict:
    """The rollout batch's image arrays (`IMAGES`): the prompts' `carried` arrays repeated for
    their n samples (interleaved, as the rows are), and every column's M-RoPE positions."""
    pos = joined_positions(group.vl, batch["prompts"], batch["prompt_mask"],
                           batch["image_grids"], response_len)
    with jax.transfer_guard("allow"):  # built on the host from the host prompts
        pos = Batch({"mrope_positions": np.repeat(pos, n, axis=0)}).to(group.mesh)
    return {k: jnp.repeat(x, n, axis=0) for k, x in carried.items()} | dict(pos.arrays)


def prompts(rows, seeds: np.ndarray, pad_id: int, max_prompt_length: int, tokenizer,
            cfg: VLConfig | None, blank: bool = False) -> Batch:
    """The host prompt batch of dataset rows (`batching.prompt_batch`); for a vision-language
    policy (`cfg`), with each row's pictures (`prompt_images`, blanked with `blank`) and its
    `<image>` placeholders written out as the pictures' image tokens before the prompt is
    tokenized."""
    if cfg is None:
        return batching.prompt_batch(rows, seeds, pad_id, max_prompt_length)
    host = prompt_images(cfg, [r.get("images") or [] for r in rows], blank)
    unit = cfg.vision.merge_unit
    written = [r | {"prompt_ids": render_prompt(tokenizer, image_data.expand_placeholders(
        r["prompt"], [int(np.prod(g)) // unit for g in grids]))}
        for r, grids in zip(rows, row_grids(host["image_grids"]))]
    longest = max(len(r["prompt_ids"]) for r in written)
    if longest > max_prompt_length:
        raise ValueError(f"a prompt with its image tokens has {longest} tokens, over "
                         f"data.max_prompt_length={max_prompt_length}; raise it")
    return batching.prompt_batch(written, seeds, pad_id, max_prompt_length).union(Batch(host))


def sft_batches(group, tokenizer, rows, responses, *, batch_size: int, steps: int, seed: int,
                max_prompt_length: int, response_width: int, blank: bool = False):
    """`steps` supervised batches of `batch_size` (row, response text) pairs drawn from `rows`
    with their pictures, for the actor `group`'s warm start (`update_sft`): each batch's
    prompts (`prompts`), responses ending in the end token, and the image arrays the tower
    gives them (`prompt_features`, `rollout_rows` with one sample)."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        idx = rng.choice(len(rows), batch_size, replace=False)
        host = prompts([rows[i] for i in idx], np.zeros(batch_size), tokenizer.pad_id,
                       max_prompt_length, tokenizer, group.vl, blank)
        resp = [tokenizer.encode(responses[i], add_special_tokens=False)[:response_width - 1]
                + [tokenizer.eos_id] for i in idx]
        rid, rmask = batching.right_pad(resp, response_width, tokenizer.pad_id)
        _, carried = prompt_features(group, host)
        images = rollout_rows(group, host, carried, 1, response_width)
        yield Batch({"input_ids": np.concatenate([host["prompts"], rid], 1),
                     "attention_mask": np.concatenate([host["prompt_mask"], rmask], 1),
                     "responses": rid, "response_mask": rmask}).union(Batch(images))
