"""Images to vision-tower patches with Pillow and NumPy, as transformers' Qwen2-VL image
processor lays them out (equal arrays: tests/data/test_images.py).

An image is resized (bicubic) to the nearest size whose sides are multiples of
patch_size x merge_size and whose area lies within [min_pixels, max_pixels], scaled to [0, 1],
normalised by the CLIP mean and deviation, and cut into patches ordered by 2x2 merge group;
each patch repeats the still image over the tower's temporal patch, so a picture is one frame.
"""

from __future__ import annotations

import io
import math

import numpy as np
from PIL import Image

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 1280


def fit_size(height: int, width: int, factor: int, min_pixels: int = MIN_PIXELS,
             max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """(height, width) multiples of `factor`, near the image's aspect, with an area within
    [min_pixels, max_pixels]. ValueError for an empty image or one more than 200 times longer
    than wide."""
    if height <= 0 or width <= 0:
        raise ValueError(f"image of size {width}x{height} has no pixels")
    if max(height, width) > 200 * min(height, width):
        raise ValueError(f"image of size {width}x{height}: sides differ by more than 200x")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        shrink = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / shrink / factor) * factor)
        w = max(factor, math.floor(width / shrink / factor) * factor)
    elif h * w < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * grow / factor) * factor
        w = math.ceil(width * grow / factor) * factor
    return h, w


def open_image(data) -> Image.Image:
    """A PIL image from bytes, a {"bytes": ...} record (verl's parquet), a path or an image.
    ValueError when the bytes are not an image."""
    if isinstance(data, Image.Image):
        return data
    if isinstance(data, dict):
        data = data.get("bytes") or data.get("path")
    try:
        img = Image.open(io.BytesIO(data) if isinstance(data, bytes) else data)
        img.load()
    except (OSError, Image.DecompressionBombError) as err:
        raise ValueError(f"not a readable image ({err})") from None
    return img


def preprocess(images, *, patch_size: int = 14, merge_size: int = 2,
               temporal_patch_size: int = 2, min_pixels: int = MIN_PIXELS,
               max_pixels: int = MAX_PIXELS) -> tuple[np.ndarray, np.ndarray]:
    """Patches [N, 3 * temporal_patch_size * patch_size**2] (float32) of all `images`,
    concatenated, and their grids [n_images, 3] (frames, rows, columns in patches)."""
    factor = patch_size * merge_size
    out, grids = [], []
    for img in images:
        img = open_image(img).convert("RGB")
        h, w = fit_size(img.height, img.width, factor, min_pixels, max_pixels)
        pixels = np.asarray(img.resize((w, h), Image.Resampling.BICUBIC))
        x = (pixels.astype(np.float64) / 255.0).astype(np.float32)
        x = ((x - np.float32(CLIP_MEAN)) / np.float32(CLIP_STD)).astype(np.float32)
        gh, gw, m, p = h // patch_size, w // patch_size, merge_size, patch_size
        x = x.transpose(2, 0, 1).reshape(3, gh // m, m, p, gw // m, m, p)
        x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # [groups h, groups w, m, m, channel, p, p]
        x = np.repeat(x[:, :, :, :, :, None], temporal_patch_size, axis=5)
        out.append(x.reshape(gh * gw, -1))
        grids.append((1, gh, gw))
    return np.concatenate(out).astype(np.float32), np.asarray(grids, np.int64)
