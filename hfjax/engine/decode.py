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

This module runs the model's own layer pieces (`attention_inputs` and `routed_layer_output` of
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

That layout and the full-width read are the CPU's. On GPUs and TPUs a step is bound by the
bytes it reads, and a rollout's early steps have written few of the response's columns, so
the step has three ways to read the cache (`DecodeOptions.attention`) and two layouts
(`DecodeOptions.layout`), resolved once per backend by `decode_options` ("auto" is chosen by
`hfjax.models.backend.decode_choice`):

- "full" (CPU, TPU): both parts over their whole width, columns past a row's own masked.
- "chunked": the response part in chunks of `chunk` columns, only as many as the
  furthest row has written (a loop with a dynamic trip count; the chunks' softmaxes merge by
  their maxima like the two parts'), so step t reads the prompt and about t columns.
- "pallas" (GPU; "auto" there): the Pallas GPU decode-attention kernel
  (`jax.experimental.pallas.ops.gpu.decode_attention.gqa`), once per part over each row's
  live range (left-padded prompt columns, response columns up to the row's own), merged by
  the kernel's residuals. Needs the "gpu" layout and left-padded prompts; a part whose width
  the kernel does not take (`pallas_blocks`) is read as "full" (prompt) or "chunked".

Layouts: "cpu" keeps keys [rows, kv_heads, head_dim, columns] and values [rows, kv_heads,
columns, head_dim] (both products plain batched matmuls on XLA:CPU); "gpu" keeps both as
[rows, columns, kv_heads, head_dim], the prefill cache's own layout (no transpose at the
fan-out, each step's column one contiguous write per row, the Pallas kernel's operand form).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hfjax.models import backend, moe
from hfjax.models.backend import storage_dtype
from hfjax.models.config import ModelConfig
from hfjax.models.rope import rope_inv_freq, rope_tables
from hfjax.models.transformer import (
    KVCache,
    attention_inputs,
    rms_norm,
    routed_layer_output,
)
from hfjax.parallel import mesh as mesh_lib
from hfjax.parallel import sharding as shd

# Response columns per chunk of the "chunked" read. A step reads at most chunk - 1 columns no
# row has written; smaller chunks mean more loop iterations, each a pair of small matmuls.
DECODE_CHUNK = 128


class DecodeOptions(NamedTuple):
    """How the decode step reads its cache and how the cache is laid out (module docstring):
    `attention` "full" | "chunked" | "pallas", `layout` "cpu" | "gpu", `chunk` response
    columns per chunk, `interpret` (tests only) runs the Pallas kernel in interpret mode
    where there is no GPU. The defaults are the CPU's."""

    attention: str = "full"
    layout: str = "cpu"
    chunk: int = DECODE_CHUNK
    interpret: bool = False


CPU_OPTIONS = DecodeOptions()


def decode_options(attention: str = "auto", layout: str = "auto", *,
                   chunk: int = DECODE_CHUNK, interpret: bool = False) -> DecodeOptions:
    """`rollout.decode_attention` and `rollout.kv_layout` resolved for the platform programs
    are compiled for, by `hfjax.models.backend.decode_choice` (where "auto" is decided).
    Raises ValueError for an unknown choice, a chunk < 1 or "pallas" with the "cpu" layout."""
    attention, layout = backend.decode_choice(attention, layout, interpret=interpret)
    if chunk < 1:
        raise ValueError(f"decode chunk={chunk}; it must be >= 1")
    return DecodeOptions(attention, layout, int(chunk), bool(interpret))


class LayerCache(NamedTuple):
    """One layer's cache, in the prefill cache's dtype (`hfjax.models.backend.storage_dtype`
    of the compute dtype): the prompt's keys and values, then the response's, each in the
    options' layout ("cpu": keys [rows, kv_heads, head_dim, columns], values [rows, kv_heads,
    columns, head_dim]; "gpu": both [rows, columns, kv_heads, head_dim]). Cache column c is
    prompt column c below the prompt's width and response column c - width from there."""

    prompt_k: jax.Array
    prompt_v: jax.Array
    k: jax.Array
    v: jax.Array


def cache_columns(kv: LayerCache, layout: str = "cpu") -> int:
    """Cache columns of one layer (prompt and response parts)."""
    if layout == "gpu":
        return kv.prompt_k.shape[1] + kv.k.shape[1]
    return kv.prompt_k.shape[-1] + kv.k.shape[-1]


def empty_cache(
    cfg: ModelConfig, rows: int, prompt: int, new: int, layout: str = "cpu"
) -> tuple[LayerCache, ...]:
    """A zeroed decode cache of `rows` rows, `prompt` prompt and `new` response columns in
    `layout`, for every layer."""
    shape, stored = (rows, cfg.num_kv_heads, cfg.head_dim), storage_dtype(cfg.jnp_dtype)
    return tuple(
        LayerCache(*_zeros(shape, prompt, stored, layout), *_zeros(shape, new, stored, layout))
        for _ in range(cfg.num_layers)
    )


def _zeros(shape: tuple[int, int, int], width: int, dtype,
           layout: str = "cpu") -> tuple[jax.Array, jax.Array]:
    """Zero keys and values of `width` columns in `layout` for `shape` = (rows, kv_heads,
    head_dim)."""
    rows, kv, hd = shape
    if layout == "gpu":
        return jnp.zeros((rows, width, kv, hd), dtype), jnp.zeros((rows, width, kv, hd), dtype)
    return jnp.zeros((rows, kv, hd, width), dtype), jnp.zeros((rows, kv, width, hd), dtype)


def fuses_for_layout() -> bool:
    """Whether `split_layers` fuses each layer's q/k/v and gate/up weights into one matrix for
    the active layout (`hfjax.models.backend.fuse_projections` decides, and says why)."""
    layout = shd.active_layout()
    return backend.fuse_projections(1 if layout is None else layout.mesh.shape.get("tensor", 1))


_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def split_layers(model, fuse: bool | None = None) -> list[dict[str, jax.Array]]:
    """Each layer's parameter arrays (static slices of the stacked ones); returns one dict per
    layer. Call it inside a program but outside its decode loop: the slices are then made once
    per call, not once per step.

    `fuse` (default: `fuses_for_layout()`) replaces q/k/v and gate/up by one `qkv_proj`
    [embed, (heads + 2 kv_heads) * head_dim] and one `gate_up_proj` [embed, 2 * mlp] weight,
    which `hfjax.models.transformer`'s layer pieces take in one matmul each."""
    cfg = model.config
    stacked = model.model.layers.arrays()
    if cfg.jnp_dtype != cfg.jnp_param_dtype:
        # Every projection casts its weights to the compute dtype before use; casting once
        # here instead of inside the loop gives the same values and reads half the bytes per
        # step with bfloat16 compute over float32 weights. Norm scales and biases (a few KB)
        # stay as they are: each op casts them to its own operand's dtype.
        stacked = {k: v.astype(cfg.jnp_dtype) if k.endswith("_proj") or k in moe.SPARSE_PARAMS
                   else v
                   for k, v in stacked.items()}
    # Unmerged LoRA adapters (`hfjax.models.lora`) apply per projection: no fusion then.
    adapters = any("_lora_" in k for k in stacked)
    if (fuses_for_layout() if fuse is None else fuse) and not adapters:
        D = cfg.hidden_size
        for fused, names in _FUSED.items():
            if all(n in stacked for n in names):  # a sparse model's dense layers may be none
                stacked[fused] = jnp.concatenate(
                    [(w := stacked.pop(n)).reshape(w.shape[0], D, -1) for n in names], axis=-1)
    # A mixture of experts stacks its dense MLP and its experts over different layers.
    return moe.layer_slices(cfg, stacked)


def cache_and_row_shardings(mesh: Mesh, cfg: ModelConfig,
                            layout: str = "cpu") -> tuple[NamedSharding, NamedSharding]:
    """(a decode cache layer's sharding in `layout`, a per-row array's sharding) on `mesh`:
    rows over the data-parallel axes, kv-heads over `tensor` when it divides them."""
    rows = mesh_lib.batch_spec(mesh)
    row_axis = rows[0] if len(rows) else None
    tp = mesh.shape.get("tensor", 1)
    kv_axis = "tensor" if tp > 1 and cfg.num_kv_heads % tp == 0 else None
    cache = P(row_axis, None, kv_axis) if layout == "gpu" else P(row_axis, kv_axis)
    return NamedSharding(mesh, cache), NamedSharding(mesh, P(row_axis))


def cache_from_prefill(cache: KVCache, n: int, new: int,
                       layout: str = "cpu") -> tuple[LayerCache, ...]:
    """Per-layer decode cache from a prefill `KVCache` [layers, B, P, kv_heads, head_dim].

    Rows are repeated n times (row b * n + j is sample j of prompt b); the P columns are the
    prompt's part and `new` empty columns the response's. Returns one LayerCache per layer, in
    the cache's storage dtype and `layout`.
    """
    shape = (cache.k.shape[1] * n, cache.k.shape[3], cache.k.shape[4])

    def convert(x: jax.Array, order: tuple[int, ...]) -> jax.Array:  # from [B, P, K, H]
        x = jnp.repeat(x, n, axis=0) if n > 1 else x
        return jnp.transpose(x, order)

    k_order, v_order = ((0, 1, 2, 3),) * 2 if layout == "gpu" else ((0, 2, 3, 1), (0, 2, 1, 3))
    return tuple(
        LayerCache(
            convert(cache.k[i], k_order),
            convert(cache.v[i], v_order),
            *_zeros(shape, new, cache.k.dtype, layout),
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
    q: jax.Array, keys: jax.Array, values: jax.Array, ok: jax.Array, acc: _Softmax | None,
    layout: str = "cpu",
) -> _Softmax:
    """`acc` (None: nothing read yet) merged with the keys and values of some columns in
    `layout` (LayerCache), for queries q [R, K, G, H]; `ok` [R, S] marks the columns each row
    attends to. Scores and softmax in float32, as `hfjax.models.attention.attend`."""
    gpu = layout == "gpu"
    s = jnp.einsum("bkqh,bskh->bkqs" if gpu else "bkqh,bkhs->bkqs", q, keys,
                   preferred_element_type=jnp.float32)
    s = jnp.where(ok[:, None, None, :], s / math.sqrt(q.shape[-1]), jnp.finfo(jnp.float32).min)
    top = jnp.max(s, axis=-1, keepdims=True)
    if acc is not None:
        top = jnp.maximum(acc.top, top)
    p = jnp.exp(s - top)
    total = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("bkqs,bskh->bkqh" if gpu else "bkqs,bksh->bkqh", p.astype(q.dtype), values,
                     preferred_element_type=jnp.float32)
    if acc is None:
        return _Softmax(top, total, out)
    scale = jnp.exp(acc.top - top)
    return _Softmax(top, acc.total * scale + total, acc.out * scale + out)


def _merge(acc: _Softmax | None, new: _Softmax) -> _Softmax:
    """Two softmax-weighted sums over disjoint columns as one."""
    if acc is None:
        return new
    top = jnp.maximum(acc.top, new.top)
    a, b = jnp.exp(acc.top - top), jnp.exp(new.top - top)
    return _Softmax(top, acc.total * a + new.total * b, acc.out * a + new.out * b)


def _read_chunked(q, keys, values, ok, acc, live: jax.Array, opts: DecodeOptions) -> _Softmax:
    """`_read` of the response part in chunks of `opts.chunk` columns, only the chunks below
    column `live` (a traced bound: the columns some row has written). The last chunk of a width
    that the chunk does not divide starts early; its columns already read are masked."""
    gpu = opts.layout == "gpu"
    width = keys.shape[1] if gpu else keys.shape[-1]
    c = min(opts.chunk, width)
    k_axis, v_axis = (1, 1) if gpu else (3, 2)

    def body(j, acc):
        start = jnp.minimum(j * c, width - c)
        kc = jax.lax.dynamic_slice_in_dim(keys, start, c, axis=k_axis)
        vc = jax.lax.dynamic_slice_in_dim(values, start, c, axis=v_axis)
        col = start + jnp.arange(c)
        okc = jax.lax.dynamic_slice_in_dim(ok, start, c, axis=1) & (col >= j * c)[None, :]
        return _read(q, kc, vc, okc, acc, opts.layout)

    # The first chunk is read outside the loop: the carry then has a maximum to start from.
    acc = body(0, acc)
    n = (jnp.minimum(live, width) + c - 1) // c
    return jax.lax.fori_loop(1, n, body, acc)


def pallas_blocks(width: int) -> tuple[int, int] | None:
    """(k_splits, block_k) of the Pallas decode kernel for a part of `width` columns, or None
    where the kernel cannot take it: it splits the columns into k_splits equal runs of at
    least 16, each read in blocks of block_k (Triton blocks are powers of two)."""
    for splits in (16, 8, 4, 2, 1):
        run = width // splits
        if width % splits == 0 and run >= 16 and run & (run - 1) == 0:
            return splits, min(run, 128)
    return None


def _read_pallas(q, keys, values, start: jax.Array, stop: jax.Array, acc: _Softmax | None,
                 opts: DecodeOptions) -> _Softmax:
    """The Pallas GPU decode-attention kernel over columns [start, stop) of each row of one
    part ("gpu" layout), as a `_Softmax` to merge with the other part's. The part's width must
    suit the kernel (`pallas_blocks`)."""
    from jax.experimental.pallas.ops.gpu import decode_attention

    R, K, G, H = q.shape
    splits, block = pallas_blocks(keys.shape[1])
    out, (total, top) = decode_attention.gqa(
        q.reshape(R, K * G, H), keys, values, start, stop, return_residuals=True,
        normalize_output=False, block_k=block, k_splits=splits, interpret=opts.interpret)
    part = _Softmax(top.reshape(R, K, G, 1).astype(jnp.float32),
                    total.reshape(R, K, G, 1).astype(jnp.float32),
                    out.reshape(R, K, G, H).astype(jnp.float32))
    return _merge(acc, part)


def _layer(
    cfg: ModelConfig,
    rope: tuple[jax.Array, jax.Array],
    p: dict[str, jax.Array],
    h: jax.Array,
    valid: jax.Array,
    kv: LayerCache,
    col: jax.Array,
    opts: DecodeOptions,
) -> tuple[jax.Array, LayerCache, moe.RouterStats | None]:
    """One decoder layer for h [R, 1, D]; returns (new h, the cache with response column `col`
    written, a sparse layer's router statistics or None).

    Only the cache handling differs from the model's own layer; the projections, norms, RoPE
    and MLP are `hfjax.models.transformer`'s.
    """
    rows, kv_heads, head_dim = h.shape[0], cfg.num_kv_heads, cfg.head_dim
    group = cfg.num_heads // kv_heads
    q, k, v = attention_inputs(cfg, rope, p, h)
    gpu = opts.layout == "gpu"

    if not gpu:
        # k, v are [R, 1, kv_heads, head_dim]: keys go in as [R, kv_heads, head_dim, 1].
        k, v = jnp.transpose(k, (0, 2, 3, 1)), jnp.swapaxes(v, 1, 2)
    zero = jnp.zeros_like(col)
    k_at = (zero, col, zero, zero) if gpu else (zero, zero, zero, col)
    v_at = (zero, col, zero, zero) if gpu else (zero, zero, col, zero)
    if col.ndim == 0:
        ck, cv = write(kv.k, k, k_at), write(kv.v, v, v_at)
    else:
        # One column per row (continuous batching: rows are at different token indices). The
        # row-wise slice update becomes a scatter whose rows are a batching dimension, so on a
        # data-parallel mesh each device writes its own rows with no communication.
        ck = jax.vmap(write)(kv.k, k, k_at[1:])
        cv = jax.vmap(write)(kv.v, v, v_at[1:])

    # q and the cache are both in the attention's dtype (`storage_dtype`).
    qg = q[:, 0].reshape(rows, kv_heads, group, head_dim)
    width = kv.prompt_k.shape[1] if gpu else kv.prompt_k.shape[-1]
    pallas = opts.attention == "pallas"
    if pallas and pallas_blocks(width):
        # Left-padded prompts: a row's real prompt columns are its last ones.
        first = width - jnp.sum(valid[:, :width], axis=1, dtype=jnp.int32)
        acc = _read_pallas(qg, kv.prompt_k, kv.prompt_v, first,
                           jnp.full((rows,), width, jnp.int32), None, opts)
    else:
        acc = _read(qg, kv.prompt_k, kv.prompt_v, valid[:, :width], None, opts.layout)
    if pallas and pallas_blocks(ck.shape[1]):
        stop = jnp.broadcast_to(col + 1, (rows,)).astype(jnp.int32)
        acc = _read_pallas(qg, ck, cv, jnp.zeros((rows,), jnp.int32), stop, acc, opts)
    elif opts.attention == "full":
        acc = _read(qg, ck, cv, valid[:, width:], acc, opts.layout)
    else:  # chunked, and Pallas on a width its kernel does not take
        acc = _read_chunked(qg, ck, cv, valid[:, width:], acc, jnp.max(col) + 1, opts)
    out = (acc.out / acc.total).astype(qg.dtype)
    # Heads flattened in (kv_head, group) order, which is the query-head order.
    attn = out.reshape(rows, 1, cfg.num_heads, head_dim)
    h, stats = routed_layer_output(cfg, p, h, attn)
    return h, kv._replace(k=ck, v=cv), stats


def decode_step(
    model,
    layers: list[dict[str, jax.Array]],
    tokens: jax.Array,
    positions: jax.Array,
    attn_mask: jax.Array,
    cache: tuple[LayerCache, ...],
    slot: jax.Array,
    options: DecodeOptions = CPU_OPTIONS,
) -> tuple[jax.Array, tuple[LayerCache, ...]]:
    """Feeds tokens [R] at RoPE positions [R] into cache column `slot` (a response column: at
    least the prompt's width) and attends over columns <= slot that `attn_mask` [R, columns]
    marks real.

    `slot` is one int32 index for every row, or one per row ([R]). `layers` comes from
    `split_layers(model)`; `options` says how the cache is read and laid out (the defaults are
    the CPU's). Returns (float32 logits [R, vocab], the cache with `slot` written in every
    layer).
    """
    cfg: ModelConfig = model.config
    slots = attn_mask.shape[1]
    slot = jnp.asarray(slot, jnp.int32)
    valid = attn_mask.astype(bool) & (jnp.arange(slots)[None, :] <= jnp.reshape(slot, (-1, 1)))
    pk = cache[0].prompt_k
    col = slot - (pk.shape[1] if options.layout == "gpu" else pk.shape[-1])
    h = model.model.embed(tokens[:, None])
    rope = rope_tables(positions[:, None], rope_inv_freq(cfg), storage_dtype(cfg.jnp_dtype), slots)
    new_cache, routed = [], []
    for p, kv in zip(layers, cache):
        h, kv, stats = _layer(cfg, rope, p, h, valid, kv, col, options)
        new_cache.append(kv)
        routed += [] if stats is None else [stats]
    # A mixture of experts' routing of the step's tokens, for an active `moe.collecting()`
    # (the sampler records the expert ids).
    moe.record(moe.stack(routed))
    h = rms_norm(h, model.model.norm[...], cfg.rms_norm_eps)
    return model.logits(h[:, 0]), tuple(new_cache)
