"""XLA matmul throughput on this machine's CPU: bfloat16 against float32, side by side.

    python bench/precision_matmul.py [--trials=7] [--min_time_s=0.3]

Shapes: the decode step's MLP matmul at 16 and 64 rows (SmolLM2-135M: 576 -> 1536) and a
square 2048^3. For bfloat16 three forms are timed: plain (bf16 x bf16 -> bf16), float32
accumulation and result (the LM head's form, `preferred_element_type=float32`), and that result
cast back to bfloat16 (what a bf16 layer uses, hfjax.models.low_precision.matmul). Prints median
GFLOP/s per form and the best bf16 form over f32; then the forward, weight-gradient and
input-gradient layouts of a 2048-row matmul (the backward pass's dots have a transposed
operand), each gradient written plainly and in the form hfjax's matmul uses; then one JSON
line. Run on an idle machine: the figures are medians of `--trials`
timings, each at least `--min_time_s` long.
"""

import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from hfjax.models import precision
from hfjax.models.low_precision import dot_form

_TRIALS = flags.DEFINE_integer("trials", 7, "timings per shape and dtype (the median is kept)")
_MIN_TIME = flags.DEFINE_float("min_time_s", 0.3, "each timing repeats the matmul this long")

SHAPES = {
    "decode 16x576x1536": (16, 576, 1536),
    "decode 64x576x1536": (64, 576, 1536),
    "square 2048^3": (2048, 2048, 2048),
}
# (operand dtype, accumulation/result dtype, dtype the result is cast to)
FORMS = {
    "f32": (jnp.float32, None, None),
    "bf16": (jnp.bfloat16, None, None),
    "bf16->f32": (jnp.bfloat16, jnp.float32, None),
    "bf16->f32->bf16": (jnp.bfloat16, jnp.float32, jnp.bfloat16),
}


# Where the backward pass's dots put their transposes, for x [M, K], w [K, N], g [M, N]: the
# forward x @ w, the weight gradient x.T @ g and the input gradient g @ w.T, each written
# plainly and in the form hfjax's matmul uses (hfjax.models.low_precision.dot_form).
LAYOUTS = {
    "forward x@w": lambda m, k, n: ((m, k), (k, n), lambda a, b, acc: jnp.dot(
        a, b, preferred_element_type=acc)),
    "weight grad x.T@g": lambda m, k, n: ((m, k), (m, n), lambda a, b, acc: jnp.dot(
        a.T, b, preferred_element_type=acc)),
    "weight grad, hfjax": lambda m, k, n: ((m, k), (m, n), lambda a, b, acc: dot_form(
        a, b, "aTb")),
    "input grad g@w.T": lambda m, k, n: ((m, n), (k, n), lambda a, b, acc: jnp.dot(
        a, b.T, preferred_element_type=acc)),
    "input grad, hfjax": lambda m, k, n: ((m, n), (k, n), lambda a, b, acc: dot_form(
        a, b, "abT")),
}


def gflops(m: int, k: int, n: int, dtype, acc_dtype, cast_dtype,
           layout: str = "forward x@w") -> float:
    """Median GFLOP/s of a jitted [m, k] @ [k, n] in `dtype`, accumulated in `acc_dtype` (None:
    the operands' dtype) and cast to `cast_dtype` (None: left as is), with the operands
    transposed as in `layout`."""
    rng = np.random.default_rng(0)
    a_shape, b_shape, product = LAYOUTS[layout](m, k, n)
    a = jnp.asarray(rng.standard_normal(a_shape, np.float32), dtype)
    b = jnp.asarray(rng.standard_normal(b_shape, np.float32), dtype)

    def mm(x, y):
        out = product(x, y, acc_dtype)
        return out if cast_dtype is None else out.astype(cast_dtype)

    f = jax.jit(mm)
    f(a, b).block_until_ready()
    # Enough calls per timing to last min_time_s, so per-call dispatch does not dominate.
    t0 = time.perf_counter()
    f(a, b).block_until_ready()
    reps = max(1, int(_MIN_TIME.value / max(time.perf_counter() - t0, 1e-6)))
    rates = []
    for _ in range(_TRIALS.value):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = f(a, b)
        out.block_until_ready()
        rates.append(2 * m * k * n * reps / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)


def main(argv):
    del argv
    cpu = next((line.split(":", 1)[1].strip() for line in precision._host_cpuinfo().splitlines()
                if line.startswith("model name")), platform.processor())
    native = list(precision.native_bf16_flags())
    print(f"{cpu}; native bf16 flags: {native or 'none'}; {jax.device_count()} "
          f"{jax.devices()[0].platform} device(s), jax {jax.__version__}")
    results = {}
    print(f"{'shape':20s}" + "".join(f"{f:>17s}" for f in FORMS) + "   best bf16 / f32")
    for label, (m, k, n) in SHAPES.items():
        row = {form: gflops(m, k, n, *spec) for form, spec in FORMS.items()}
        row["best_bf16_over_f32"] = max(v for f, v in row.items() if f != "f32") / row["f32"]
        results[label] = {k: round(v, 2) for k, v in row.items()}
        print(f"{label:20s}" + "".join(f"{row[f]:17.1f}" for f in FORMS)
              + f"   {row['best_bf16_over_f32']:.2f}x")
    m, k, n = 2048, 576, 1536
    print(f"\ntransposed operands, as in the backward pass ({m} x {k} x {n}):")
    print(f"{'layout':20s}{'f32':>17s}{'bf16->f32':>17s}   bf16 / f32")
    layouts = {}
    for layout in LAYOUTS:
        f32 = gflops(m, k, n, *FORMS["f32"], layout=layout)
        bf16 = gflops(m, k, n, *FORMS["bf16->f32"], layout=layout)
        layouts[layout] = {"f32": round(f32, 2), "bf16->f32": round(bf16, 2),
                           "ratio": round(bf16 / f32, 2)}
        print(f"{layout:20s}{f32:17.1f}{bf16:17.1f}   {bf16 / f32:.2f}x")
    print(json.dumps({"cpu": cpu, "native_bf16": native,
                      "gflops": results, "layouts": layouts}))


if __name__ == "__main__":
    app.run(main)
