"""The Qwen2.5-VL vision tower, as a Flax NNX module over stacked block parameters.

An image arrives as patches [N, channels * temporal_patch * patch * patch] (the layout
`hfjax.data.images.preprocess` writes, which is transformers' image processor's): each patch is
one linear map away from an embedding (the 3-D convolution with stride equal to its kernel).
Blocks are pre-norm transformer layers with 2-D rotary positions (a patch's row rotates the
first half of each head's frequencies, its column the second half). Most blocks attend within
windows of `window_size` pixels; the blocks in `fullatt_block_indexes` attend over the whole
frame. Tokens are kept in window order throughout (each window's patches contiguous), and the
merger, which joins each 2x2 group of neighbouring patches into one language-model token,
returns them to the image's raster order.

Which patches may attend to which comes from the image grids alone, so `layout` computes it on
the host with NumPy; the jitted tower sees only arrays whose shapes depend on the patch count.
Attention is dense with a segment mask (quadratic in the patches of one call): the sampler's
`hfjax.engine.images.encode` calls it image by image, so a batch costs linearly in its images.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hfjax.models.transformer import rms_norm


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """Shapes of the vision tower (HF `Qwen2_5_VLVisionConfig`'s fields)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    in_channels: int = 3
    rope_theta: float = 10000.0
    param_dtype: str = "float32"
    dtype: str = "float32"

    def __post_init__(self):
        object.__setattr__(self, "fullatt_block_indexes",
                           tuple(int(i) for i in self.fullatt_block_indexes))
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise ValueError(f"vision hidden_size={self.hidden_size} / num_heads="
                             f"{self.num_heads} must give a head_dim divisible by 4 (2-D rotary)")
        unit = self.patch_size * self.spatial_merge_size
        if self.window_size % unit:
            raise ValueError(f"vision window_size={self.window_size} is not a multiple of "
                             f"patch_size x spatial_merge_size = {unit}")
        bad = [i for i in self.fullatt_block_indexes if not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"fullatt_block_indexes names block(s) {bad} of a "
                             f"{self.depth}-block vision tower")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size ** 2

    @classmethod
    def from_hf_config(cls, hf: dict, **overrides) -> VisionConfig:
        """From the `vision_config` dictionary of an HF Qwen2.5-VL config.json."""
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"vision hidden_act={hf['hidden_act']!r}: hfjax's vision tower "
                             "has the gated SiLU MLP of Qwen2.5-VL")
        rope = hf.get("rope_parameters") or {}
        kw = dict(depth=hf["depth"], hidden_size=hf["hidden_size"],
                  intermediate_size=hf["intermediate_size"], num_heads=hf["num_heads"],
                  out_hidden_size=hf["out_hidden_size"])
        for name in ("patch_size", "temporal_patch_size", "spatial_merge_size", "window_size",
                     "fullatt_block_indexes", "in_channels"):
            if name in hf:
                kw[name] = hf[name]
        kw["rope_theta"] = float(rope.get("rope_theta", 10000.0))
        return cls(**{**kw, **overrides})

    def to_hf_config(self) -> dict:
        return {"model_type": "qwen2_5_vl_vision", "depth": self.depth,
                "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                "num_heads": self.num_heads, "out_hidden_size": self.out_hidden_size,
                "patch_size": self.patch_size, "temporal_patch_size": self.temporal_patch_size,
                "spatial_merge_size": self.spatial_merge_size, "window_size": self.window_size,
                "fullatt_block_indexes": list(self.fullatt_block_indexes),
                "in_channels": self.in_channels, "hidden_act": "silu",
                "rope_parameters": {"rope_type": "axial", "rope_theta": self.rope_theta}}


class VisionLayout(NamedTuple):
    """Host-computed arrays for a batch of images (all patch-level arrays in window order)."""

    positions: np.ndarray  # [N, 2] int32: each patch's (row, column) in its frame's grid
    window_order: np.ndarray  # [N / merge_unit] int32: merged units in window order
    window_segments: np.ndarray  # [N] int32: the window a patch attends within
    frame_segments: np.ndarray  # [N] int32: the frame a patch attends within (full blocks)


def layout(cfg: VisionConfig, grids) -> VisionLayout:
    """The `VisionLayout` of images with patch grids `grids` [(t, h, w), ...] (rows and columns
    in patches), in the order their patches are concatenated."""
    m = cfg.spatial_merge_size
    side = cfg.window_size // m // cfg.patch_size  # a window's side in merged units
    positions, order, windows, frames = [], [], [], []
    units = n_windows = n_frames = 0
    for t, h, w in grids:
        if h % m or w % m:
            raise ValueError(f"image grid {h}x{w} patches is not a multiple of "
                             f"spatial_merge_size={m}; resize with hfjax.data.images")
        gh, gw = h // m, w // m
        # Patch (row, column) in the processor's order: merged units row-major, and the m x m
        # patches of each unit row-major within it.
        r, c = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
        dr, dc = np.meshgrid(np.arange(m), np.arange(m), indexing="ij")
        rows = (r[..., None, None] * m + dr).reshape(-1)
        cols = (c[..., None, None] * m + dc).reshape(-1)
        unit_rc = np.stack([r.reshape(-1), c.reshape(-1)], -1)  # [gh*gw, 2]
        # Units sorted by (window row, window column, row, column) within each frame.
        key = np.lexsort((unit_rc[:, 1], unit_rc[:, 0], unit_rc[:, 1] // side,
                          unit_rc[:, 0] // side))
        win = (unit_rc[key, 0] // side) * -(-gw // side) + unit_rc[key, 1] // side
        for f in range(t):
            positions.append(np.stack([rows, cols], -1))
            order.append(units + f * gh * gw + key)
            _, win_ids = np.unique(win, return_inverse=True)
            windows.append(np.repeat(n_windows + win_ids, m * m))
            n_windows += int(win_ids.max()) + 1
            frames.append(np.full(gh * gw * m * m, n_frames))
            n_frames += 1
        units += t * gh * gw
    order = np.concatenate(order).astype(np.int32)
    pos = np.concatenate(positions).reshape(-1, m * m, 2)[order].reshape(-1, 2)
    return VisionLayout(pos.astype(np.int32), order, np.concatenate(windows).astype(np.int32),
                        np.concatenate(frames).astype(np.int32))


def _param(rngs, cfg: VisionConfig, shape, axes, init="normal") -> nnx.Param:
    dt = jnp.dtype(cfg.param_dtype)
    if init == "ones":
        return nnx.Param(jnp.ones(shape, dt), logical_axes=axes)
    if init == "zeros":
        return nnx.Param(jnp.zeros(shape, dt), logical_axes=axes)
    value = 0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value.astype(dt), logical_axes=axes)


class VisionTower(nnx.Module):
    """Patch embedding, the stacked blocks and the 2x2 patch merger."""

    def __init__(self, cfg: VisionConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        L, D, F, H, hd = (cfg.depth, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                          cfg.head_dim)
        M, Dout = D * cfg.merge_unit, cfg.out_hidden_size
        p = lambda shape, axes, init="normal": _param(rngs, cfg, shape, axes, init)
        self.patch_embed = p((cfg.patch_dim, D), (None, "vision_embed"))
        self.norm1 = p((L, D), ("layers", "norm"), "ones")
        self.qkv = p((L, D, 3, H, hd), ("layers", "vision_embed", None, "vision_heads",
                                         "head_dim"))
        self.qkv_bias = p((L, 3, H, hd), ("layers", None, "vision_heads", "head_dim"), "zeros")
        self.proj = p((L, H, hd, D), ("layers", "vision_heads", "head_dim", "vision_embed"))
        self.proj_bias = p((L, D), ("layers", "norm"), "zeros")
        self.norm2 = p((L, D), ("layers", "norm"), "ones")
        self.gate_proj = p((L, D, F), ("layers", "vision_embed", "vision_mlp"))
        self.gate_bias = p((L, F), ("layers", "vision_mlp"), "zeros")
        self.up_proj = p((L, D, F), ("layers", "vision_embed", "vision_mlp"))
        self.up_bias = p((L, F), ("layers", "vision_mlp"), "zeros")
        self.down_proj = p((L, F, D), ("layers", "vision_mlp", "vision_embed"))
        self.down_bias = p((L, D), ("layers", "norm"), "zeros")
        self.merger_norm = p((D,), ("norm",), "ones")
        self.merger_fc1 = p((M, M), (None, "vision_mlp"))
        self.merger_fc1_bias = p((M,), ("vision_mlp",), "zeros")
        self.merger_fc2 = p((M, Dout), ("vision_mlp", "embed"))
        self.merger_fc2_bias = p((Dout,), ("norm",), "zeros")

    def rotary(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(cos, sin) [N, 1, head_dim] in float32: a quarter of the frequencies each for the
        row and the column, the halves repeated (rotate-half convention)."""
        cfg = self.config
        quarter = cfg.head_dim // 2
        inv = 1.0 / cfg.rope_theta ** (jnp.arange(0, quarter, 2, dtype=jnp.float32) / quarter)
        ang = positions.astype(jnp.float32)[:, :, None] * inv  # [N, 2, head_dim/4]
        ang = ang.reshape(ang.shape[0], -1)
        ang = jnp.concatenate([ang, ang], -1)[:, None, :]
        return jnp.cos(ang), jnp.sin(ang)

    def __call__(self, pixels: jax.Array, lay: VisionLayout) -> jax.Array:
        """Language-model tokens [N / merge_unit, out_hidden_size] of patches [N, patch_dim],
        in the order the images' patches came (each image's merged units row-major)."""
        cfg = self.config
        dt = jnp.dtype(cfg.dtype)
        N, D, u = pixels.shape[0], cfg.hidden_size, cfg.merge_unit
        order = jnp.asarray(lay.window_order)
        x = pixels.astype(dt) @ self.patch_embed[...].astype(dt)
        x = x.reshape(N // u, u, D)[order].reshape(N, D)
        cos, sin = self.rotary(jnp.asarray(lay.positions))
        window = jnp.asarray(lay.window_segments)
        frame = jnp.asarray(lay.frame_segments)
        masks = jnp.stack([window[:, None] == window[None], frame[:, None] == frame[None]])
        full = jnp.zeros(cfg.depth, jnp.int32).at[jnp.asarray(cfg.fullatt_block_indexes,
                                                              jnp.int32)].set(1)

        def rope(t):
            t32 = t.astype(jnp.float32)
            half = t.shape[-1] // 2
            rot = jnp.concatenate([-t32[..., half:], t32[..., :half]], -1)
            return (t32 * cos + rot * sin).astype(dt)

        def block(x, xs):
            p, is_full = xs
            c = lambda name: p[name].astype(dt)
            h = rms_norm(x, p["norm1"], 1e-6)
            qkv = jnp.einsum("nd,dchk->cnhk", h, c("qkv")) + c("qkv_bias")[:, None]
            q, k, v = rope(qkv[0]), rope(qkv[1]), qkv[2]
            s = jnp.einsum("qhk,shk->hqs", q, k, preferred_element_type=jnp.float32)
            s = jnp.where(masks[is_full][None], s * cfg.head_dim ** -0.5, -jnp.inf)
            a = jax.nn.softmax(s, axis=-1).astype(dt)
            o = jnp.einsum("hqs,shk->qhk", a, v)
            x = x + jnp.einsum("qhk,hkd->qd", o, c("proj")) + c("proj_bias")
            h = rms_norm(x, p["norm2"], 1e-6)
            g = jax.nn.silu(h @ c("gate_proj") + c("gate_bias")) * (h @ c("up_proj")
                                                                    + c("up_bias"))
            return x + g @ c("down_proj") + c("down_bias"), None

        names = ("norm1", "qkv", "qkv_bias", "proj", "proj_bias", "norm2", "gate_proj",
                 "gate_bias", "up_proj", "up_bias", "down_proj", "down_bias")
        stacked = {n: getattr(self, n)[...] for n in names}
        x, _ = jax.lax.scan(block, x, (stacked, full))
        h = rms_norm(x, self.merger_norm[...], 1e-6).reshape(N // u, u * D)
        h = jax.nn.gelu(h @ self.merger_fc1[...].astype(dt) + self.merger_fc1_bias[...].astype(dt),
                        approximate=False)
        out = h @ self.merger_fc2[...].astype(dt) + self.merger_fc2_bias[...].astype(dt)
        return out[jnp.argsort(order)]


# our parameter -> (HF name under `visual.`, HF -> ours, ours -> HF); `{i}` is the block.
def _lin(w, c):
    return w.T


_B = "blocks.{i}."
HF_NAMES = {
    "patch_embed": ("patch_embed.proj.weight", lambda w, c: w.reshape(w.shape[0], -1).T,
                    lambda w, c: w.T.reshape(-1, c.in_channels, c.temporal_patch_size,
                                             c.patch_size, c.patch_size)),
    "norm1": (_B + "norm1.weight", None, None),
    "norm2": (_B + "norm2.weight", None, None),
    "qkv": (_B + "attn.qkv.weight",
            lambda w, c: w.T.reshape(w.shape[1], 3, c.num_heads, c.head_dim),
            lambda w, c: w.reshape(w.shape[0], -1).T),
    "qkv_bias": (_B + "attn.qkv.bias", lambda w, c: w.reshape(3, c.num_heads, c.head_dim),
                 lambda w, c: w.reshape(-1)),
    "proj": (_B + "attn.proj.weight", lambda w, c: w.T.reshape(c.num_heads, c.head_dim, -1),
             lambda w, c: w.reshape(-1, w.shape[-1]).T),
    "proj_bias": (_B + "attn.proj.bias", None, None),
    "gate_proj": (_B + "mlp.gate_proj.weight", _lin, _lin),
    "gate_bias": (_B + "mlp.gate_proj.bias", None, None),
    "up_proj": (_B + "mlp.up_proj.weight", _lin, _lin),
    "up_bias": (_B + "mlp.up_proj.bias", None, None),
    "down_proj": (_B + "mlp.down_proj.weight", _lin, _lin),
    "down_bias": (_B + "mlp.down_proj.bias", None, None),
    "merger_norm": ("merger.ln_q.weight", None, None),
    "merger_fc1": ("merger.mlp.0.weight", _lin, _lin),
    "merger_fc1_bias": ("merger.mlp.0.bias", None, None),
    "merger_fc2": ("merger.mlp.2.weight", _lin, _lin),
    "merger_fc2_bias": ("merger.mlp.2.bias", None, None),
}


def from_hf_tensors(cfg: VisionConfig, tensors: dict[str, np.ndarray]) -> VisionTower:
    """A tower from HF tensors named as under `visual.` (on the default device). Raises
    ValueError naming a missing tensor or one whose shape does not fit the config."""
    tower = nnx.eval_shape(lambda: VisionTower(cfg, rngs=nnx.Rngs(0)))
    for ours, (tmpl, to_ours, _) in HF_NAMES.items():
        var = getattr(tower, ours)
        shape = var.get_value().shape
        stacked = "{i}" in tmpl
        parts = []
        for i in range(cfg.depth) if stacked else [None]:
            name = "visual." + tmpl.format(i=i)
            if name not in tensors:
                raise ValueError(f"missing tensor {name} of the vision tower")
            w = np.asarray(tensors[name], np.float32)
            w = to_ours(w, cfg) if to_ours else w
            parts.append(w)
        value = np.stack(parts) if stacked else parts[0]
        if value.shape != shape:
            raise ValueError(f"tensor visual.{tmpl}: shape {value.shape} in hfjax's layout does "
                             f"not match the vision config's {shape}")
        var.set_value(jnp.asarray(value, jnp.dtype(cfg.param_dtype)))
    return tower


def to_hf_tensors(tower: VisionTower):
    """(HF name, float32 array) of every tower parameter, named as transformers saves them."""
    cfg = tower.config
    for ours, (tmpl, _, to_hf) in HF_NAMES.items():
        value = np.asarray(getattr(tower, ours)[...], np.float32)
        for i in range(cfg.depth) if "{i}" in tmpl else [None]:
            w = value[i] if i is not None else value
            yield "visual." + tmpl.format(i=i), to_hf(w, cfg) if to_hf else w
