"""Where a decode step's time goes: the engines' step (`hfjax.engine.decode.decode_step`) on
SmolLM2-135M-Instruct at a few row counts, over the engines' cache (prompt and response parts,
192 + 256 columns by default) and over a 16 + 16-column cache, whose attention reads next to
nothing, side by side with the same step over one array of all the columns (`--naive`: one
softmax over the whole row, the layout the engines used before the cache was split).

A step's cost is its weights' matmuls (about fixed at a given row count) plus attention over
the cache. The difference from the small cache is what attention over the columns costs.

    python -m bench.decode_step [--rows=32,64 --prompt=192 --new=256]

`--variants` times the step's ways of reading the cache side by side (`DecodeOptions`:
attention/layout pairs, e.g. full/cpu,chunked/cpu,chunked/gpu,pallas/gpu; "auto/auto" is the
platform's choice) at the same rows and columns; `--written` is the share of the response
columns written before the timed steps (0.5 by default: steps from the middle on), and
`--model=preset:NAME` times a preset architecture with random weights instead of SmolLM2:

    python -m bench.decode_step --model=preset:qwen2.5-1.5b --rows=512 --prompt=256 --new=256 \
        --written=0.5 --variants=full/cpu,full/gpu,chunked/gpu,pallas/gpu --nonaive  # a GPU

Each figure is the fastest of `--repeats` calls of a jitted loop of `--steps` steps (the cache
carried through the loop, as in the engines), divided by the steps. The last line is JSON.
"""

from __future__ import annotations

import dataclasses
import functools
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
flags.DEFINE_list("variants", ["full/cpu"], "decode reads to time, attention/layout "
                  "(rollout.decode_attention / rollout.kv_layout)")
flags.DEFINE_float("written", 0.5, "share of the response columns written before the timed steps")
flags.DEFINE_string("model", "smollm2", "smollm2 (the GGUF weights) or preset:NAME (random)")
flags.DEFINE_bool("naive", True, "also time the one-array step")


def one_array_step(model, layers, tokens, positions, mask, cache, slot):
    """The naive side: the same step over one [rows, kv_heads, head_dim, columns] key array and
    one [rows, kv_heads, columns, head_dim] value array per layer, attention one softmax over
    the row (`hfjax.models.attention.attend`)."""
    import jax.numpy as jnp

    from hfjax.engine.decode import write
    from hfjax.models import rope as R
    from hfjax.models import transformer as T
    from hfjax.models.attention import attend

    cfg = model.config
    rows, cols = mask.shape
    valid = mask.astype(bool) & (jnp.arange(cols)[None, :] <= slot)
    h = model.model.embed(tokens[:, None])
    rope = R.rope_tables(positions[:, None], R.rope_inv_freq(cfg),
                         T.storage_dtype(cfg.jnp_dtype), cols)
    zero, out = jnp.int32(0), []
    for p, (ck, cv) in zip(layers, cache):
        q, k, v = T.attention_inputs(cfg, rope, p, h)
        ck = write(ck, jnp.transpose(k, (0, 2, 3, 1)), (zero, zero, zero, slot))
        cv = write(cv, jnp.swapaxes(v, 1, 2), (zero, zero, slot, zero))
        group = cfg.num_heads // cfg.num_kv_heads
        qg = q[:, 0].reshape(rows, cfg.num_kv_heads, group, 1, cfg.head_dim)
        o = attend(qg, ck, cv, valid[:, None, None, None, :])
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
    from hfjax.engine.decode import decode_options, decode_step, empty_cache, split_layers
    from hfjax.models import presets
    from hfjax.models.backend import storage_dtype

    f = flags.FLAGS
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"{jax.default_backend()}")
    if f.model == "smollm2":
        from hfjax.models.smollm2 import smollm2_gguf_path

        model = M.load(str(smollm2_gguf_path()), dtype=f.dtype, param_dtype="float32")
    else:
        cfg = presets.get_preset(presets.preset_name(f.model))
        model = M.build(dataclasses.replace(cfg, dtype=f.dtype, param_dtype="float32"))
    variants = {v: decode_options(*v.split("/")) for v in f.variants}
    cfg = model.config
    graphdef, state = nnx.split(model)
    stored = storage_dtype(cfg.jnp_dtype)

    def step_ms(rows: int, prompt: int, new: int, naive: bool, opts=None) -> float:
        cols = prompt + new
        opts = opts or next(iter(variants.values()))
        if naive:
            kv, hd = cfg.num_kv_heads, cfg.head_dim
            cache = tuple((jnp.zeros((rows, kv, hd, cols), stored),
                           jnp.zeros((rows, kv, cols, hd), stored))
                          for _ in range(cfg.num_layers))
        else:
            cache = empty_cache(cfg, rows, prompt, new, opts.layout)
        step = one_array_step if naive else functools.partial(_step, decode_step, opts)
        start = min(int(new * f.written), new - 1)

        @jax.jit
        def loop(state, cache):
            m = nnx.merge(graphdef, state)
            layers = split_layers(m)
            mask = jnp.ones((rows, cols), jnp.int32)

            def body(i, carry):
                tokens, cache = carry
                # Response columns from `written` on: every step attends over the prompt and
                # at least that share of the response columns.
                slot = prompt + start + i % (new - start)
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
        row = table[str(rows)] = {"small_cache_ms": round(small, 2)}
        for name, opts in variants.items():
            ms = step_ms(rows, f.prompt, f.new, False, opts)
            row[name] = round(ms, 2)
            print(f"rows {rows:3d}: {name} ({opts.attention}/{opts.layout}) {f.prompt} + {f.new} "
                  f"columns {ms:7.2f} ms (attention {ms - small:+.2f} over 16 + 16 columns' "
                  f"{small:.2f} ms)", flush=True)
        if f.naive:
            first = row[next(iter(variants))]
            naive = step_ms(rows, f.prompt, f.new, True)
            row |= {"split_ms": first, "one_array_ms": round(naive, 2),
                    "ratio": round(naive / first, 3)}
            print(f"rows {rows:3d}: one array {naive:7.2f} ms: {naive / first:.2f}x "
                  f"{next(iter(variants))}", flush=True)
    print(json.dumps({"ms_per_step": table, "dtype": f.dtype, "prompt": f.prompt, "new": f.new,
                      "written": f.written, "model": f.model, "backend": jax.default_backend()}))


def _step(decode_step, opts, *args):
    return decode_step(*args, opts)


if __name__ == "__main__":
    app.run(main)
