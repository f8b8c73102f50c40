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
  time (flash attention's memory: one [T / 2s, RING_K_BLOCK] score block, never T / s
  squared). The row's 2s half-shards are placed zig-zag (device d holds half-shards d and
  2s - 1 - d, moved there and back by two `ppermute`s each way; the remat policies that keep
  matmul outputs keep the placed q, k, v and the output moved home, as they keep Ulysses'
  exchanges, so a recomputed layer does not move them again), and a pair of half-shards
  whose keys all follow the queries is skipped (the causal mask empties it), so every device
  computes 2s + 1 of the 4 s^2 pairs: equal work, none of it masked out whole. No condition
  on heads;
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
# The name (`jax.ad_checkpoint.checkpoint_name`) of what a scheme moved to run attention (Ulysses'
# all-to-all results; ring's zig-zag-placed q, k, v and its output moved home), for remat
# policies that keep them (`hfjax.models.transformer`): recomputing them would move them again.
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


# Keys per block of ring attention's inner loop: a step holds [b, K, G, T / 2s, RING_K_BLOCK]
# float32 scores, not [.., T / s, T / s] (7.5 GiB per array at configs/grpo_long.py's shapes).
RING_K_BLOCK = 512
# Zig-zag placement: a row's 2s half-shards ("chunks") are placed so that device d holds chunks
# d and 2s - 1 - d, an early and a late one; every device then computes 2s + 1 of the 4 s^2
# chunk pairs (the causally empty ones skipped), where the plain placement (device d: chunks
# 2d, 2d + 1) has device d compute 4d + 3 and the last device 4s - 1 (bench/sequence_parallel.py
# sets False to compare).
RING_BALANCED = True


def ring_chunks(d, s: int, balanced: bool):
    """The two chunks (of the row's 2s, in column order) device d holds in ring attention."""
    if balanced:
        return d, 2 * s - 1 - d
    return 2 * d, 2 * d + 1


def ring_pairs(s: int, balanced: bool) -> list[int]:
    """Chunk pairs (query chunk x key chunk) each of s devices computes per ring attention: the
    pairs whose key chunk does not follow the query chunk (the others the causal mask empties,
    and the ring body skips them by the same test)."""
    return [sum(kc <= qc for qc in ring_chunks(d, s, balanced)
                for j in range(s) for kc in ring_chunks(j, s, balanced)) for d in range(s)]


def _ring_body(s: int, shared: bool, balanced: bool | None = None):
    balanced = RING_BALANCED if balanced is None else balanced

    def body(q, k, v, valid, groups):
        b, C, N, H = q.shape
        K = k.shape[2]
        G = N // K
        h = -(-C // 2)  # a chunk: half a device's columns (the second half padded when C is odd)
        i = jax.lax.axis_index(AXIS)

        def halves(x):  # [b, C, ...] -> ([b, h, ...], [b, h, ...]), the device's own chunks
            x = jnp.pad(x, [(0, 0), (0, 2 * h - C)] + [(0, 0)] * (x.ndim - 2))
            return x[:, :h], x[:, h:]

        # Zig-zag: chunk c (device c // 2's half c % 2) goes to device c if c < s, else to
        # 2s - 1 - c. Device d receives one even chunk and one odd one (d + 2s - 1 - d is odd),
        # so two permutations place them; the inverse ones bring the outputs home.
        dest = [c if c < s else 2 * s - 1 - c for c in range(2 * s)]
        to_even = [(j, dest[2 * j]) for j in range(s)]
        to_odd = [(j, dest[2 * j + 1]) for j in range(s)]
        d_even = i % 2 == 0  # then the device's lower chunk (d) is the even one

        def place(x):  # own chunks -> (lower, upper) chunk of the placement
            lo, hi = halves(x)
            if not balanced:
                return lo, hi
            ev = jax.lax.ppermute(lo, AXIS, to_even)
            od = jax.lax.ppermute(hi, AXIS, to_odd)
            return (checkpoint_name(jnp.where(d_even, ev, od), EXCHANGED),
                    checkpoint_name(jnp.where(d_even, od, ev), EXCHANGED))

        def unplace(lo, hi):  # inverse of place: [b, C, ...]
            if balanced:
                ev, od = jnp.where(d_even, lo, hi), jnp.where(d_even, hi, lo)
                lo = jax.lax.ppermute(ev, AXIS, [(t, f) for f, t in to_even])
                hi = jax.lax.ppermute(od, AXIS, [(t, f) for f, t in to_odd])
                return checkpoint_name(jnp.concatenate([lo, hi], axis=1)[:, :C], EXCHANGED)
            return jnp.concatenate([lo, hi], axis=1)[:, :C]

        def chunk_cols(c):  # chunk c's columns, and which of its h slots are real columns
            slot = (c % 2) * h + jnp.arange(h)
            return (c // 2) * C + slot, slot < C

        def chunk_masks(c):  # [b, h] key validity and group ids of chunk c's columns
            cols, real = chunk_cols(c)
            at = jnp.minimum(cols, valid.shape[1] - 1)
            k_valid = jnp.take(valid, at, axis=1) & real[None]
            k_groups = jnp.where(real[None], jnp.take(groups, at, axis=1), -1)
            return cols, k_valid, k_groups

        q_chunks = ring_chunks(i, s, balanced)
        q_lo, q_hi = place(q)
        queries = []
        for c, x in zip(q_chunks, (q_lo, q_hi), strict=True):
            cols, _, grp = chunk_masks(c)
            queries.append((c, cols, grp, x.reshape(b, h, K, G, H).astype(jnp.float32)
                            / math.sqrt(H)))
        perm = [(j, (j + 1) % s) for j in range(s)]
        kb = min(RING_K_BLOCK, h)
        nk = -(-h // kb)
        # Finite: a query that has seen no key yet keeps m at `lowest`, and exp(m - m_new) is
        # then a number, never NaN; masked scores are zeroed by `seen`, not by their value.
        lowest = jnp.finfo(jnp.float32).min

        def fold(carry, query, kv, c):  # key chunk c into one query chunk, kb keys at a time
            _, q_cols, q_groups, qh = query

            def sub_block(carry, xs):  # one [h queries x kb keys] pair, folded in online
                m, total, acc = carry
                ks, vs, k_valid, k_groups, k_cols = xs  # [b, kb, K, H] x2, [b, kb] x2, [kb]
                same = q_groups[:, :, None] == k_groups[:, None, :]
                if shared:
                    same = same | (k_groups[:, None, :] == 0)
                seen = (same & k_valid[:, None, :] & (k_groups[:, None, :] >= 0)
                        & (k_cols[None, None, :] <= q_cols[None, :, None]))  # [b, h, kb]
                seen = seen[:, None, None]  # [b, 1, 1, h, kb]
                scores = jnp.einsum("bqkgh,bskh->bkgqs", qh, ks.astype(jnp.float32))
                scores = jnp.where(seen, scores, lowest)
                m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
                p = jnp.where(seen, jnp.exp(scores - m_new[..., None]), 0.0)
                corr = jnp.exp(m - m_new)
                total = total * corr + jnp.sum(p, axis=-1)
                acc = acc * corr[..., None] + jnp.einsum("bkgqs,bskh->bkgqh", p,
                                                         vs.astype(jnp.float32))
                return (m_new, total, acc), None

            pad = nk * kb - h

            def split(x, fill=0):  # [b, h, ...] -> [nk, b, kb, ...]
                x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2),
                            constant_values=fill)
                return jnp.moveaxis(x.reshape((b, nk, kb) + x.shape[2:]), 1, 0)

            cols, k_valid, k_groups = chunk_masks(c)
            k_cols = jnp.pad(cols, (0, pad), constant_values=-1).reshape(nk, kb)
            xs = (split(kv[0]), split(kv[1]), split(k_valid, False), split(k_groups, -1),
                  k_cols)
            carry, _ = jax.lax.scan(jax.checkpoint(sub_block), carry, xs)
            return carry

        def step(carry, r):
            kv, states = carry
            j = (i - r) % s  # the device whose chunks this device holds at step r
            states = list(states)
            for a, query in enumerate(queries):
                for kc, kvc in zip(ring_chunks(j, s, balanced), kv, strict=True):
                    # A key chunk of later columns than every query of the query chunk is
                    # empty under the causal mask (every pattern is causal): skipped, not
                    # computed and masked out.
                    states[a] = jax.lax.cond(
                        kc <= query[0], lambda st, q=query, x=kvc, c=kc: fold(st, q, x, c),
                        lambda st: st, states[a])
            kv = jax.tree.map(lambda x: jax.lax.ppermute(x, AXIS, perm), kv)
            return (kv, tuple(states)), None

        kv0 = tuple(zip(place(k), place(v), strict=True))  # ((k_lo, v_lo), (k_hi, v_hi))
        state0 = (jnp.full((b, K, G, h), lowest), jnp.zeros((b, K, G, h)),
                  jnp.zeros((b, K, G, h, H)))
        (_, states), _ = jax.lax.scan(jax.checkpoint(step), (kv0, (state0, state0)),
                                      jnp.arange(s))
        outs = []
        for _, total, acc in states:
            seen_any = total[..., None] > 0  # a padding query may see no key: output 0
            out = jnp.where(seen_any, acc / jnp.where(seen_any, total[..., None], 1.0), 0.0)
            outs.append(jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, h, N, H)
                        .astype(q.dtype))
        return unplace(*outs)

    return body
