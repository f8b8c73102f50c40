"""The decode step: one new token per row against a per-layer KV cache.

The model's own forward pass (`Backbone` with a `KVCache`) serves prefill. For the one-token
decode step on CPU it leaves a lot of time on the table, for three reasons measured on
SmolLM2-135M (batch 16, 192 cache slots; see docs/benchmarks.md):

- scanning over stacked layers makes every step dynamic-slice (copy) each layer's weights before
  its matmuls, so the weights cross memory three times per step instead of once;
- a [layers, batch, slots, kv_heads, head_dim] cache makes attention transpose each layer's
  keys and values to a matmul-friendly layout on every step;
- even in [batch, kv_heads, slots, head_dim], the scores q.k contract the keys' last axis, a
  batched matmul against a transposed operand that XLA:CPU runs at about half the speed of the
  plain one (keys stored [batch, kv_heads, head_dim, slots]).

This module runs the model's own layer pieces (`attention_inputs`, `attend` and `layer_output`
of `hfjax.models.transformer`) with layers unrolled over weights sliced once per program call,
and keeps the cache per layer as keys [batch, kv_heads, head_dim, slots] and values [batch,
kv_heads, slots, head_dim]: both attention products are plain batched matmuls over the cache in
place, and each step writes one slot.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hfjax.models.config import ModelConfig
from hfjax.models.transformer import (
    KVCache,
    attend,
    attention_inputs,
    layer_output,
    rms_norm,
    rope_inv_freq,
    rope_tables,
    storage_dtype,
)
from hfjax.parallel import mesh as mesh_lib


class LayerCache(NamedTuple):
    """One layer's keys [rows, kv_heads, head_dim, slots] and values [rows, kv_heads, slots,
    head_dim], kept in the prefill cache's dtype
    (`hfjax.models.transformer.storage_dtype` of the compute dtype)."""

    k: jax.Array
    v: jax.Array


def split_layers(model) -> list[dict[str, jax.Array]]:
    """Each layer's parameter arrays (static slices of the stacked ones); returns one dict per
    layer. Call it inside a program but outside its decode loop: the slices are then made once
    per call, not once per step."""
    cfg = model.config
    stacked = model.model.layers.arrays()
    if cfg.jnp_dtype != cfg.jnp_param_dtype:
        # Every projection casts its weights to the compute dtype before use; casting once
        # here instead of inside the loop gives the same values and reads half the bytes per
        # step with bfloat16 compute over float32 weights. Norm scales and biases (a few KB)
        # stay as they are: each op casts them to its own operand's dtype.
        stacked = {k: v.astype(cfg.jnp_dtype) if k.endswith("_proj") else v
                   for k, v in stacked.items()}
    return [{k: v[i] for k, v in stacked.items()} for i in range(cfg.num_layers)]


def cache_and_row_shardings(mesh: Mesh, cfg: ModelConfig) -> tuple[NamedSharding, NamedSharding]:
    """(a decode cache layer's sharding, a per-row array's sharding) on `mesh`: rows over the
    data-parallel axes, kv-heads over `tensor` when it divides them."""
    rows = mesh_lib.batch_spec(mesh)
    row_axis = rows[0] if len(rows) else None
    tp = mesh.shape.get("tensor", 1)
    kv_axis = "tensor" if tp > 1 and cfg.num_kv_heads % tp == 0 else None
    return NamedSharding(mesh, P(row_axis, kv_axis)), NamedSharding(mesh, P(row_axis))


def cache_from_prefill(cache: KVCache, n: int, new_slots: int) -> tuple[LayerCache, ...]:
    """Per-layer decode cache from a prefill `KVCache` [layers, B, P, kv_heads, head_dim].

    Rows are repeated n times (row b * n + j is sample j of prompt b) and `new_slots` empty
    slots are appended after the P prompt slots. Returns one LayerCache per layer, keys
    [B * n, kv_heads, head_dim, P + new_slots] and values [B * n, kv_heads, P + new_slots,
    head_dim], in their storage dtype.
    """

    def convert(x: jax.Array, order: tuple[int, ...]) -> jax.Array:  # from [B, P, K, H]
        x = jnp.repeat(x, n, axis=0) if n > 1 else x
        x = jnp.transpose(x, order)
        slot_axis = order.index(1)
        return jnp.pad(x, [(0, new_slots if a == slot_axis else 0) for a in range(4)])

    return tuple(
        LayerCache(convert(cache.k[i], (0, 2, 3, 1)), convert(cache.v[i], (0, 2, 1, 3)))
        for i in range(cache.k.shape[0])
    )


def write(cache: jax.Array, x: jax.Array, at: tuple[jax.Array, ...]) -> jax.Array:
    """`cache` with x (cast to the cache's dtype) written at index `at`."""
    return jax.lax.dynamic_update_slice(cache, x.astype(cache.dtype), at)


def _layer(
    cfg: ModelConfig,
    rope: tuple[jax.Array, jax.Array],
    p: dict[str, jax.Array],
    h: jax.Array,
    valid: jax.Array,
    kv: LayerCache,
    slot: jax.Array,
) -> tuple[jax.Array, LayerCache]:
    """One decoder layer for h [R, 1, D]; returns (new h, the cache with `slot` written).

    Only the cache handling differs from the model's own layer; the projections, norms, RoPE,
    attention and MLP are `hfjax.models.transformer`'s.
    """
    rows, kv_heads, head_dim = h.shape[0], cfg.num_kv_heads, cfg.head_dim
    group = cfg.num_heads // kv_heads
    q, k, v = attention_inputs(cfg, rope, p, h)

    if slot.ndim == 0:
        zero = jnp.int32(0)
        # k, v are [R, 1, kv_heads, head_dim]: keys go in as [R, kv_heads, head_dim, 1].
        ck = write(kv.k, jnp.transpose(k, (0, 2, 3, 1)), (zero, zero, zero, slot))
        cv = write(kv.v, jnp.swapaxes(v, 1, 2), (zero, zero, slot, zero))
    else:
        # One slot per row (continuous batching: rows are at different token indices). The
        # row-wise slice update becomes a scatter whose rows are a batching dimension, so on a
        # data-parallel mesh each device writes its own rows with no communication.
        zero = jnp.zeros_like(slot)
        ck = jax.vmap(write)(kv.k, jnp.transpose(k, (0, 2, 3, 1)), (zero, zero, slot))
        cv = jax.vmap(write)(kv.v, jnp.swapaxes(v, 1, 2), (zero, slot, zero))

    qg = q[:, 0].reshape(rows, kv_heads, group, 1, head_dim)
    # q and the cache are both in the attention's dtype (`storage_dtype`).
    out = attend(qg, ck, cv, valid[:, None, None, None, :])
    # Heads flattened in (kv_head, group) order, which is the query-head order.
    attn = out.reshape(rows, 1, cfg.num_heads, head_dim)
    return layer_output(cfg, p, h, attn), LayerCache(ck, cv)


def decode_step(
    model,
    layers: list[dict[str, jax.Array]],
    tokens: jax.Array,
    positions: jax.Array,
    attn_mask: jax.Array,
    cache: tuple[LayerCache, ...],
    slot: jax.Array,
) -> tuple[jax.Array, tuple[LayerCache, ...]]:
    """Feeds tokens [R] at RoPE positions [R] into cache `slot` and attends over slots <= slot
    that `attn_mask` [R, slots] marks real.

    `slot` is one int32 index for every row, or one per row ([R]). `layers` comes from
    `split_layers(model)`. Returns (float32 logits [R, vocab], the cache with `slot` written in
    every layer).
    """
    cfg: ModelConfig = model.config
    slots = attn_mask.shape[1]
    slot = jnp.asarray(slot, jnp.int32)
    valid = attn_mask.astype(bool) & (jnp.arange(slots)[None, :] <= jnp.reshape(slot, (-1, 1)))
    h = model.model.embed(tokens[:, None])
    rope = rope_tables(positions[:, None], rope_inv_freq(cfg), storage_dtype(cfg.jnp_dtype), slots)
    new_cache = []
    for p, kv in zip(layers, cache):
        h, kv = _layer(cfg, rope, p, h, valid, kv, slot)
        new_cache.append(kv)
    h = rms_norm(h, model.model.norm[...], cfg.rms_norm_eps)
    return model.logits(h[:, 0]), tuple(new_cache)
