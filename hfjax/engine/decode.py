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

This module runs the model's own layer pieces (`attention_inputs` and `layer_output` of
`hfjax.models.transformer`) with layers unrolled over weights sliced once per program call,
and keeps the cache per layer as keys [batch, kv_heads, head_dim, slots] and values [batch,
kv_heads, slots, head_dim]: both attention products are plain batched matmuls over the cache in
place, and each step writes one slot.

The cache is in two parts, each its own array: the prompt's columns, which the prefill writes
and decoding only reads, and the response's, where each step writes its token's column. A step
attends to both and merges the two softmaxes by their maxima. On the 2-core CPU a SmolLM2 step
over 192 prompt + 256 response columns takes 25% less time this way than over one 448-column
array at 32 rows (17% at 64, 4% more at 8), and a rollout 15% less (docs/benchmarks.md, "Where
a decode step's time goes"); the prompt's part is never written inside the decode loop.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hfjax.models.config import ModelConfig
from hfjax.models.transformer import (
    KVCache,
    attention_inputs,
    layer_output,
    rms_norm,
    rope_inv_freq,
    rope_tables,
    storage_dtype,
)
from hfjax.parallel import mesh as mesh_lib
from hfjax.parallel import sharding as shd


class LayerCache(NamedTuple):
    """One layer's cache, in the prefill cache's dtype (`hfjax.models.transformer.storage_dtype`
    of the compute dtype): the prompt's keys [rows, kv_heads, head_dim, prompt columns] and
    values [rows, kv_heads, prompt columns, head_dim], then the response's keys and values in
    the same layouts. Cache column c is prompt column c below the prompt's width and response
    column c - width from there."""

    prompt_k: jax.Array
    prompt_v: jax.Array
    k: jax.Array
    v: jax.Array

    @property
    def columns(self) -> int:
        return self.prompt_k.shape[-1] + self.k.shape[-1]


def empty_cache(
    cfg: ModelConfig, rows: int, prompt: int, new: int
) -> tuple[LayerCache, ...]:
    """A zeroed decode cache of `rows` rows, `prompt` prompt and `new` response columns, for
    every layer."""
    shape, stored = (rows, cfg.num_kv_heads, cfg.head_dim), storage_dtype(cfg.jnp_dtype)
    return tuple(
        LayerCache(*_zeros(shape, prompt, stored), *_zeros(shape, new, stored))
        for _ in range(cfg.num_layers)
    )


def _zeros(shape: tuple[int, int, int], width: int, dtype) -> tuple[jax.Array, jax.Array]:
    """Zero keys [rows, kv_heads, head_dim, width] and values [rows, kv_heads, width, head_dim]
    for `shape` = (rows, kv_heads, head_dim)."""
    rows, kv, hd = shape
    return jnp.zeros((rows, kv, hd, width), dtype), jnp.zeros((rows, kv, width, hd), dtype)


def fuse_projections() -> bool:
    """Whether `split_layers` fuses each layer's q/k/v and gate/up weights into one matrix:
    on GPUs and TPUs, where the decode layout has no `tensor` axis to split them over.

    XLA's GPU compiler merges dots that share an operand (x @ Wq, x @ Wk, x @ Wv) into one dot
    over concatenated weights, and inside the decode loop it concatenates those weights again
    on every step: on an H200 (Qwen2.5-1.5B, 512 rows) those copies took 23% of the decode
    loop's device time (docs/benchmarks.md, "Decode on an H200"). Concatenated once per rollout
    here, the loop runs the merged matmuls on weights that are already whole. On a tensor
    axis the concatenation would have to move shards between devices, and on CPU the separate
    matmuls are what XLA:CPU runs well, so both keep the separate weights."""
    if jax.default_backend() == "cpu":
        return False
    layout = shd.active_layout()
    return layout is None or layout.mesh.shape.get("tensor", 1) == 1


_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def split_layers(model, fuse: bool | None = None) -> list[dict[str, jax.Array]]:
    """Each layer's parameter arrays (static slices of the stacked ones); returns one dict per
    layer. Call it inside a program but outside its decode loop: the slices are then made once
    per call, not once per step.

    `fuse` (default: `fuse_projections()`) replaces q/k/v and gate/up by one `qkv_proj`
    [embed, (heads + 2 kv_heads) * head_dim] and one `gate_up_proj` [embed, 2 * mlp] weight,
    which `hfjax.models.transformer`'s layer pieces take in one matmul each."""
    cfg = model.config
    stacked = model.model.layers.arrays()
    if cfg.jnp_dtype != cfg.jnp_param_dtype:
        # Every projection casts its weights to the compute dtype before use; casting once
        # here instead of inside the loop gives the same values and reads half the bytes per
        # step with bfloat16 compute over float32 weights. Norm scales and biases (a few KB)
        # stay as they are: each op casts them to its own operand's dtype.
        stacked = {k: v.astype(cfg.jnp_dtype) if k.endswith("_proj") else v
                   for k, v in stacked.items()}
    if fuse_projections() if fuse is None else fuse:
        L, D = cfg.num_layers, cfg.hidden_size
        for fused, names in _FUSED.items():
            stacked[fused] = jnp.concatenate(
                [stacked.pop(n).reshape(L, D, -1) for n in names], axis=-1)
    return [{k: v[i] for k, v in stacked.items()} for i in range(cfg.num_layers)]


def cache_and_row_shardings(mesh: Mesh, cfg: ModelConfig) -> tuple[NamedSharding, NamedSharding]:
    """(a decode cache layer's sharding, a per-row array's sharding) on `mesh`: rows over the
    data-parallel axes, kv-heads over `tensor` when it divides them."""
    rows = mesh_lib.batch_spec(mesh)
    row_axis = rows[0] if len(rows) else None
    tp = mesh.shape.get("tensor", 1)
    kv_axis = "tensor" if tp > 1 and cfg.num_kv_heads % tp == 0 else None
    return NamedSharding(mesh, P(row_axis, kv_axis)), NamedSharding(mesh, P(row_axis))


def cache_from_prefill(cache: KVCache, n: int, new: int) -> tuple[LayerCache, ...]:
    """Per-layer decode cache from a prefill `KVCache` [layers, B, P, kv_heads, head_dim].

    Rows are repeated n times (row b * n + j is sample j of prompt b); the P columns are the
    prompt's part and `new` empty columns the response's. Returns one LayerCache per layer, in
    the cache's storage dtype.
    """
    shape = (cache.k.shape[1] * n, cache.k.shape[3], cache.k.shape[4])

    def convert(x: jax.Array, order: tuple[int, ...]) -> jax.Array:  # from [B, P, K, H]
        x = jnp.repeat(x, n, axis=0) if n > 1 else x
        return jnp.transpose(x, order)

    return tuple(
        LayerCache(
            convert(cache.k[i], (0, 2, 3, 1)),
            convert(cache.v[i], (0, 2, 1, 3)),
            *_zeros(shape, new, cache.k.dtype),
        )
        for i in range(cache.k.shape[0])
    )


def write(cache: jax.Array, x: jax.Array, at: tuple[jax.Array, ...]) -> jax.Array:
    """`cache` with x (cast to the cache's dtype) written at index `at`."""
    return jax.lax.dynamic_update_slice(cache, x.astype(cache.dtype), at)


class _Softmax(NamedTuple):
    """A softmax-weighted sum over the columns read so far: the scores' maximum, the sum of
    exp(score - maximum) and the values weighted by those exponentials."""

    top: jax.Array  # [R, K, G, 1]
    total: jax.Array  # [R, K, G, 1]
    out: jax.Array  # [R, K, G, H], float32


def _read(
    q: jax.Array, keys_t: jax.Array, values: jax.Array, ok: jax.Array, acc: _Softmax | None
) -> _Softmax:
    """`acc` (None: nothing read yet) merged with the keys [R, K, H, S] and values [R, K, S, H]
    of some columns, for queries q [R, K, G, H]; `ok` [R, S] marks the columns each row
    attends to. Scores and softmax in float32, as `hfjax.models.transformer.attend`."""
    s = jnp.einsum("bkqh,bkhs->bkqs", q, keys_t, preferred_element_type=jnp.float32)
    s = jnp.where(ok[:, None, None, :], s / math.sqrt(q.shape[-1]), jnp.finfo(jnp.float32).min)
    top = jnp.max(s, axis=-1, keepdims=True)
    if acc is not None:
        top = jnp.maximum(acc.top, top)
    p = jnp.exp(s - top)
    total = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("bkqs,bksh->bkqh", p.astype(q.dtype), values,
                     preferred_element_type=jnp.float32)
    if acc is None:
        return _Softmax(top, total, out)
    scale = jnp.exp(acc.top - top)
    return _Softmax(top, acc.total * scale + total, acc.out * scale + out)


def _layer(
    cfg: ModelConfig,
    rope: tuple[jax.Array, jax.Array],
    p: dict[str, jax.Array],
    h: jax.Array,
    valid: jax.Array,
    kv: LayerCache,
    col: jax.Array,
) -> tuple[jax.Array, LayerCache]:
    """One decoder layer for h [R, 1, D]; returns (new h, the cache with response column `col`
    written).

    Only the cache handling differs from the model's own layer; the projections, norms, RoPE
    and MLP are `hfjax.models.transformer`'s.
    """
    rows, kv_heads, head_dim = h.shape[0], cfg.num_kv_heads, cfg.head_dim
    group = cfg.num_heads // kv_heads
    q, k, v = attention_inputs(cfg, rope, p, h)

    # k, v are [R, 1, kv_heads, head_dim]: keys go in as [R, kv_heads, head_dim, 1].
    k, v = jnp.transpose(k, (0, 2, 3, 1)), jnp.swapaxes(v, 1, 2)
    if col.ndim == 0:
        zero = jnp.int32(0)
        ck = write(kv.k, k, (zero, zero, zero, col))
        cv = write(kv.v, v, (zero, zero, col, zero))
    else:
        # One column per row (continuous batching: rows are at different token indices). The
        # row-wise slice update becomes a scatter whose rows are a batching dimension, so on a
        # data-parallel mesh each device writes its own rows with no communication.
        zero = jnp.zeros_like(col)
        ck = jax.vmap(write)(kv.k, k, (zero, zero, col))
        cv = jax.vmap(write)(kv.v, v, (zero, col, zero))

    # q and the cache are both in the attention's dtype (`storage_dtype`).
    qg = q[:, 0].reshape(rows, kv_heads, group, head_dim)
    width = kv.prompt_k.shape[-1]
    acc = _read(qg, kv.prompt_k, kv.prompt_v, valid[:, :width], None)
    acc = _read(qg, ck, cv, valid[:, width:], acc)
    out = (acc.out / acc.total).astype(qg.dtype)
    # Heads flattened in (kv_head, group) order, which is the query-head order.
    attn = out.reshape(rows, 1, cfg.num_heads, head_dim)
    return layer_output(cfg, p, h, attn), kv._replace(k=ck, v=cv)


def decode_step(
    model,
    layers: list[dict[str, jax.Array]],
    tokens: jax.Array,
    positions: jax.Array,
    attn_mask: jax.Array,
    cache: tuple[LayerCache, ...],
    slot: jax.Array,
) -> tuple[jax.Array, tuple[LayerCache, ...]]:
    """Feeds tokens [R] at RoPE positions [R] into cache column `slot` (a response column: at
    least the prompt's width) and attends over columns <= slot that `attn_mask` [R, columns]
    marks real.

    `slot` is one int32 index for every row, or one per row ([R]). `layers` comes from
    `split_layers(model)`. Returns (float32 logits [R, vocab], the cache with `slot` written in
    every layer).
    """
    cfg: ModelConfig = model.config
    slots = attn_mask.shape[1]
    slot = jnp.asarray(slot, jnp.int32)
    valid = attn_mask.astype(bool) & (jnp.arange(slots)[None, :] <= jnp.reshape(slot, (-1, 1)))
    col = slot - cache[0].prompt_k.shape[-1]
    h = model.model.embed(tokens[:, None])
    rope = rope_tables(positions[:, None], rope_inv_freq(cfg), storage_dtype(cfg.jnp_dtype), slots)
    new_cache = []
    for p, kv in zip(layers, cache):
        h, kv = _layer(cfg, rope, p, h, valid, kv, col)
        new_cache.append(kv)
    h = rms_norm(h, model.model.norm[...], cfg.rms_norm_eps)
    return model.logits(h[:, 0]), tuple(new_cache)
