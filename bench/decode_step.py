"""Where a decode step's time goes: the engines' step (`hfjax.engine.decode.decode_step`) on
SmolLM2-135M-Instruct at a few row counts and cache widths, against the same step over a
32-column cache, whose attention reads next to nothing.

A step's cost is its weights' matmuls (about fixed at a given row count) plus attention over
the cache (rows x columns). The difference between a width and the 32-column step is what
attention over those columns costs, so the table says how much a step would gain from reading
fewer cache columns (shared prompts, skipped padding) at each size.

    python -m bench.decode_step [--rows=32,64 --widths=32,256,448 --dtype=bfloat16]

Each figure is the fastest of `--repeats` calls of a jitted loop of `--steps` steps (the cache
carried through the loop, as in the engines), divided by the steps. The last line is JSON.
"""

from __future__ import annotations

import json
import os
import platform

from absl import app, flags

flags.DEFINE_list("rows", ["32", "64"], "decode rows (slots)")
flags.DEFINE_list("widths", ["32", "256", "448"], "cache columns (prompt + new-token buckets)")
flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "compute dtype (weights f32)")
flags.DEFINE_integer("steps", 16, "decode steps per timed call")
flags.DEFINE_integer("repeats", 3, "timed calls per size (the fastest is reported)")


def main(argv: list[str]) -> None:
    del argv
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import hfjax.models as M
    from bench.timing import best_time
    from hfjax.engine.decode import LayerCache, decode_step, split_layers
    from hfjax.models.smollm2 import smollm2_gguf_path
    from hfjax.models.transformer import storage_dtype

    f = flags.FLAGS
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    model = M.load(str(smollm2_gguf_path()), dtype=f.dtype, param_dtype="float32")
    cfg = model.config
    graphdef, state = nnx.split(model)
    stored = storage_dtype(cfg.jnp_dtype)
    steps = f.steps

    def step_ms(rows: int, width: int) -> float:
        cache = tuple(
            LayerCache(jnp.zeros((rows, cfg.num_kv_heads, cfg.head_dim, width), stored),
                       jnp.zeros((rows, cfg.num_kv_heads, width, cfg.head_dim), stored))
            for _ in range(cfg.num_layers))
        mask = jnp.ones((rows, width), jnp.int32)

        @jax.jit
        def loop(state, cache):
            m = nnx.merge(graphdef, state)
            layers = split_layers(m)

            def body(i, carry):
                tokens, cache = carry
                # Columns from the middle on: every step attends over at least half the cache.
                logits, cache = decode_step(m, layers, tokens, jnp.full((rows,), 16 + i), mask,
                                            cache, width // 2 + i % (width // 2))
                return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache

            return jax.lax.fori_loop(0, steps, body, (jnp.zeros((rows,), jnp.int32), cache))

        # Each call runs `steps` steps and splits the layers once: that per-call slice and
        # cast is the engines' per-rollout cost, here spread over `steps` steps.
        return best_time(loop, state, cache, reps=f.repeats)[0] / steps * 1e3

    table = {}
    for rows in map(int, f.rows):
        base = None
        for width in sorted(map(int, f.widths)):
            ms = step_ms(rows, width)
            base = ms if base is None else base
            table[f"{rows}x{width}"] = round(ms, 1)
            print(f"rows {rows:3d}, cache {width:4d} columns: {ms:6.1f} ms per step "
                  f"({ms - base:+.1f} ms over the {min(map(int, f.widths))}-column step)",
                  flush=True)
    print(json.dumps({"ms_per_step": table, "dtype": f.dtype}))


if __name__ == "__main__":
    app.run(main)
