"""bench/vision.py's model and prompts (no flags, so a test builds them): a Qwen2.5-VL-shaped
`VisionLM` from scratch and prompts with one picture each beside prompts of text only of the
same token count."""

from __future__ import annotations

VOCAB = 512
# The vision markers and the image placeholder: the vocabulary's last three ids.
START, END, IMAGE = VOCAB - 3, VOCAB - 2, VOCAB - 1


def build(hidden: int, layers: int, vision_hidden: int, vision_depth: int):
    """A Qwen2.5-VL-shaped `VisionLM` with random weights: the decoder's M-RoPE bands split
    as Qwen2.5-VL's 16/24/24 of a 64-wide head; the tower's windows of 2 x 2 merged patches."""
    from flax import nnx

    from hfjax.models import qwen2_5_vl, vision
    from hfjax.models.config import ModelConfig

    text = ModelConfig(model_type="qwen2", attention_bias=True, vocab_size=VOCAB,
                       hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
                       num_heads=hidden // 64, num_kv_heads=max(hidden // 128, 1), head_dim=64,
                       mrope_section=(8, 12, 12), max_position_embeddings=1024)
    tower = vision.VisionConfig(depth=vision_depth, hidden_size=vision_hidden,
                                intermediate_size=2 * vision_hidden,
                                num_heads=vision_hidden // 32, out_hidden_size=hidden,
                                window_size=56, fullatt_block_indexes=(vision_depth - 1,))
    cfg = qwen2_5_vl.VLConfig(text, tower, image_token_id=IMAGE, video_token_id=-1,
                              vision_start_token_id=START, vision_end_token_id=END)
    return qwen2_5_vl.VisionLM(cfg, rngs=nnx.Rngs(0))


def prompts(rows: int, side: int, text: int, rng):
    """(image prompts' ids, text prompts' ids, patches, grids): `rows` prompts of `text`
    tokens, one picture, `text` tokens; the text prompts hold text tokens in the picture's
    place. Every row is full (no padding)."""
    import numpy as np
    from PIL import Image

    from hfjax.data import images

    pics = [Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))
            for _ in range(rows)]
    pixels, grids = images.preprocess(pics, max_pixels=side * side)
    per_image = int(grids[0].prod()) // 4
    words = rng.integers(3, START, (rows, 2 * text + per_image + 2))
    with_images = words.copy()
    with_images[:, text] = START
    with_images[:, text + 1:text + 1 + per_image] = IMAGE
    with_images[:, text + 1 + per_image] = END
    return with_images.astype(np.int32), words.astype(np.int32), pixels, grids


def row_inputs(model, pixels, grids, rows: int):
    """(patches [rows, N, patch_dim], layout, order) of one picture per row: what the actor's
    rollout hands its tower (`hfjax.workers.vision.tower_rows`, each row's patches attending
    within the row), beside `hfjax.engine.images.encode`'s one list over the batch."""
    import numpy as np

    from hfjax.workers import vision as worker_vision

    v = model.config.vision
    per_row = np.asarray(pixels).reshape(rows, -1, v.patch_dim)
    layout, order = worker_vision.row_layouts(v, np.asarray(grids).reshape(rows, 1, 3),
                                              per_row.shape[1])
    return per_row, layout, order
