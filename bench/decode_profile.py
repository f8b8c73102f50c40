"""The rollout's decode step on an accelerator: milliseconds per step for each way the step can
read its KV cache (`rollout.decode_attention` x `rollout.kv_layout`), and where a step's device
time goes, kernel by kernel, from a profiler trace.

    python -m bench.decode_profile                        # qwen2.5-1.5b preset, 512 rows
    python -m bench.decode_profile --variants=pallas:gpu --trace_dir=/tmp/trace
    python -m bench.decode_profile --preset=tiny --rows=4 --new=8   # any machine, in seconds

Each variant builds a `Sampler` over the preset's random weights (bf16), samples `--new`
tokens (temperature 1, no stop token) for `--rows` prompts of `--prompt` tokens, and reports
(generation - a 1-token call) / (new - 1): the decode loop's time per step, prefill excluded.
A variant `read:layout:separate` keeps the q/k/v and gate/up weights separate
(`hfjax.engine.decode.split_layers(fuse=False)`) where the backend would fuse them. With
`--trace_dir`, one generation of the first variant is traced (`jax.profiler`) and the kernels
with the most device time are listed. The last line is JSON.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import statistics
import time

from absl import app, flags

flags.DEFINE_string("preset", "qwen2.5-1.5b", "model preset (random weights, bf16)")
flags.DEFINE_integer("rows", 512, "rows decoded at once")
flags.DEFINE_integer("prompt", 32, "prompt tokens per row")
flags.DEFINE_integer("new", 256, "new tokens per row")
flags.DEFINE_list("variants", ["full:cpu", "chunked:gpu", "pallas:gpu"],
                  "read:layout[:separate] entries (rollout.decode_attention:rollout.kv_layout)")
flags.DEFINE_integer("repeats", 3, "timed calls per variant (median)")
flags.DEFINE_string("trace_dir", "", "trace the first variant's generation here")
flags.DEFINE_integer("top", 25, "kernels to list from the trace")
FLAGS = flags.FLAGS


def _median_s(fn, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def kernel_table(trace_dir: str, top: int) -> list[tuple[str, float, int]]:
    """(kernel, device ms, launches) of the `top` kernels by device time in the Perfetto trace
    `jax.profiler` wrote under `trace_dir` (events of processes named after a device)."""
    files = glob.glob(os.path.join(trace_dir, "**", "*perfetto_trace.json.gz"), recursive=True)
    if not files:
        return []
    with gzip.open(max(files, key=os.path.getmtime)) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and "/device:" in names.get(e.get("pid"), ""):
            total[e["name"]] += e.get("dur", 0)
            count[e["name"]] += 1
    return [(n, us / 1e3, count[n]) for n, us in total.most_common(top)]


def main(argv: list[str]) -> None:
    del argv
    import jax
    import numpy as np
    from flax import nnx

    import hfjax.models as M
    from hfjax.engine import Sampler, SamplingParams
    from hfjax.engine import decode as decode_lib

    f = FLAGS
    model = M.load(f"preset:{f.preset}", dtype="bfloat16", param_dtype="bfloat16")
    vocab = model.config.vocab_size
    ids = np.random.default_rng(0).integers(min(100, vocab // 2), vocab,
                                            (f.rows, f.prompt)).astype(np.int32)
    mask = np.ones_like(ids)
    _, state = nnx.split(model)
    print(f"{jax.devices()[0].device_kind}: {f.preset}, {f.rows} rows, {f.prompt} + {f.new} "
          f"tokens, jax {jax.__version__}", flush=True)
    fuse = decode_lib.fuses_for_layout
    result: dict = {"device": jax.devices()[0].device_kind, "preset": f.preset, "rows": f.rows,
                    "prompt": f.prompt, "new": f.new, "variants": {}}
    for i, variant in enumerate(f.variants):
        read, layout, *rest = variant.split(":")
        decode_lib.fuses_for_layout = (lambda: False) if rest == ["separate"] else fuse
        try:
            sampler = Sampler(model, decode_attention=read, kv_layout=layout)
            one = SamplingParams(max_new_tokens=1)
            full = SamplingParams(max_new_tokens=f.new)
            t0 = time.perf_counter()
            jax.block_until_ready(sampler.generate(state, ids, mask, full))
            first = time.perf_counter() - t0
            prefill = _median_s(lambda s=sampler, p=one: s.generate(state, ids, mask, p), f.repeats)
            gen = _median_s(lambda s=sampler, p=full: s.generate(state, ids, mask, p), f.repeats)
            if i == 0 and f.trace_dir:
                with jax.profiler.trace(f.trace_dir, create_perfetto_trace=True):
                    jax.block_until_ready(sampler.generate(state, ids, mask, full))
        finally:
            decode_lib.fuses_for_layout = fuse
        step_ms = (gen - prefill) / max(f.new - 1, 1) * 1e3
        result["variants"][variant] = {"ms_per_step": round(step_ms, 3),
                                       "tokens_per_s": round(f.rows * f.new / gen),
                                       "prefill_s": round(prefill, 4),
                                       "first_call_s": round(first, 1)}
        print(f"{variant}: {step_ms:.2f} ms per decode step, {f.rows * f.new / gen:,.0f} "
              f"tokens/s (first call, compiles included, {first:.1f} s)", flush=True)
    if f.trace_dir:
        table = kernel_table(f.trace_dir, f.top)
        total = sum(ms for _, ms, _ in table)
        print(f"kernels with the most device time in one traced generation ({f.variants[0]}):")
        for name, ms, n in table:
            print(f"  {ms:9.2f} ms  {n:7d} launches  {name[:90]}")
        result["top_kernels"] = [{"kernel": n[:120], "ms": round(ms, 2), "launches": c}
                                 for n, ms, c in table]
        result["top_kernels_ms"] = round(total, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    app.run(main)
