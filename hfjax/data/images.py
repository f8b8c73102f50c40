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


# verl's placeholder for an image in a multimodal row's message text.
PLACEHOLDER = "<image>"
# Qwen2.5-VL's tokens around and for an image's merged patches, as its processor writes them.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")


def expand_placeholders(messages, counts) -> list[dict]:
    """`messages` with the i-th `PLACEHOLDER` (in order, over all messages) written as
    Qwen2.5-VL's processor writes image i: the vision start token, `counts[i]` image tokens
    (one per merged patch group), the vision end token."""
    start, end, pad = VISION_TOKENS
    it = iter(counts)
    out = []
    for m in messages:
        parts = m["content"].split(PLACEHOLDER)
        text = parts[0] + "".join(start + pad * next(it) + end + p for p in parts[1:])
        out.append({**m, "content": text})
    return out
# Decoded area above which a row's picture is refused (resizing would shrink it, but decoding
# it already costs the memory): a 8192 x 8192 image.
MAX_DECODED_PIXELS = 8192 * 8192


def row_images(records, messages, max_pixels: int = MAX_DECODED_PIXELS) -> list[bytes]:
    """The encoded bytes of a multimodal row's `images` (verl's column: a list of
    {"bytes": ...} records, or raw bytes), checked: each has bytes that decode (an image
    of zero width or height does not) to at most `max_pixels` pixels, and the row's messages
    hold one `PLACEHOLDER` per image. ValueError naming the image and the problem otherwise."""
    records = list(records if records is not None else ())
    n_marks = sum(m["content"].count(PLACEHOLDER) for m in messages)
    if n_marks != len(records):
        raise ValueError(f"{n_marks} {PLACEHOLDER} placeholder(s) in the prompt but "
                         f"{len(records)} image(s)")
    out = []
    for j, rec in enumerate(records):
        data = rec.get("bytes") if isinstance(rec, dict) else rec
        if not isinstance(data, bytes) or not data:
            raise ValueError(f"image {j} has no bytes (expected {{'bytes': <encoded image>}})")
        try:
            with Image.open(io.BytesIO(data)) as img:
                w, h = img.size  # the header: nothing decoded yet
                if w * h > max_pixels:
                    raise ValueError(f"image {j} is {w}x{h}, over the {max_pixels}-pixel "
                                     "budget; downscale it when writing the data")
                img.load()
        except (OSError, Image.DecompressionBombError) as err:
            raise ValueError(f"image {j} is not a readable image ({err})") from None
        out.append(data)
    return out
