"""Image preprocessing against transformers' Qwen2-VL image processor (its Pillow backend)."""

import io

import numpy as np
import pytest
from PIL import Image

from hfjax.data import images


def test_patches_equal_transformers_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    rng = np.random.default_rng(0)
    # Sizes that round, shrink to the pixel budget and grow to the minimum; one grey image.
    pics = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
            for h, w in [(100, 130), (300, 250), (20, 300)]]
    pics.append(Image.fromarray(rng.integers(0, 256, (70, 40), dtype=np.uint8)))
    budget = dict(min_pixels=56 * 56, max_pixels=112 * 112)
    ref = Qwen2VLImageProcessorPil(**budget)(images=pics, return_tensors="np")
    pixels, grids = images.preprocess(pics, **budget)
    np.testing.assert_array_equal(grids, ref["image_grid_thw"])
    np.testing.assert_array_equal(pixels, ref["pixel_values"])


def test_bad_images_refused():
    buf = io.BytesIO()
    Image.new("RGB", (30, 20)).save(buf, format="PNG")
    assert images.open_image({"bytes": buf.getvalue()}).size == (30, 20)
    with pytest.raises(ValueError, match="not a readable image"):
        images.open_image({"bytes": buf.getvalue()[:40]})
    with pytest.raises(ValueError, match="has no pixels"):
        images.fit_size(0, 10, 28)
    with pytest.raises(ValueError, match="more than 200x"):
        images.fit_size(1, 300, 28)
