"""One layer's attention in a training pass (no cache), through the model's entry point
(`hfjax.models.attention.attention_fn`), one implementation per `--impls` entry side by side:
forward and forward + backward, SmolLM2-135M's heads (9 query heads, 3 KV heads of 64) by
default, on the default device.

    python -m bench.attention [--rows=8 --width=384 --dtype=bfloat16 --impls=dense,blockwise]
    python -m bench.attention --impls=dense,xla,cudnn,blockwise --width=4096 --rows=4  # a GPU

An implementation that cannot run here is replaced as the model would replace it
(`hfjax.models.backend.attention_impl`: e.g. cudnn on a CPU runs blockwise); the line says
which ran.
Prints each variant's best of `--repeats` after a compiling call, the largest difference from
the first variant at real (not padding) queries, and a JSON line with every variant's times.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from bench.timing import best_time
from hfjax.models import attention as attn
from hfjax.models import backend
from hfjax.models.config import ModelConfig

flags.DEFINE_integer("rows", 8, "rows (sequences) of the micro-batch")
flags.DEFINE_integer("width", 384, "columns per row (prompt + response)")
flags.DEFINE_integer("heads", 9, "query heads")
flags.DEFINE_integer("kv_heads", 3, "key/value heads")
flags.DEFINE_integer("head_dim", 64, "dimension per head")
flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "q, k, v dtype")
flags.DEFINE_list("impls", ["dense", "xla", "blockwise"],
                  f"implementations to time, of {attn.IMPLEMENTATIONS}")
flags.DEFINE_integer("repeats", 5, "timed calls per variant (the best is reported)")
FLAGS = flags.FLAGS


def main(_) -> None:
    b, t, n, k, h = FLAGS.rows, FLAGS.width, FLAGS.heads, FLAGS.kv_heads, FLAGS.head_dim
    base = ModelConfig(vocab_size=256, hidden_size=n * h, intermediate_size=4 * n * h,
                       num_layers=1, num_heads=n, num_kv_heads=k, head_dim=h)
    rng = np.random.default_rng(0)
    q, key, v = (jnp.asarray(rng.normal(size=(b, t, m, h)), FLAGS.dtype) for m in (n, k, k))
    # Left-padded prompts then right-padded responses, as a training batch has.
    lo = rng.integers(0, t // 4, b)
    hi = rng.integers(t // 2, t + 1, b)
    col = np.arange(t)[None, :]
    valid = jnp.asarray((col >= lo[:, None]) & (col < hi[:, None]))
    print(f"{b} rows x {t} columns, {n}/{k} heads of {h}, {FLAGS.dtype}, "
          f"{jax.default_backend()}")
    out, ref = {"rows": b, "width": t, "dtype": FLAGS.dtype,
                "backend": jax.default_backend()}, None
    for impl in FLAGS.impls:
        cfg = dataclasses.replace(base, attention_impl=impl)
        ran = backend.attention_impl(impl, q.dtype, h)
        fn = attn.attention_fn(cfg, valid, t, q.dtype)
        fwd = jax.jit(fn)
        grad = jax.jit(jax.grad(
            lambda q, k, v, fn=fn: jnp.sum(jnp.where(valid[:, :, None, None],
                                                     fn(q, k, v).astype(jnp.float32), 0) ** 2),
            (0, 1, 2)))
        r = FLAGS.repeats
        tf, tb = best_time(fwd, q, key, v, reps=r)[0], best_time(grad, q, key, v, reps=r)[0]
        got = fwd(q, key, v).astype(jnp.float32)
        ref = got if ref is None else ref
        diff = float(jnp.max(jnp.where(valid[:, :, None, None], jnp.abs(got - ref), 0.0)))
        print(f"{impl} (runs {ran}): forward {tf * 1e3:.2f} ms, forward + backward "
              f"{tb * 1e3:.2f} ms, max difference from {FLAGS.impls[0]} {diff:.3g}")
        out[impl] = {"runs": ran, "fwd_ms": round(tf * 1e3, 3), "fwd_bwd_ms": round(tb * 1e3, 3),
                     "max_diff": diff}
    print(json.dumps(out))


if __name__ == "__main__":
    app.run(main)
