"""Responses of 32,768 tokens through both rollout engines: the decode cache, the new-token
buckets and continuous batching at reasoning length.

`preset:tiny` (random weights, float32) answers `--prompts` left-padded prompts of different
lengths, one sample each, at temperature 1 with no stop ids, so every response runs to the cap
(`--max_new`, default 32,768) and is truncated, as a reasoning run's longest responses are. The
sides, on the same inputs and per-prompt seeds:
- `static`: `Sampler` (one row per response, all decoding until the cap);
- `continuous`: `ContinuousSampler` with `--slots` decode slots (0: one per request) refilled
  every `--refill_every` steps.

Each side runs `--repeats` times; the first run's compile seconds (`hfjax.controller.compile_log`)
are taken out of its time and printed on their own. Per side: median seconds, ms per decode step,
the response lengths, the share of rows cut at the cap (`response_length/clip_ratio`), the
KV-cache columns the engine sized, and whether its rows equal the static engine's (tokens and
masks exactly, log-probs within 1e-5). The last line is JSON.

    python -m bench.long_decode                      # 4 prompts, 32,768 new tokens
    python -m bench.long_decode --max_new=8192 --slots=2

Smoke mode (HFJAX_SMOKE=1, launch/smoke.py) decodes 64 tokens.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launch import smoke  # noqa: E402

flags.DEFINE_integer("prompts", 4, "prompts (one response each)")
flags.DEFINE_integer("max_new", 32768, "new tokens per response (no stop ids: all run to it)")
flags.DEFINE_integer("slots", 0, "continuous batching: decode slots (0: one per request)")
flags.DEFINE_integer("refill_every", 8, "continuous batching: decode steps between refills")
flags.DEFINE_integer("repeats", 1, "timed runs per side (median reported)")
flags.DEFINE_integer("seed", 0, "prompt and sampling seed")


def main(argv: list[str]) -> None:
    del argv
    import jax
    import numpy as np
    from flax import nnx

    import hfjax.models as M
    from hfjax.controller import compile_log
    from hfjax.engine import Sampler, SamplingParams
    from hfjax.engine.continuous import ContinuousSampler

    f = flags.FLAGS
    max_new = min(f.max_new, 64) if smoke.enabled() else f.max_new
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"jax {jax.__version__}, {jax.devices()[0].platform}")
    model = M.load("preset:tiny", dtype="float32")
    vocab = model.config.vocab_size
    rng = np.random.default_rng(f.seed)
    lengths = np.linspace(3, 17, f.prompts).astype(int)
    width = int(lengths.max())
    ids = np.zeros((f.prompts, width), np.int32)
    mask = np.zeros((f.prompts, width), np.int32)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = rng.integers(1, vocab, n)
        mask[i, width - n:] = 1
    params = SamplingParams(max_new_tokens=max_new, temperature=1.0, n=1, eos_ids=())
    seeds = np.arange(f.prompts) + 1000 * f.seed
    state = nnx.state(model)
    engines = {"static": Sampler(model),
               "continuous": ContinuousSampler(model, slots=f.slots,
                                               refill_every=f.refill_every)}
    print(f"preset:tiny, {f.prompts} prompts of {lengths.min()}-{lengths.max()} tokens, "
          f"{max_new} new tokens each, temperature 1, no stop ids")

    log = compile_log.install()
    times: dict[str, list[float]] = {k: [] for k in engines}
    compiled: dict[str, float] = {k: 0.0 for k in engines}
    outs = {}
    for _ in range(f.repeats):
        for name, engine in engines.items():
            log.take()
            start = time.perf_counter()
            out = engine.generate(engine.place(state), ids, mask, params, seeds)
            jax.block_until_ready(out)
            wall = time.perf_counter() - start
            spent = log.take().seconds
            compiled[name] += spent
            times[name].append(wall - spent)
            outs[name] = out

    ref = outs["static"]
    result: dict = {"max_new": max_new, "prompts": f.prompts, "sides": {}}
    for name, out in outs.items():
        m = np.asarray(out.mask)
        got = m.sum(axis=1)
        same = (np.array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
                and np.array_equal(m, np.asarray(ref.mask))
                and np.allclose(np.asarray(out.logprobs), np.asarray(ref.logprobs), atol=1e-5))
        med = statistics.median(times[name])
        steps = max_new - 1  # the first token comes from the prefill
        side = {"median_s": round(med, 3), "ms_per_step": round(1e3 * med / steps, 3),
                "compile_s": round(compiled[name], 1),
                "response_lengths": sorted(set(got.tolist())),
                "clip_ratio": float(np.mean(got == max_new)),
                "equal_to_static": bool(same)}
        result["sides"][name] = side
        print(f"{name}: {med:.2f} s ({side['ms_per_step']} ms per decode step; compiling "
              f"{compiled[name]:.1f} s, not included); response lengths "
              f"{side['response_lengths']}, clip_ratio {side['clip_ratio']:.2f}; rows equal to "
              f"static: {same}")
    cont = engines["continuous"]
    result["sides"]["continuous"] |= {"decode_steps": int(cont.last_stats["decode_steps"]),
                                      "slots": int(cont.compile_log[-1].slots)}
    print(f"continuous: {cont.compile_log[-1].slots} slots, "
          f"{int(cont.last_stats['decode_steps'])} decode steps")
    s, c = result["sides"]["static"]["median_s"], result["sides"]["continuous"]["median_s"]
    result["continuous_vs_static"] = round(s / c, 3) if c else None
    print(json.dumps(result))


if __name__ == "__main__":
    app.run(main)
