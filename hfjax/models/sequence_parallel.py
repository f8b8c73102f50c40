"""Sequence parallelism: attention over rows whose token dimension is split over the mesh's
`sequence` axis.

Under a layout whose mesh has `sequence` > 1, the model's activations are [B, T, ...] with T
split over `sequence` (`hfjax.parallel.sharding.constrain`'s "length" axis): every
token-wise op (projections, norms, MLP, heads, log-probs) runs on T / s tokens per device.
Only attention needs the other shards' tokens, in one of two ways (`Layout.sequence_parallel`,
the config's `<role>.sequence_parallel`):

- "ulysses" (DeepSpeed-Ulysses): an all-to-all over `sequence` trades the token split for a
  head split, so each device holds whole rows for N / s query heads and K / s kv heads, runs
  the row's ordinary attention on them (`hfjax.models.attention`'s, whatever the pattern:
  causal, packed segments, shared-prompt rows), and a second all-to-all trades back. Needs the
  query heads (per tensor shard) divisible by s. When the kv heads are not (Qwen2.5-1.5B's 2
  on s = 4), each kv head is repeated s / gcd(K, s) times before the exchange, so that every
  device receives the kv heads its query heads read (as verl does for GQA); the query heads'
  grouping is kept, since K times that factor divides N.
- "ring": each device keeps its T / s queries and the key / value blocks go round the axis
  with `ppermute`, s steps, each folded into a float32 online softmax RING_K_BLOCK keys at a
  time (flash attention's memory: one [T / s, RING_K_BLOCK] score block, never T / s squared);
  a block whose columns all follow the device's queries is skipped (the causal mask empties
  it), so device d computes d + 1 of the s blocks: no placement balances them yet, and the
  last device's s steps set the pace. No condition on heads;
  the attention pattern is expressed as a mask from each column's group id: a key is seen
  when it is real, not after the query, and in the query's group (packed rows' segments) or,
  for shared-prompt rows, in group 0 (the prompt).

Both run under `jax.shard_map` over the whole mesh: batch over the data-parallel axes where it
divides, heads over `tensor` where it divides both head counts, tokens over `sequence`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from hfjax.parallel import mesh as mesh_lib

MODES = ("ulysses", "ring")
AXIS = "sequence"
# The name (`jax.ad_checkpoint.checkpoint_name`) of Ulysses' all-to-all results, for remat
# policies that keep them (`hfjax.models.transformer`).
EXCHANGED = "sequence_exchanged"


def sequence_size(layout) -> int:
    """How many ways `layout`'s mesh splits a row's tokens (1: no layout, or no `sequence`)."""
    if layout is None:
        return 1
    return int(layout.mesh.shape.get(AXIS, 1))


def padded_width(width: int, layout) -> int:
    """`width` rounded up to a multiple of the sequence size (the columns a split row has)."""
    s = sequence_size(layout)
    return -(-width // s) * s


def heads_problem(num_heads: int, num_kv_heads: int, mesh_shape, mode: str,
                  key: str = "sequence_parallel") -> str | None:
    """Why `mode` cannot split attention of these head counts on a mesh of `mesh_shape`
    ({axis: size}); None when it can."""
    if mode not in MODES:
        return f"{key}={mode!r}; choose one of {MODES}"
    s = int(mesh_shape.get(AXIS, 1))
    if s <= 1 or mode == "ring":
        return None
    t = _tensor_split(num_heads, num_kv_heads, mesh_shape)
    n = num_heads // t
    if n % s:
        where = f" per tensor shard (tensor={t})" if t > 1 else ""
        return (f"{key}=ulysses splits attention heads over sequence={s}, but the model has "
                f"{n} query heads{where}, not divisible by {s}; use {key}=ring, or a sequence "
                f"size that divides {n}")
    return None


def kv_repeats(num_kv_heads: int, s: int) -> int:
    """How many times Ulysses repeats each of a device's `num_kv_heads` kv heads before the
    all-to-all over `s` devices: the fewest that make them divisible by s."""
    return s // math.gcd(num_kv_heads, s)


def _tensor_split(num_heads: int, num_kv_heads: int, mesh_shape) -> int:
    t = int(mesh_shape.get("tensor", 1))
    return t if t > 1 and num_heads % t == 0 and num_kv_heads % t == 0 else 1


def _specs(layout, batch: int, num_heads: int, num_kv_heads: int):
    mesh = layout.mesh
    dp = mesh_lib.dp_axes(mesh)
    dp_n = math.prod(mesh.shape[a] for a in dp)
    b = (dp[0] if len(dp) == 1 else dp) if dp and batch % dp_n == 0 else None
    h = "tensor" if _tensor_split(num_heads, num_kv_heads, mesh.shape) > 1 else None
    return P(b, AXIS, h, None), P(b, None)


@dataclasses.dataclass(frozen=True)
class Pattern:
    """A row's attention pattern for ring attention: `groups` [B, T] (a key is seen by queries
    of its group; all zeros: causal rows) and whether group 0 is a prompt every query sees
    (`shared`)."""

    groups: jax.Array
    shared: bool = False


def attention(cfg, layout, width: int, local: Callable, masks: dict[str, jax.Array],
              pattern: Pattern | None):
    """fn(q [B, W, N, H], k, v [B, W, K, H]) -> [B, W, N, H] for rows of `width` real columns
    (W >= width: the split row's padded width), W split over `sequence`.

    `local(cfg, **masks)` builds the row's ordinary attention fn for a config (its head counts
    replaced by the per-device ones) from the mask arrays (each [B, width]); ring attention
    reads `masks["key_valid"]` and `pattern` instead."""
    mode = layout.sequence_parallel
    problem = heads_problem(cfg.num_heads, cfg.num_kv_heads, layout.mesh.shape, mode)
    if problem:
        raise ValueError(problem)
    s = sequence_size(layout)
    names = sorted(masks)

    def fn(q, k, v):
        B, W = q.shape[:2]
        Wp = -(-W // s) * s
        if Wp != W:
            q, k, v = (jnp.pad(x, [(0, 0), (0, Wp - W), (0, 0), (0, 0)]) for x in (q, k, v))
        qkv_spec, row_spec = _specs(layout, B, cfg.num_heads, cfg.num_kv_heads)
        if mode == "ulysses":
            body = _ulysses_body(cfg, local, names, width, s)
            arrays = [masks[n] for n in names]
        else:
            valid = masks["key_valid"].astype(bool)
            groups = (pattern.groups if pattern is not None
                      else jnp.zeros(valid.shape, jnp.int32)).astype(jnp.int32)
            pad = [(0, 0), (0, Wp - width)]
            arrays = [jnp.pad(valid, pad), jnp.pad(groups, pad, constant_values=-1)]
            body = _ring_body(s, bool(pattern is not None and pattern.shared))
        out = jax.shard_map(
            body, mesh=layout.mesh,
            in_specs=(qkv_spec, qkv_spec, qkv_spec, *[row_spec] * len(arrays)),
            out_specs=qkv_spec, check_vma=False)(q, k, v, *arrays)
        return out[:, :W]

    return fn


def _ulysses_body(cfg, local, names, width, s):
    def body(q, k, v, *arrays):
        def gather_tokens(x):  # [b, W/s, heads, H] -> [b, W, heads/s, H]
            return checkpoint_name(
                jax.lax.all_to_all(x, AXIS, split_axis=2, concat_axis=1, tiled=True),
                EXCHANGED)

        r = kv_repeats(k.shape[2], s)
        if r > 1:  # each kv head r times in a row: query head j still reads kv head j // G
            k, v = jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2)
        q, k, v = gather_tokens(q), gather_tokens(k), gather_tokens(v)
        W = q.shape[1]
        local_cfg = dataclasses.replace(cfg, num_heads=q.shape[2], num_kv_heads=k.shape[2])
        fn = local(local_cfg, **dict(zip(names, arrays, strict=True)))
        out = fn(q[:, :width], k[:, :width], v[:, :width])
        out = jnp.pad(out, [(0, 0), (0, W - width), (0, 0), (0, 0)])
        # [b, W, heads/s, H] -> [b, W/s, heads, H]
        return checkpoint_name(
            jax.lax.all_to_all(out, AXIS, split_axis=1, concat_axis=2, tiled=True), EXCHANGED)

    return body


# Keys per block of ring attention's inner loop: a step holds [b, K, G, T / s, RING_K_BLOCK]
# float32 scores, not [.., T / s, T / s] (7.5 GiB per array at configs/grpo_long.py's shapes).
RING_K_BLOCK = 512


def _ring_body(s: int, shared: bool):
    def body(q, k, v, valid, groups):
        b, C, N, H = q.shape
        K = k.shape[2]
        G = N // K
        i = jax.lax.axis_index(AXIS)
        q_cols = i * C + jnp.arange(C)
        q_groups = jax.lax.dynamic_slice_in_dim(groups, i * C, C, axis=1)  # [b, C]
        qh = q.reshape(b, C, K, G, H).astype(jnp.float32) / math.sqrt(H)
        perm = [(j, (j + 1) % s) for j in range(s)]
        kb = min(RING_K_BLOCK, C)
        nk = -(-C // kb)
        # Finite: a query that has seen no key yet keeps m at `lowest`, and exp(m - m_new) is
        # then a number, never NaN; masked scores are zeroed by `seen`, not by their value.
        lowest = jnp.finfo(jnp.float32).min

        def sub_block(carry, xs):  # one [C queries x kb keys] pair, folded in online
            m, total, acc = carry
            ks, vs, k_valid, k_groups, k_cols = xs  # [b, kb, K, H] x2, [b, kb] x2, [kb]
            same = q_groups[:, :, None] == k_groups[:, None, :]
            if shared:
                same = same | (k_groups[:, None, :] == 0)
            seen = (same & k_valid[:, None, :] & (k_groups[:, None, :] >= 0)
                    & (k_cols[None, None, :] <= q_cols[None, :, None]))  # [b, C, kb]
            seen = seen[:, None, None]  # [b, 1, 1, C, kb]
            scores = jnp.einsum("bqkgh,bskh->bkgqs", qh, ks.astype(jnp.float32))
            scores = jnp.where(seen, scores, lowest)
            m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
            p = jnp.where(seen, jnp.exp(scores - m_new[..., None]), 0.0)
            corr = jnp.exp(m - m_new)
            total = total * corr + jnp.sum(p, axis=-1)
            acc = acc * corr[..., None] + jnp.einsum("bkgqs,bskh->bkgqh", p,
                                                     vs.astype(jnp.float32))
            return (m_new, total, acc), None

        def block(carry, kv, j):  # the key / value block of shard j, kb keys at a time
            pad = nk * kb - C

            def split(x, fill=0):  # [b, C, ...] -> [nk, b, kb, ...]
                x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2),
                            constant_values=fill)
                return jnp.moveaxis(x.reshape((b, nk, kb) + x.shape[2:]), 1, 0)

            k_valid = jax.lax.dynamic_slice_in_dim(valid, j * C, C, axis=1)
            k_groups = jax.lax.dynamic_slice_in_dim(groups, j * C, C, axis=1)
            k_cols = (j * C + jnp.arange(nk * kb)).reshape(nk, kb)
            xs = (split(kv[0]), split(kv[1]), split(k_valid, False), split(k_groups, -1),
                  k_cols)
            carry, _ = jax.lax.scan(jax.checkpoint(sub_block), carry, xs)
            return carry

        def step(carry, r):
            kb_, vb_, m, total, acc = carry
            j = (i - r) % s  # the block this device holds at step r
            # A block of later columns than every query here is empty under the causal mask
            # (every pattern is causal): it is skipped, not computed and masked out.
            m, total, acc = jax.lax.cond(j <= i, lambda c: block(c, (kb_, vb_), j),
                                         lambda c: c, (m, total, acc))
            kb_ = jax.lax.ppermute(kb_, AXIS, perm)
            vb_ = jax.lax.ppermute(vb_, AXIS, perm)
            return (kb_, vb_, m, total, acc), None

        init = (k, v, jnp.full((b, K, G, C), lowest), jnp.zeros((b, K, G, C)),
                jnp.zeros((b, K, G, C, H)))
        (_, _, _, total, acc), _ = jax.lax.scan(jax.checkpoint(step), init, jnp.arange(s))
        seen_any = total[..., None] > 0  # a padding query may see no key: output 0
        out = jnp.where(seen_any, acc / jnp.where(seen_any, total[..., None], 1.0), 0.0)
        return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, C, N, H).astype(q.dtype)

    return body
