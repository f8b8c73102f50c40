"""The actor's training passes of SmolLM2-135M (f32 unless `--dtype`, 1 CPU device) on one RL
batch, padded rows against packed ones (`actor.use_remove_padding`), length-grouped padded
micro-batches (`actor.group_by_length`) and shared-prompt rows (`actor.share_prompt`, with
`--samples` > 1: `shared` on padded micro-batches, `shared_grouped` on grouped ones): the
log-prob pass (old / reference log-probs) and one optimizer step (forward + backward over every
micro-batch).

The batch has a realistic length mix: left-padded prompts of `--prompt_min`..`--prompt_len`
tokens, responses of 1..`--cap` tokens with a fraction `--at_cap` stopped at the cap (the
untuned SmolLM2's gsm_symbolic mix, bench/variable_length.py: 74 of 128 at a cap of 256), in
groups of `--samples` rows that share their prompt (as a GRPO batch's samples do). All
layouts see the same sequences; the padded passes take `--micro` rows at a time (grouped: rows
of similar lengths, each micro-batch cut to its own width), the packed ones `--micro` padded
rows' worth of tokens per micro-batch (ppo_max_token_len_per_gpu=0). Prints each pass's best of
`--repeats` timed runs after a compiling one, and each layout's speed-up over padded rows.

    python -m bench.packed_update
"""

import json

import jax
import numpy as np
from absl import app, flags

import hfjax.models as M
from bench.timing import best_time
from configs import ppo_arith
from hfjax.controller.batch import Batch
from hfjax.engine import update
from hfjax.engine.spec import RolloutSpec
from hfjax.models.config import REMAT_POLICIES
from hfjax.models.smollm2 import smollm2_gguf_path
from hfjax.parallel.mesh import ResourcePool
from hfjax.workers.actor import ActorRollout
from hfjax.workers.spec import ActorSpec

flags.DEFINE_integer("rows", 16, "sequences in the batch")
flags.DEFINE_integer("micro", 8, "rows per padded micro-batch (and the packed budget's worth)")
flags.DEFINE_integer("prompt_len", 128, "prompt columns (the longest prompt)")
flags.DEFINE_integer("prompt_min", 60, "the shortest prompt")
flags.DEFINE_integer("prompt_cols", 0, "the prompt block's columns (its bucket; 0: prompt_len)")
flags.DEFINE_integer("cap", 256, "response columns (the cap)")
flags.DEFINE_float("at_cap", 0.58, "fraction of responses stopped at the cap")
flags.DEFINE_integer("samples", 1, "rows per prompt (rollout.n): groups that share a prompt")
flags.DEFINE_integer("repeats", 2, "timed runs per pass (the best is reported)")
LAYOUTS = ("padded", "packed", "grouped", "shared", "shared_grouped")
flags.DEFINE_list("layouts", list(LAYOUTS), f"which of {', '.join(LAYOUTS)} to run")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "compute dtype (weights: float32)")
flags.DEFINE_enum("remat", "none", list(REMAT_POLICIES),
                  "model.remat_policy: what the backward pass recomputes")
FLAGS = flags.FLAGS


def length_mix(rng, rows: int, prompt_len: int, prompt_min: int, cap: int, at_cap: float,
               samples: int = 1):
    """(prompt lengths, response lengths) [rows], the same prompt length in each group of
    `samples` rows."""
    plen = np.repeat(rng.integers(prompt_min, prompt_len + 1, rows // samples), samples)
    rlen = np.where(rng.random(rows) < at_cap, cap, rng.integers(1, cap + 1, rows))
    return plen, rlen


def rl_batch(rows: int, prompt_len: int, prompt_min: int, cap: int, at_cap: float,
             prompt_cols: int = 0, samples: int = 1) -> Batch:
    """`rows` sequences in groups of `samples` that share a prompt (rows g*samples ...)."""
    rng = np.random.default_rng(0)
    plen, rlen = length_mix(rng, rows, prompt_len, prompt_min, cap, at_cap, samples)
    cols = max(prompt_cols, prompt_len)
    width = cols + cap
    mask = np.zeros((rows, width), np.int32)
    for i in range(rows):
        mask[i, cols - plen[i] : cols + rlen[i]] = 1
    ids = rng.integers(3, 40000, (rows, width)).astype(np.int32)
    ids[:, :cols] = np.repeat(ids[::samples, :cols], samples, axis=0)
    ids = ids * mask
    f = lambda: rng.normal(size=(rows, cap)).astype(np.float32)  # noqa: E731
    return Batch({"input_ids": ids, "attention_mask": mask, "responses": ids[:, cols:],
                  "response_mask": mask[:, cols:], "advantages": f(),
                  "old_log_probs": f() * 0.1 - 3.0, "ref_log_prob": f() * 0.1 - 3.0})


def actor(model, layout: str, rows: int, micro: int, cap: int, samples: int = 1,
          ) -> ActorRollout:
    c = ppo_arith.get_config()
    a = c.actor
    a.ppo_mini_batch_size, a.ppo_micro_batch_size, a.shuffle = rows // samples, micro, False
    a.use_remove_padding, a.ppo_max_token_len_per_gpu = layout == "packed", 0
    a.group_by_length = layout.endswith("grouped")
    a.share_prompt = layout.startswith("shared")
    a.use_kl_loss = True
    c.rollout.n, c.rollout.response_length = samples, cap
    pool = ResourcePool("bench", tuple(jax.devices()[:1]))
    return ActorRollout("actor", pool, "fsdp=1", model, rules="train", sampler=None,
                        spec=ActorSpec.of(a), rollout=RolloutSpec.of(c.rollout),
                        optimizer=update.make_optimizer(1e-6, grad_clip=1.0))


def main(_) -> None:
    batch = rl_batch(FLAGS.rows, FLAGS.prompt_len, FLAGS.prompt_min, FLAGS.cap, FLAGS.at_cap,
                     FLAGS.prompt_cols, FLAGS.samples)
    real = int(batch["attention_mask"].sum())
    cols = batch["input_ids"].shape[1] - FLAGS.cap
    print(f"{FLAGS.rows} sequences of {cols} + {FLAGS.cap} columns: "
          f"{real} real tokens of {batch['attention_mask'].size} "
          f"({int((batch['response_mask'].sum(1) == FLAGS.cap).sum())} responses at the cap)",
          flush=True)
    out = {}
    unknown = set(FLAGS.layouts) - set(LAYOUTS)
    if unknown:
        raise app.UsageError(f"--layouts: unknown {sorted(unknown)}; choose from {LAYOUTS}")
    for name in FLAGS.layouts:
        model = M.load(str(smollm2_gguf_path()), dtype=FLAGS.dtype, param_dtype="float32",
                       remat_policy=FLAGS.remat)
        a = actor(model, name, FLAGS.rows, FLAGS.micro, FLAGS.cap, FLAGS.samples)
        if name.startswith("shared") and a.samples == 1:
            raise app.UsageError(f"--layouts={name} needs --samples > 1 dividing --micro")
        for stage, fn in (("log_prob", lambda a=a: a.compute_log_prob(batch).arrays),
                          ("update", lambda a=a: a.update_actor(batch))):
            t, runs = best_time(fn, reps=FLAGS.repeats)
            out[f"{name}_{stage}_s"] = round(t, 2)
            print(f"{name} {stage}: {t:.2f} s (runs {' '.join(f'{x:.2f}' for x in runs)})",
                  flush=True)
    others = [x for x in FLAGS.layouts if x != "padded"] if "padded" in FLAGS.layouts else []
    for name in others:
        for stage in ("log_prob", "update"):
            out[f"{stage}_{name}_vs_padded"] = round(out[f"padded_{stage}_s"]
                                                     / out[f"{name}_{stage}_s"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    app.run(main)
