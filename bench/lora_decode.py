"""Decoding with LoRA adapters, merged vs unmerged, side by side on one device.

- merged: W + (alpha / rank) * A @ B computed once per rollout (`hfjax.models.lora.
  merged_state`, timed on its own), then the base model's sampler decodes the merged weights;
- unmerged: the sampler decodes the model with its adapters, each projection computing
  x @ W + (x @ A) @ (scale * B) at every step.

Both give the same greedy tokens (checked). Random weights of the given shape (adapters
included, B non-zero); every figure is the fastest of `--repeats` calls after one that
compiles, the two rollouts timed alternately. The last line is JSON.

    python -m bench.lora_decode [--hidden=512 --layers=8 --rank=16 --rows=32 --new=64]
"""

from __future__ import annotations

import json
import os
import platform

from absl import app, flags

flags.DEFINE_integer("hidden", 512, "hidden size (heads of 64; MLP 4x)")
flags.DEFINE_integer("layers", 8, "decoder layers")
flags.DEFINE_integer("rank", 16, "adapter rank (all-linear targets)")
flags.DEFINE_integer("rows", 32, "prompts decoded together")
flags.DEFINE_integer("prompt", 32, "prompt tokens")
flags.DEFINE_integer("new", 64, "new tokens per prompt")
flags.DEFINE_integer("repeats", 3, "timed calls (the fastest is reported)")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    import jax
    import numpy as np
    from flax import nnx

    from bench.lora_model import adapted_model, bench_config
    from bench.timing import best_time
    from hfjax.engine.sampler import Sampler, SamplingParams
    from hfjax.models import lora

    cfg = bench_config(FLAGS.hidden, FLAGS.layers, FLAGS.prompt + FLAGS.new)
    rng = np.random.default_rng(0)
    model, base_gd = adapted_model(cfg, FLAGS.rank, rng)
    graphdef, state = nnx.split(model)
    merge = jax.jit(lambda s: lora.merged_state(graphdef, base_gd, s))
    ids = rng.integers(1, cfg.vocab_size, (FLAGS.rows, FLAGS.prompt)).astype(np.int32)
    mask = np.ones_like(ids)
    sp = SamplingParams(max_new_tokens=FLAGS.new, temperature=0.0)
    merged_sampler = Sampler(nnx.merge(base_gd, merge(state)), rules=None)
    unmerged_sampler = Sampler(model, rules=None)

    def merged_rollout(s):
        return merged_sampler.generate(merge(s), ids, mask, sp).tokens

    def unmerged_rollout(s):
        return unmerged_sampler.generate(s, ids, mask, sp).tokens

    same = bool(np.array_equal(np.asarray(merged_rollout(state)),
                               np.asarray(unmerged_rollout(state))))
    t_merge, _ = best_time(merge, state, reps=FLAGS.repeats)
    # The two rollouts alternate, so that other jobs' load falls on both alike.
    t_merged = t_unmerged = float("inf")
    for _ in range(FLAGS.repeats):
        t_merged = min(t_merged, best_time(merged_rollout, state, reps=1)[0])
        t_unmerged = min(t_unmerged, best_time(unmerged_rollout, state, reps=1)[0])
    out = {
        "model": f"hidden {FLAGS.hidden}, {FLAGS.layers} layers, rank {FLAGS.rank} all-linear",
        "rows": FLAGS.rows, "prompt": FLAGS.prompt, "new": FLAGS.new,
        "merge_s": round(t_merge, 4),
        "merged_rollout_s": round(t_merged, 4),
        "unmerged_rollout_s": round(t_unmerged, 4),
        "unmerged_over_merged": round(t_unmerged / t_merged, 3),
        "same_tokens": same,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                   f"{jax.devices()[0].platform}",
    }
    print(f"merge {t_merge * 1e3:.1f} ms; rollout merged (merge included) {t_merged:.3f} s, "
          f"unmerged {t_unmerged:.3f} s: unmerged/merged {t_unmerged / t_merged:.2f}x; "
          f"same tokens: {same}")
    print(json.dumps(out))


if __name__ == "__main__":
    app.run(main)
