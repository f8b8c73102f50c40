"""Compile time of a SmolLM2-135M (30 layers) forward + backward, with and without layer scan.

Usage: python bench/compile_time.py [--layers=30] [--batch=2] [--seq=64]
Prints one row per mode and a final JSON line with both times and their ratio.
"""

import json
import time

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import nnx

from hfjax.models import transformer
from hfjax.models.presets import get_preset

flags.DEFINE_integer("layers", 30, "decoder layers")
_BATCH = flags.DEFINE_integer("batch", 2, "batch size")
_SEQ = flags.DEFINE_integer("seq", 64, "sequence length")


def compile_seconds(scan: bool, layers: int, batch: int, seq: int) -> float:
    cfg = get_preset("smollm2-135m").replace(num_layers=layers, scan_layers=scan)
    graphdef, state = nnx.split(transformer.abstract(cfg))

    def loss(state, ids):
        logits = nnx.merge(graphdef, state)(ids)
        return jnp.mean(jax.nn.logsumexp(logits, -1))

    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    t0 = time.perf_counter()
    jax.jit(jax.value_and_grad(loss)).lower(state, ids).compile()
    return time.perf_counter() - t0


def main(_):
    layers = flags.FLAGS.layers
    res = {}
    for scan in (True, False):
        res["scan" if scan else "unrolled"] = s = compile_seconds(
            scan, layers, _BATCH.value, _SEQ.value
        )
        name = "scan" if scan else "unrolled"
        print(f"{name:>9}: {s:6.1f} s to compile fwd+bwd, {layers} layers")
    res["unrolled_over_scan"] = res["unrolled"] / res["scan"]
    print(json.dumps({k: round(v, 2) for k, v in res.items()}))


if __name__ == "__main__":
    app.run(main)
