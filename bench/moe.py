"""The mixture-of-experts MLP against a dense MLP of the same active parameters, side by side.

    python -m bench.moe [--tokens=4096] [--hidden=256] [--experts=8] [--k=2] [--reps=7]

Times forward + backward (gradients of every weight and of the input) of one MLP block on
`--tokens` tokens: the dense gated MLP of width k x expert width (the same parameters per
token as the sparse block's k experts), the sparse block with dropless dispatch (assignments
sorted by expert) by each grouped matmul, blocks of rows (`moe.blocked_experts`, what CPUs
run) and `jax.lax.ragged_dot` (what GPUs and TPUs run; `backend.blocked_grouped_matmul`),
and with capacity dispatch (`--capacity_factor`, 1.25; experts / k drops nothing). Reports
tokens/s (fastest of `--reps`: other jobs only slow a sample down) and each sparse path's
ratio to the dense one. Then, on 8 simulated CPU devices (`--ep_mesh`, experts split
over `expert`), the bytes one device's all-to-alls move per sparse layer in the forward pass,
read from the compiled program, against the ideal: each of its tokens' hidden states out to
its k experts and back (2 x tokens x k x hidden x 4 bytes). Then one JSON line.

XLA:CPU expands ragged_dot into one masked dense product per expert (E times the active
FLOPs); the blocks compute at most (tokens x k + E x block) rows.
"""

import json
import os
import platform

# Eight simulated devices for the exchange's bytes (before JAX starts).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp
from absl import app, flags  # noqa: E402

from bench.timing import best_time  # noqa: E402
from hfjax.models import backend, hf_io, moe  # noqa: E402
from hfjax.models.config import ModelConfig  # noqa: E402
from hfjax.parallel import sharding as shd  # noqa: E402
from hfjax.parallel.hlo import collectives  # noqa: E402
from hfjax.parallel.mesh import MeshSpec, batch_sharding  # noqa: E402

_TOKENS = flags.DEFINE_integer("tokens", 4096, "tokens per forward + backward")
_HIDDEN = flags.DEFINE_integer("hidden", 256, "hidden size")
_EXPERT = flags.DEFINE_integer("expert_width", 256, "each expert's MLP width")
_EXPERTS = flags.DEFINE_integer("experts", 8, "experts")
_K = flags.DEFINE_integer("k", 2, "experts per token")
_REPS = flags.DEFINE_integer("reps", 7, "timed calls per path")
_CF = flags.DEFINE_float("capacity_factor", 1.25, "capacity dispatch's factor (experts / k: "
                         "no token can be dropped)")
_EP_MESH = flags.DEFINE_string("ep_mesh", "fsdp=2,expert=4", "mesh of the exchange's bytes")
_EP_ROWS = flags.DEFINE_integer("ep_rows", 16, "rows of the exchange's batch")
_EP_LEN = flags.DEFINE_integer("ep_len", 64, "tokens per row of the exchange's batch")


def exchange_bytes(base: ModelConfig) -> dict[str, dict[str, float]]:
    """{dispatch: {bytes, ideal, ratio}} of one device's all-to-alls per sparse layer."""
    mesh = MeshSpec.parse(_EP_MESH.value).build(jax.devices()[:8])
    lay = shd.layout(mesh, "train")
    out = {}
    for impl in ("ragged", "capacity"):
        cfg = base.replace(moe_impl=impl, num_layers=1, vocab_size=512, num_heads=4,
                           num_kv_heads=4, head_dim=16)
        model = hf_io.build_sharded(cfg, mesh=mesh)
        ids = jax.ShapeDtypeStruct((_EP_ROWS.value, _EP_LEN.value), jnp.int32,
                                   sharding=batch_sharding(mesh))
        text = jax.jit(shd.under_layout(lay, lambda i, m=model: m(i))).lower(ids).compile()
        moved = sum(c.nbytes for c in collectives(text.as_text()) if c.op == "all-to-all")
        dp = len(mesh.devices.flat) // mesh.shape.get("tensor", 1) // mesh.shape.get(
            "sequence", 1)
        tokens = _EP_ROWS.value * _EP_LEN.value // dp
        ideal = 2 * tokens * cfg.num_experts_per_tok * cfg.hidden_size * 4
        out[impl] = {"bytes": moved, "ideal": ideal, "ratio": round(moved / ideal, 2)}
        print(f"all-to-all per layer, {impl:8s}: {moved / 1e6:.3f} MB per device, ideal "
              f"{ideal / 1e6:.3f} MB: {moved / ideal:.2f}x")
    return out


def _dense_mlp(p, x):
    g = x @ p["gate"]
    return (jax.nn.silu(g) * (x @ p["up"])) @ p["down"]


def _step(mlp):
    def loss(p, x):
        return jnp.mean(mlp(p, x).astype(jnp.float32) ** 2)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def _sparse(cfg: ModelConfig, target: str | None):
    def mlp(p, x):
        with backend.compiling_for(target):
            return moe.sparse_mlp(cfg, p, x)[0]

    return mlp


def main(argv):
    del argv
    D, Fe, E, k, N = _HIDDEN.value, _EXPERT.value, _EXPERTS.value, _K.value, _TOKENS.value
    keys = iter(jax.random.split(jax.random.key(0), 8))

    def w(*shape):
        return jax.random.normal(next(keys), shape) / shape[-2] ** 0.5

    x = jax.random.normal(next(keys), (1, N, D))
    sparse = {"router": w(D, E), "expert_gate": w(E, D, Fe), "expert_up": w(E, D, Fe),
              "expert_down": w(E, Fe, D)}
    dense = {"gate": w(D, k * Fe), "up": w(D, k * Fe), "down": w(k * Fe, D)}
    base = ModelConfig(vocab_size=8, hidden_size=D, intermediate_size=k * Fe, num_layers=1,
                       num_heads=1, num_kv_heads=1, head_dim=8, model_type="qwen3_moe",
                       num_experts=E, num_experts_per_tok=k, moe_intermediate_size=Fe,
                       norm_topk_prob=True, capacity_factor=_CF.value)
    paths = {"dense": (_step(lambda p, x: _dense_mlp(p, x[0])), dense)}
    # The grouped matmul is chosen per platform; tracing as for another one picks the other.
    for name, impl, target in (("moe blocks", "ragged", "cpu"),
                               ("moe ragged_dot", "ragged", "gpu"),
                               ("moe capacity", "capacity", None)):
        paths[name] = (_step(_sparse(base.replace(moe_impl=impl), target)), sparse)
    results = {}
    for name, (fn, params) in paths.items():
        best, _ = best_time(fn, params, x, reps=_REPS.value)
        results[name] = N / best
        print(f"{name:14s} {N / best:12.0f} tokens/s  ({best * 1e3:.1f} ms)")
    for name in ("moe blocks", "moe ragged_dot", "moe capacity"):
        print(f"{name} / dense: {results[name] / results['dense']:.2f}")
    exchange = exchange_bytes(base)
    print(json.dumps({"exchange": exchange, "bench": "moe",
                      "machine": platform.processor() or platform.machine(),
                      "backend": jax.default_backend(), "tokens": N, "hidden": D,
                      "expert_width": Fe, "experts": E, "k": k,
                      "tokens_per_s": {k_: round(v) for k_, v in results.items()}}))


if __name__ == "__main__":
    app.run(main)
