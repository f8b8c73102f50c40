"""One layer's attention in a training pass (no cache): every query block against every key
(`dense_attention`) versus causal query blocks that read only the keys up to their own last
column (`dense_attention(..., causal=True)`), forward and forward + backward, SmolLM2-135M's
heads (9 query heads, 3 KV heads of 64) by default, 1 CPU device.

    python -m bench.attention [--rows=8 --width=384 --dtype=bfloat16 --blocks=64,128]

Prints each variant's best of `--repeats` after a compiling call, the largest difference from
the unblocked result at real (not padding) queries (0: the skipped keys are masked for them),
and a JSON line with the ratios.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from bench.timing import best_time
from hfjax.models import transformer
from hfjax.models.config import ModelConfig

flags.DEFINE_integer("rows", 8, "rows (sequences) of the micro-batch")
flags.DEFINE_integer("width", 384, "columns per row (prompt + response)")
flags.DEFINE_integer("heads", 9, "query heads")
flags.DEFINE_integer("kv_heads", 3, "key/value heads")
flags.DEFINE_integer("head_dim", 64, "dimension per head")
flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "q, k, v dtype")
flags.DEFINE_list("blocks", ["64", "96", "128"], "causal query block sizes to time")
flags.DEFINE_integer("repeats", 5, "timed calls per variant (the best is reported)")
FLAGS = flags.FLAGS


def main(_) -> None:
    b, t, n, k, h = FLAGS.rows, FLAGS.width, FLAGS.heads, FLAGS.kv_heads, FLAGS.head_dim
    cfg = ModelConfig(vocab_size=256, hidden_size=n * h, intermediate_size=4 * n * h,
                      num_layers=1, num_heads=n, num_kv_heads=k, head_dim=h)
    rng = np.random.default_rng(0)
    q, key, v = (jnp.asarray(rng.normal(size=(b, t, m, h)), FLAGS.dtype) for m in (n, k, k))
    # Left-padded rows of different lengths, as a training batch has.
    lengths = rng.integers(t // 2, t + 1, b)
    valid = jnp.asarray(np.arange(t)[None, :] >= (t - lengths)[:, None])
    mask = (jnp.tril(jnp.ones((t, t), bool))[None] & valid[:, None, :])[:, None]

    def timed(causal: bool):
        attention = transformer.dense_attention(cfg, mask, causal=causal)
        fwd = jax.jit(attention)
        grad = jax.jit(jax.grad(
            lambda q, k, v: jnp.sum(attention(q, k, v).astype(jnp.float32) ** 2), (0, 1, 2)))
        r = FLAGS.repeats
        return (best_time(fwd, q, key, v, reps=r)[0], best_time(grad, q, key, v, reps=r)[0],
                fwd(q, key, v))

    fwd0, both0, ref = timed(False)
    print(f"{b} rows x {t} columns, {n}/{k} heads of {h}, {FLAGS.dtype}")
    print(f"unblocked: forward {fwd0 * 1e3:.1f} ms, forward + backward {both0 * 1e3:.1f} ms")
    out = {"unblocked_fwd_ms": round(fwd0 * 1e3, 1), "unblocked_fwd_bwd_ms": round(both0 * 1e3, 1)}
    default = transformer.CAUSAL_BLOCK
    try:
        for c in map(int, FLAGS.blocks):
            transformer.CAUSAL_BLOCK = c
            fwd, both, got = timed(True)
            # Padding queries see no real key: their (never read) outputs are a mean over
            # whichever keys a variant reads, so only real queries are compared.
            err = jnp.abs(got.astype(jnp.float32) - ref.astype(jnp.float32))
            diff = float(jnp.max(jnp.where(valid[:, :, None, None], err, 0.0)))
            print(f"causal blocks of {c}: forward {fwd * 1e3:.1f} ms ({fwd0 / fwd:.2f}x), "
                  f"forward + backward {both * 1e3:.1f} ms ({both0 / both:.2f}x), "
                  f"max difference {diff:.3g}")
            out[f"block{c}_fwd_bwd_speedup"] = round(both0 / both, 3)
    finally:
        transformer.CAUSAL_BLOCK = default
    print(json.dumps(out))


if __name__ == "__main__":
    app.run(main)
