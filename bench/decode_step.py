"""Where a decode step's time goes: the engines' step (`hfjax.engine.decode.decode_step`) on
SmolLM2-135M-Instruct at a few row counts, over the engines' cache (prompt and response parts,
192 + 256 columns by default) and over a 16 + 16-column cache, whose attention reads next to
nothing, side by side with the same step over one array of all the columns (`--naive`: one
softmax over the whole row, the layout the engines used before the cache was split).

A step's cost is its weights' matmuls (about fixed at a given row count) plus attention over
the cache. The difference from the small cache is what attention over the columns costs.

    python -m bench.decode_step [--rows=32,64 --prompt=192 --new=256]

Each figure is the fastest of `--repeats` calls of a jitted loop of `--steps` steps (the cache
carried through the loop, as in the engines), divided by the steps. The last line is JSON.
"""

from __future__ import annotations

import json
import os
import platform

from absl import app, flags

flags.DEFINE_list("rows", ["32", "64"], "decode rows (slots)")
flags.DEFINE_integer("prompt", 192, "prompt columns (the prompt bucket)")
flags.DEFINE_integer("new", 256, "response columns (the new-token bucket)")
flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "compute dtype (weights f32)")
flags.DEFINE_integer("steps", 16, "decode steps per timed call")
flags.DEFINE_integer("repeats", 3, "timed calls per size (the fastest is reported)")


def one_array_step(model, layers, tokens, positions, mask, cache, slot):
    """The naive side: the same step over one [rows, kv_heads, head_dim, columns] key array and
    one [rows, kv_heads, columns, head_dim] value array per layer, attention one softmax over
    the row (`hfjax.models.attention.attend`)."""
    import jax.numpy as jnp

    from hfjax.engine.decode import write
    from hfjax.models import transformer as T

    cfg = model.config
    rows, cols = mask.shape
    valid = mask.astype(bool) & (jnp.arange(cols)[None, :] <= slot)
    h = model.model.embed(tokens[:, None])
    rope = T.rope_tables(positions[:, None], T.rope_inv_freq(cfg),
                         T.storage_dtype(cfg.jnp_dtype), cols)
    zero, out = jnp.int32(0), []
    for p, (ck, cv) in zip(layers, cache):
        q, k, v = T.attention_inputs(cfg, rope, p, h)
        ck = write(ck, jnp.transpose(k, (0, 2, 3, 1)), (zero, zero, zero, slot))
        cv = write(cv, jnp.swapaxes(v, 1, 2), (zero, zero, slot, zero))
        group = cfg.num_heads // cfg.num_kv_heads
        qg = q[:, 0].reshape(rows, cfg.num_kv_heads, group, 1, cfg.head_dim)
        o = T.attend(qg, ck, cv, valid[:, None, None, None, :])
        h = T.layer_output(cfg, p, h, o.reshape(rows, 1, cfg.num_heads, cfg.head_dim))
        out.append((ck, cv))
    h = T.rms_norm(h, model.model.norm[...], cfg.rms_norm_eps)
    return model.logits(h[:, 0]), tuple(out)


def main(argv: list[str]) -> None:
    del argv
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import hfjax.models as M
    from bench.timing import best_time
    from hfjax.engine.decode import decode_step, empty_cache, split_layers
    from hfjax.models.smollm2 import smollm2_gguf_path
    from hfjax.models.transformer import storage_dtype

    f = flags.FLAGS
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    model = M.load(str(smollm2_gguf_path()), dtype=f.dtype, param_dtype="float32")
    cfg = model.config
    graphdef, state = nnx.split(model)
    stored = storage_dtype(cfg.jnp_dtype)

    def step_ms(rows: int, prompt: int, new: int, naive: bool) -> float:
        cols = prompt + new
        if naive:
            kv, hd = cfg.num_kv_heads, cfg.head_dim
            cache = tuple((jnp.zeros((rows, kv, hd, cols), stored),
                           jnp.zeros((rows, kv, cols, hd), stored))
                          for _ in range(cfg.num_layers))
        else:
            cache = empty_cache(cfg, rows, prompt, new)
        step = one_array_step if naive else decode_step

        @jax.jit
        def loop(state, cache):
            m = nnx.merge(graphdef, state)
            layers = split_layers(m)
            mask = jnp.ones((rows, cols), jnp.int32)

            def body(i, carry):
                tokens, cache = carry
                # Response columns from the middle on: every step attends over the prompt
                # and at least half the response columns.
                slot = prompt + new // 2 + i % (new // 2)
                logits, cache = step(m, layers, tokens, jnp.full((rows,), 16 + i), mask,
                                     cache, slot)
                return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache

            return jax.lax.fori_loop(0, f.steps, body, (jnp.zeros((rows,), jnp.int32), cache))

        # Each call runs `steps` steps and splits the layers once: that per-call slice and
        # cast is the engines' per-rollout cost, here spread over `steps` steps.
        return best_time(loop, state, cache, reps=f.repeats)[0] / f.steps * 1e3

    table = {}
    for rows in map(int, f.rows):
        small = step_ms(rows, 16, 16, False)
        split, naive = step_ms(rows, f.prompt, f.new, False), step_ms(rows, f.prompt, f.new, True)
        table[str(rows)] = {"small_cache_ms": round(small, 1), "split_ms": round(split, 1),
                            "one_array_ms": round(naive, 1), "ratio": round(naive / split, 3)}
        print(f"rows {rows:3d}: 16 + 16 columns {small:6.1f} ms; {f.prompt} + {f.new} columns: "
              f"prompt and response parts {split:6.1f} ms (attention {split - small:+.1f}), one "
              f"array {naive:6.1f} ms (attention {naive - small:+.1f}): {naive / split:.2f}x",
              flush=True)
    print(json.dumps({"ms_per_step": table, "dtype": f.dtype, "prompt": f.prompt, "new": f.new}))


if __name__ == "__main__":
    app.run(main)
