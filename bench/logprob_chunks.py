"""Log-probs and entropy over the vocabulary, whole rows against chunks of positions
(`actor.logprob_chunk`: positions per device, shared equally by the rows;
hfjax/engine/head_chunks.py), side by side on one CPU device.

The LM head of SmolLM2-135M's shape (hidden 576, vocabulary 49,152, tied to the embeddings) on
random hidden states of `--rows` rows of `--length` positions, two programs per setting:
- `score`: log-probs and entropy (the old-policy and reference scoring passes);
- `update`: the gradient of a loss that reads both, with respect to the hidden states and the
  head (the actor update's head).

For each it prints the best of `--repeats` timed runs after a compiling one, and the
compiled program's temporary bytes (`memory_analysis().temp_size_in_bytes`: the peak of what
the program allocates beyond its inputs and outputs, the dry run's figure), then the ratios
chunked / whole. The last line is JSON.

    python -m bench.logprob_chunks [--length=2048] [--chunks=0,512,2048]
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from bench.timing import best_time
from hfjax.engine import head_chunks
from hfjax.models.low_precision import matmul
from hfjax.numerics import core

flags.DEFINE_integer("rows", 2, "rows")
flags.DEFINE_integer("length", 2048, "scored positions per row")
flags.DEFINE_integer("hidden", 576, "hidden size")
flags.DEFINE_integer("vocab", 49152, "vocabulary")
flags.DEFINE_list("chunks", ["0", "512", "2048"],
                  "positions per chunk over all rows, actor.logprob_chunk (0: whole rows, the "
                  "baseline)")
flags.DEFINE_integer("repeats", 3, "timed runs per program (the best is reported)")
FLAGS = flags.FLAGS


def programs(chunk: int):
    """(score, update) jitted for one chunk size."""
    def scores(hidden, w, labels):
        def head(h, lab):
            logits = matmul(h.reshape(-1, h.shape[-1]), w, jnp.float32, transpose_w=True)
            return core.logprobs_and_entropy(logits.reshape(*h.shape[:-1], -1), lab)
        return head_chunks.over_tokens(head, chunk, 1, hidden, labels)

    def loss(hidden, w, labels):
        lp, ent = scores(hidden, w, labels)
        return jnp.mean(lp) - 0.01 * jnp.mean(ent)

    return jax.jit(scores), jax.jit(jax.grad(loss, argnums=(0, 1)))


def main(argv):
    del argv
    f = FLAGS
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.standard_normal((f.rows, f.length, f.hidden), np.float32))
    w = jnp.asarray(rng.standard_normal((f.vocab, f.hidden), np.float32) * 0.02)
    labels = jnp.asarray(rng.integers(0, f.vocab, (f.rows, f.length)), jnp.int32)
    args = (hidden, w, labels)
    chunks = [int(c) for c in f.chunks]
    if 0 not in chunks:
        chunks = [0, *chunks]
    print(f"{f.rows} rows x {f.length} positions, hidden {f.hidden}, vocabulary {f.vocab}, "
          f"float32, {jax.devices()[0].device_kind}; whole-row logits "
          f"{f.rows * f.length * f.vocab * 4 / 2**20:.0f} MiB")
    out, ref = {}, {}
    for chunk in chunks:
        row = {}
        for name, fn in zip(("score", "update"), programs(chunk)):
            temp = fn.lower(*args).compile().memory_analysis().temp_size_in_bytes
            best, _ = best_time(fn, *args, reps=f.repeats)
            row[name] = {"s": round(best, 4), "temp_mib": round(temp / 2**20, 1)}
            if chunk == 0:
                ref[name] = row[name]
            else:
                row[name]["time_ratio"] = round(best / ref[name]["s"], 3)
                row[name]["temp_ratio"] = round(temp / 2**20 / ref[name]["temp_mib"], 4)
            print(f"chunk {chunk or 'whole':>6} {name:>6}: {best:8.3f} s, "
                  f"temp {temp / 2**20:9.1f} MiB"
                  + (f"  (x{row[name]['time_ratio']} time, x{row[name]['temp_ratio']} memory)"
                     if chunk else ""))
        out[str(chunk)] = row
    print(json.dumps({"rows": f.rows, "length": f.length, "hidden": f.hidden, "vocab": f.vocab,
                      "chunks": out}))


if __name__ == "__main__":
    app.run(main)
