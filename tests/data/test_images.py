"""Image preprocessing against transformers' Qwen2-VL image processor (its Pillow backend)."""

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from hfjax.data import images
from hfjax.data.dataset import BAD_IMAGE, Dataset
from hfjax.data.prepare import write_rows


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


def _png(w, h, color=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, format="PNG")
    return buf.getvalue()


def _zero_width_png() -> bytes:
    data = bytearray(_png(30, 20))
    data[16:20] = struct.pack(">I", 0)  # IHDR width, with the chunk's CRC recomputed
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def _row(i, n_marks, pics):
    return {"data_source": "openai/gsm8k", "reward_model": {"style": "rule", "ground_truth": "2"},
            "prompt": [{"role": "user", "content": "<image>" * n_marks + f"How many? {i}"}],
            "images": [{"bytes": b, "path": None} for b in pics]}


def test_multimodal_parquet_rows_and_refusals(tmp_path, tok):
    good = [_row(0, 1, [_png(30, 20)]), _row(1, 2, [_png(8, 8), _png(40, 10)])]
    path = tmp_path / "mm.parquet"
    write_rows(good, path)
    ds = Dataset.from_parquet(path, tok, 64, images=True)
    assert [len(r["images"]) for r in ds.rows] == [1, 2]
    assert images.open_image(ds.rows[1]["images"][1]).size == (40, 10)
    # A changed picture changes the fingerprint a resumed run checks its data against.
    other = [good[0], _row(1, 2, [_png(8, 8), _png(40, 10, (0, 0, 255))])]
    assert Dataset(other, tok, 64, images=True).fingerprint != ds.fingerprint
    with pytest.raises(ValueError, match=r"mm.parquet row 0 has images, but the policy is "
                                         "text-only"):
        Dataset.from_parquet(path, tok, 64)

    bad = {"corrupt": (_row(2, 1, [_png(30, 20)[:60]]), "image 0 is not a readable image"),
           "empty": (_row(3, 1, [b""]), "image 0 has no bytes"),
           "zerosize": (_row(6, 1, [_zero_width_png()]), "image 0 is not a readable image"),
           "marks": (_row(4, 2, [_png(30, 20)]), "2 <image> placeholder.* but 1 image"),
           "budget": (_row(5, 1, [_png(300, 300)]), "image 0 is 300x300, over the 10000-pixel")}
    for name, (row, message) in bad.items():
        p = tmp_path / f"{name}.parquet"
        write_rows([good[0], row], p)
        with pytest.raises(ValueError, match=f"{name}.parquet row 1: {message}"):
            Dataset.from_parquet(p, tok, 64, images=True, max_image_pixels=100 * 100)
    rows = [good[0]] + [row for row, _ in bad.values()]
    ds = Dataset(rows, tok, 64, images=True, max_image_pixels=100 * 100, on_bad_row="skip")
    assert ds.report.skipped == {BAD_IMAGE: 5} and len(ds) == 1
