"""A LoRA update step with and without adapter dropout, side by side on one device.

The same model (random weights, rank-`--rank` adapters on all seven projections, B
non-zero) and the same batch of `--rows` x `--cols` tokens take optimizer steps of a
next-token cross-entropy over `--micro` strided micro-batches, once with `lora.dropout` 0
(no key, the program of a run without dropout) and once with `--dropout` (a mask drawn per
projection and layer, `hfjax.models.lora_dropout`). The two programs' steps alternate, so
that other jobs' load falls on both alike; each figure is the fastest of `--repeats` steps
after one that compiles. Also reports each compiled program's temporary bytes. The last line
is JSON.

    python -m bench.lora_dropout [--hidden=256 --layers=4 --rank=16 --rows=16 --cols=128]
"""

from __future__ import annotations

import json
import os
import platform
import time

from absl import app, flags

flags.DEFINE_integer("hidden", 256, "hidden size (heads of 64; MLP 4x)")
flags.DEFINE_integer("layers", 4, "decoder layers")
flags.DEFINE_integer("rank", 16, "adapter rank (all-linear targets)")
flags.DEFINE_float("dropout", 0.05, "adapter dropout of the second program")
flags.DEFINE_integer("rows", 16, "sequences per step")
flags.DEFINE_integer("cols", 128, "tokens per sequence")
flags.DEFINE_integer("micro", 2, "micro-batches per step")
flags.DEFINE_integer("repeats", 5, "timed steps per program (the fastest is reported)")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench.lora_model import adapted_model, bench_config
    from hfjax.engine.update import make_optimizer
    from hfjax.numerics import core
    from hfjax.parallel.mesh import ResourcePool
    from hfjax.workers.base import WorkerGroup

    d = FLAGS.hidden
    cfg = bench_config(d, FLAGS.layers, FLAGS.cols)
    rng = np.random.default_rng(0)
    ids = rng.integers(1, cfg.vocab_size, (FLAGS.rows, FLAGS.cols)).astype(np.int32)

    def group(rate: float) -> WorkerGroup:
        model, _ = adapted_model(cfg, FLAGS.rank, rng, dropout=rate)
        return WorkerGroup("actor", ResourcePool("actor", jax.devices()[:1]), "fsdp=1", model,
                           optimizer=make_optimizer(1e-3))

    runs = {}
    for rate in (0.0, FLAGS.dropout):
        g = group(rate)

        def loss(params, mb, totals, g=g):
            logits = g.model(params)(mb["ids"])[:, :-1]
            lp, _ = core.logprobs_and_entropy(logits, mb["ids"][:, 1:])
            return -jnp.mean(lp) / FLAGS.micro, {}

        step = g.update_program(loss, FLAGS.micro, normalisers=None)
        batch = {"ids": jax.device_put(ids, g.layout.replicated())}
        extra = () if g.dropout is None else (g.dropout_counter(0, 0),)
        temp = step.lower(g.params, g.opt_state, batch, *extra).compile().memory_analysis()
        runs[rate] = {"group": g, "step": step, "batch": batch, "extra": extra,
                      "temp_bytes": int(temp.temp_size_in_bytes), "times": []}

    def one(r):
        g = r["group"]
        start = time.perf_counter()
        g.params, g.opt_state, m = r["step"](g.params, g.opt_state, r["batch"], *r["extra"])
        jax.block_until_ready(m)
        return time.perf_counter() - start

    for r in runs.values():
        one(r)  # the first call of a compiled program
    for _ in range(FLAGS.repeats):
        for r in runs.values():
            r["times"].append(one(r))
    plain, dropped = runs[0.0], runs[FLAGS.dropout]
    t0, t1 = min(plain["times"]), min(dropped["times"])
    out = {
        "model": f"hidden {d}, {FLAGS.layers} layers, rank {FLAGS.rank} all-linear",
        "batch": f"{FLAGS.rows} x {FLAGS.cols} tokens, {FLAGS.micro} micro-batches",
        "dropout": FLAGS.dropout,
        "step_s_without": round(t0, 4),
        "step_s_with": round(t1, 4),
        "with / without": round(t1 / t0, 3),
        "temp_bytes_without": plain["temp_bytes"],
        "temp_bytes_with": dropped["temp_bytes"],
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                   f"{jax.devices()[0].platform}",
    }
    for k, v in out.items():
        print(f"{k}: {v}")
    print(json.dumps(out))


if __name__ == "__main__":
    app.run(main)
