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
  kv heads (per tensor shard) divisible by s.
- "ring": each device keeps its T / s queries and the key / value blocks go round the axis
  with `ppermute`, s steps, each folded into a float32 online softmax. No condition on heads;
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
from jax.sharding import PartitionSpec as P

from hfjax.parallel import mesh as mesh_lib

MODES = ("ulysses", "ring")
AXIS = "sequence"


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
    n, k = num_heads // t, num_kv_heads // t
    if n % s or k % s:
        where = f" per tensor shard (tensor={t})" if t > 1 else ""
        return (f"{key}=ulysses splits attention heads over sequence={s}, but the model has "
                f"{n} query heads and {k} kv heads{where}, not both divisible by {s}; use "
                f"{key}=ring, or a sequence size that divides {math.gcd(n, k)}")
    return None


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
            return jax.lax.all_to_all(x, AXIS, split_axis=2, concat_axis=1, tiled=True)

        q, k, v = gather_tokens(q), gather_tokens(k), gather_tokens(v)
        W = q.shape[1]
        local_cfg = dataclasses.replace(cfg, num_heads=q.shape[2], num_kv_heads=k.shape[2])
        fn = local(local_cfg, **dict(zip(names, arrays, strict=True)))
        out = fn(q[:, :width], k[:, :width], v[:, :width])
        out = jnp.pad(out, [(0, 0), (0, W - width), (0, 0), (0, 0)])
        # [b, W, heads/s, H] -> [b, W/s, heads, H]
        return jax.lax.all_to_all(out, AXIS, split_axis=1, concat_axis=2, tiled=True)

    return body


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
        # Finite: a query that has seen no key yet keeps m at `lowest`, and exp(m - m_new) is
        # then a number, never NaN; masked scores are zeroed by `seen`, not by their value.
        lowest = jnp.finfo(jnp.float32).min

        def step(carry, r):
            kb, vb, m, total, acc = carry
            j = (i - r) % s  # the block this device holds at step r
            k_cols = j * C + jnp.arange(C)
            k_valid = jax.lax.dynamic_slice_in_dim(valid, j * C, C, axis=1)
            k_groups = jax.lax.dynamic_slice_in_dim(groups, j * C, C, axis=1)
            same = q_groups[:, :, None] == k_groups[:, None, :]
            if shared:
                same = same | (k_groups[:, None, :] == 0)
            seen = (same & k_valid[:, None, :] & (k_groups[:, None, :] >= 0)
                    & (k_cols[None, None, :] <= q_cols[None, :, None]))  # [b, C, C]
            seen = seen[:, None, None]  # [b, 1, 1, C, C]
            scores = jnp.einsum("bqkgh,bskh->bkgqs", qh, kb.astype(jnp.float32))
            scores = jnp.where(seen, scores, lowest)
            m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
            p = jnp.where(seen, jnp.exp(scores - m_new[..., None]), 0.0)
            corr = jnp.exp(m - m_new)
            total = total * corr + jnp.sum(p, axis=-1)
            acc = acc * corr[..., None] + jnp.einsum("bkgqs,bskh->bkgqh", p,
                                                     vb.astype(jnp.float32))
            kb = jax.lax.ppermute(kb, AXIS, perm)
            vb = jax.lax.ppermute(vb, AXIS, perm)
            return (kb, vb, m_new, total, acc), None

        init = (k, v, jnp.full((b, K, G, C), lowest), jnp.zeros((b, K, G, C)),
                jnp.zeros((b, K, G, C, H)))
        (_, _, _, total, acc), _ = jax.lax.scan(jax.checkpoint(step), init, jnp.arange(s))
        seen_any = total[..., None] > 0  # a padding query may see no key: output 0
        out = jnp.where(seen_any, acc / jnp.where(seen_any, total[..., None], 1.0), 0.0)
        return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, C, N, H).astype(q.dtype)

    return body
