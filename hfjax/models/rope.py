"""Rotary position embeddings of the decoder family: inverse frequencies (with llama3
scaling), (cos, sin) tables looked up by position (plain, or M-RoPE's temporal/height/width
bands for Qwen2.5-VL) and the rotate-half rotation."""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp

from hfjax.models.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
    """RoPE inverse frequencies [head_dim/2] in float32, with llama3 scaling when configured."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_ctx = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    # Long wavelengths are slowed by `factor`, short ones kept; the band between is blended.
    scaled = jnp.where(wavelen > old_ctx / lo, inv / factor, inv)
    smooth = (old_ctx / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
    return jnp.where(medium, blended, scaled)


def rope_tables(
    positions: jax.Array, inv_freq: jax.Array, dtype, n_positions: int,
    sections: tuple[int, ...] = (),
) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) [B, T, 1, head_dim] for positions [B, T] in [0, n_positions), rotate-half
    convention.

    The angles are tabulated for positions 0..n_positions-1 and looked up: the table depends
    only on constants, so XLA folds it at compile time, whereas cos/sin of the positions
    themselves would be fused into every layer's RoPE and re-evaluated per head.

    With M-RoPE `sections` (`ModelConfig.mrope_section`), positions may be [3, B, T]: band c of
    the frequencies reads position component c (temporal, height, width). Positions [B, T]
    serve all three, which is plain RoPE (a text token, or any decoded token).
    """
    angles = jnp.arange(n_positions, dtype=jnp.float32)[:, None] * inv_freq  # [P, D/2]
    table = jnp.stack([jnp.cos(angles), jnp.sin(angles)]).astype(dtype)  # [2, P, D/2]
    if sections and positions.ndim == 3:
        bounds = [0, *itertools.accumulate(sections)]
        half = jnp.concatenate([jnp.take(table[:, :, lo:hi], positions[c], axis=1)
                                for c, (lo, hi) in enumerate(zip(bounds, bounds[1:]))], -1)
    else:
        half = jnp.take(table, positions, axis=1)  # [2, B, T, D/2]
    cos_sin = jnp.concatenate([half, half], axis=-1)[:, :, :, None, :]  # [2, B, T, 1, D]
    return cos_sin[0], cos_sin[1]


def apply_rope(x: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotates x [B, T, heads, head_dim] by the `rope_tables` (cos, sin) of its positions."""
    cos, sin = rope
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin
