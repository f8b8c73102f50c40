"""Rollout of prompts with images against prompts of text only, on one device.

A Qwen2.5-VL-shaped model from scratch (random weights; the decoder and the tower sized by the
flags). Two rollouts of the same rows, n and max_new_tokens, whose prompts have the same
token count:

- images: every prompt holds one random picture of `--image` x `--image` pixels
  (`<|vision_start|>`, its image tokens, `<|vision_end|>` between text tokens); a rollout
  step is the tower over the prompts' pictures (`hfjax.engine.images.encode`, once per
  prompt, image by image) and then the sampler's `generate` with those features in its
  prefill;
- text: the same prompts with every image token (and the two markers) replaced by a text
  token: `generate` alone.

Sampling at temperature 1 with no stop token, so every row decodes `--new` tokens. Each
figure is the median of `--repeats` calls after one that compiles, the two rollouts timed
alternately so that other jobs' load falls on both alike. Reported: generated tokens/s of
each, their ratio, and the tower's share of the image step (encode / (encode + generate));
beside them the tower row by row, as the actor's rollout runs it
(`hfjax.workers.vision.tower_rows`), and the naive tower over one list of every picture
(`hfjax.engine.images.encode_together`, dense attention over all the batch's patches).
The last line is JSON. HFJAX_SMOKE=1 (launch/smoke.py) runs a 2-layer model on 2 prompts
with a 56-pixel picture, one repeat.

    python -m bench.vision [--image=224 --rows=8 --n=4 --new=32 --repeats=5]
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

from absl import app, flags

from launch import smoke

flags.DEFINE_integer("hidden", 256, "decoder hidden size (heads of 64; MLP 2x)")
flags.DEFINE_integer("layers", 4, "decoder layers")
flags.DEFINE_integer("vision_hidden", 128, "tower hidden size (heads of 32; MLP 2x)")
flags.DEFINE_integer("vision_depth", 4, "tower blocks (the last attends over the whole image)")
flags.DEFINE_integer("image", 224, "picture side in pixels (a multiple of 28)")
flags.DEFINE_integer("text", 8, "text tokens on each side of the picture")
flags.DEFINE_integer("rows", 8, "prompts per rollout")
flags.DEFINE_integer("n", 4, "samples per prompt")
flags.DEFINE_integer("new", 32, "new tokens per sample")
flags.DEFINE_integer("repeats", 5, "timed calls per rollout (the median is reported)")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    import jax
    import numpy as np
    from flax import nnx

    from bench.vision_model import VOCAB, build, prompts, row_inputs
    from hfjax.engine import images as engine_images
    from hfjax.engine.sampler import Sampler
    from hfjax.engine.token_select import SamplingParams
    from hfjax.workers.vision import tower_rows

    if FLAGS.image % 28:
        raise app.UsageError(f"--image={FLAGS.image} must be a multiple of 28 (2 x 2 patches "
                             "of 14 pixels)")
    if smoke.enabled():
        FLAGS.hidden, FLAGS.layers, FLAGS.vision_hidden, FLAGS.vision_depth = 64, 2, 64, 2
        FLAGS.image, FLAGS.rows, FLAGS.n, FLAGS.new, FLAGS.repeats = 56, 2, 2, 8, 1
    model = build(FLAGS.hidden, FLAGS.layers, FLAGS.vision_hidden, FLAGS.vision_depth)
    rng = np.random.default_rng(0)
    ids_image, ids_text, pixels, grids = prompts(FLAGS.rows, FLAGS.image, FLAGS.text, rng)
    mask = np.ones_like(ids_text)
    state = nnx.state(model.lm)
    sampler = Sampler(model.lm, pad_id=0, max_prompt_len=ids_text.shape[1], rules=None)
    sp = SamplingParams(max_new_tokens=FLAGS.new, temperature=1.0, n=FLAGS.n)

    rows_in = row_inputs(model, pixels, grids, FLAGS.rows)
    by_rows = nnx.jit(tower_rows)

    def rows_step():
        return jax.block_until_ready(by_rows(model.visual, *rows_in))

    def together_step():  # the naive tower: one dense list over the batch's patches
        return jax.block_until_ready(engine_images.encode_together(model, pixels, grids)
                                     .features)

    def text_step():
        return jax.block_until_ready(sampler.generate(state, ids_text, mask, sp).tokens)

    def image_step():
        """(encode seconds, generate seconds) of one rollout with images."""
        start = time.perf_counter()
        encoded = engine_images.encode(model, pixels, grids)
        jax.block_until_ready(encoded.features)
        mid = time.perf_counter()
        jax.block_until_ready(sampler.generate(state, ids_image, mask, sp,
                                               images=encoded).tokens)
        return mid - start, time.perf_counter() - mid

    text_step(), image_step(), rows_step(), together_step()  # compile all
    t_text, t_encode, t_generate, t_rows, t_together = [], [], [], [], []
    for _ in range(FLAGS.repeats):
        start = time.perf_counter()
        text_step()
        t_text.append(time.perf_counter() - start)
        start = time.perf_counter()
        rows_step()
        t_rows.append(time.perf_counter() - start)
        start = time.perf_counter()
        together_step()
        t_together.append(time.perf_counter() - start)
        enc, gen = image_step()
        t_encode.append(enc)
        t_generate.append(gen)
    med_text, med_enc = statistics.median(t_text), statistics.median(t_encode)
    med_gen, med_rows = statistics.median(t_generate), statistics.median(t_rows)
    med_together = statistics.median(t_together)
    med_image = statistics.median(e + g for e, g in zip(t_encode, t_generate))
    tokens = FLAGS.rows * FLAGS.n * FLAGS.new
    out = {
        "model": f"decoder hidden {FLAGS.hidden} x {FLAGS.layers} layers, tower hidden "
                 f"{FLAGS.vision_hidden} x {FLAGS.vision_depth} blocks, vocab {VOCAB}",
        "image_px": FLAGS.image, "image_tokens": int(grids[0].prod()) // 4,
        "prompt_tokens": int(ids_text.shape[1]), "rows": FLAGS.rows, "n": FLAGS.n,
        "new": FLAGS.new, "repeats": FLAGS.repeats,
        "text_s": round(med_text, 4), "image_s": round(med_image, 4),
        "encode_s": round(med_enc, 4), "image_generate_s": round(med_gen, 4),
        "text_tok_s": round(tokens / med_text, 1), "image_tok_s": round(tokens / med_image, 1),
        "image_over_text_s": round(med_image / med_text, 3),
        "tower_share": round(med_enc / med_image, 3),
        "tower_rows_s": round(med_rows, 4),
        "encode_together_s": round(med_together, 4),
        "together_over_encode": round(med_together / med_enc, 3),
        "tower_rows_share": round(med_rows / (med_rows + med_gen), 3),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                   f"{jax.devices()[0].platform}",
    }
    print(f"{FLAGS.rows} prompts of {out['prompt_tokens']} tokens x n={FLAGS.n}, "
          f"{FLAGS.new} new tokens; median of {FLAGS.repeats}")
    print(f"{'rollout':<28}{'seconds':>10}{'tokens/s':>11}")
    print(f"{'text only':<28}{med_text:>10.3f}{tokens / med_text:>11.1f}")
    print(f"{'with images (whole step)':<28}{med_image:>10.3f}{tokens / med_image:>11.1f}")
    print(f"{'  tower (encode)':<28}{med_enc:>10.3f}")
    print(f"{'  generate':<28}{med_gen:>10.3f}")
    print(f"{'tower row by row (actor)':<28}{med_rows:>10.3f}")
    print(f"{'tower over one list (naive)':<28}{med_together:>10.3f}  "
          f"({med_together / med_enc:.2f}x encode's image by image)")
    print(f"images/text time {med_image / med_text:.2f}x; tower share of the image step "
          f"{100 * med_enc / med_image:.1f}% (row by row, as the actor's rollout runs it: "
          f"{100 * med_rows / (med_rows + med_gen):.1f}%)")
    print(json.dumps(out))


if __name__ == "__main__":
    app.run(main)
