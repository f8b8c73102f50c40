"""One GRPO step pipeline on an accelerator, measured: decode, rollout, update and scoring
against the device's peak, HF transformers `generate` at the same shape, and the dry run's
predicted memory against the measured peak.

    python -m bench.accelerator            # qwen2.5-1.5b preset, bf16, remat full, 64 x 8 rows
    python -m bench.accelerator --tiny     # the tiny preset and batch (CPU; the test suite)
    python -m bench.accelerator --config.model.remat_policy=none   # any config key

The run is the project's own: `Trainer` with its worker groups runs `--steps` GRPO steps after
one warm-up step (compiles), on `configs/grpo_arith.py` set to the shape below (random
weights, `model.path=preset:...`; the embedded arithmetic prompts padded to 32 tokens; no EOS
stop in practice: random weights rarely sample it, and `rollout.response_length` bounds the
loop). Figures are medians over the measured steps:

- `decode_ms_per_step`: the generation stage's time over the new tokens (prefill included);
- `decode_bound_ms`: one decode step's matmul FLOPs (every layer's projections and the LM
  head over the rows, per device) over the peak bf16 matmul FLOP/s measured in this run
  (`matmul_peak_flops`: the best of a few large square bf16 matmuls on one device);
- `rollout_tokens_per_s`: rows x new tokens over the generation stage's time;
- `update_mfu`, `ref_mfu`: `hfjax.run.mfu` (6N + attention per trained token, 2N + attention per
  scored token) over the stage times and the device kind's peak (`targets.peak_flops`), or the
  measured matmul peak where the kind has none (CPU); `mfu_peak` says which;
- `hf_generate_ratio`: hfjax's rollout tokens/s over HF `generate` (random-weight Qwen2 from
  `transformers.Qwen2Config` with the model's sizes, bf16, sampling the same rows x new tokens
  from the same prompt length); null unless torch with CUDA is importable;
- `dry_run_peak_bytes`: `hfjax.run.dry_run` at the same config on these devices (abstract shapes);
  `measured_peak_bytes`: `memory_stats()["peak_bytes_in_use"]` of device 0 after the steps
  (null on CPU).

The last line printed is JSON.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from launch import smoke  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs", "grpo_arith.py"),
    "the run config (GRPO on the arithmetic task); --config.KEY=VALUE overrides any key after "
    "the benchmark's shape is applied")
flags.DEFINE_bool("tiny", False, "the tiny preset and a tiny batch (CPU, the test suite)")
flags.DEFINE_integer("steps", 2, "measured GRPO steps after one warm-up step")
flags.DEFINE_bool("hf", True, "compare with HF transformers generate when torch has CUDA")
flags.DEFINE_bool("dry_run", True, "run the dry run at the same config for its predicted peak")
flags.DEFINE_string("compilation_cache_dir", "auto", "JAX's persistent compilation cache "
                    "(launch/compile_cache.py): the run's programs are read back from the dry "
                    "run's compiles; off: none")
FLAGS = flags.FLAGS

# The shape: (preset, prompts, samples per prompt, new tokens, prompt tokens).
FULL = ("qwen2.5-1.5b", 64, 8, 256, 32)
TINY = ("tiny", 4, 2, 8, 16)


def configure(cfg, tiny: bool):
    """The benchmark's shape on the GRPO config; the command line's overrides win."""
    preset, prompts, n, new, prompt_len = TINY if tiny else FULL
    overrides = {a.split("=", 1)[0][len("--config."):] for a in sys.argv[1:]
                 if a.startswith("--config.")}

    def put(key, value):
        if key in overrides:
            return
        node = cfg
        *path, last = key.split(".")
        for p in path:
            node = node[p]
        node[last] = value

    put("model.path", f"preset:{preset}")
    put("model.dtype", "bfloat16")
    put("model.remat_policy", "none" if tiny else "full")
    put("data.train_batch_size", prompts)
    put("data.max_prompt_length", prompt_len)
    put("rollout.n", n)
    put("rollout.response_length", new)
    put("actor.ppo_mini_batch_size", prompts)
    put("actor.ppo_micro_batch_size", prompts * n if tiny else 64)
    put("sft.steps", 0)
    if tiny:
        put("data.n_train", 64)
        put("data.n_test", 16)
    put("trainer.sync_stage_timing", True)
    put("trainer.test_freq", 0)
    put("trainer.out_dir", tempfile.mkdtemp(prefix="hfjax_bench_accel_"))
    put("reward.num_processes", 0)
    return cfg


def matmul_peak(size: int, repeats: int = 10) -> float:
    """FLOP/s of the best of `repeats` [size, size] x [size, size] bf16 matmuls on device 0."""
    import jax
    import jax.numpy as jnp

    dev = jax.devices()[0]
    a = jax.device_put(jnp.ones((size, size), jnp.bfloat16), dev)
    b = jax.device_put(jnp.ones((size, size), jnp.bfloat16), dev)
    mm = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    mm(a, b).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        mm(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * size**3 / best


def decode_step_flops(mcfg, rows: int) -> float:
    """Matmul FLOPs of one decode step over `rows` rows: every layer's projections and the LM
    head (attention over the cache is memory-bound and left out)."""
    from hfjax.models.flops import layer_matmul_params

    return 2.0 * rows * (mcfg.num_layers * layer_matmul_params(mcfg)
                         + mcfg.hidden_size * mcfg.vocab_size)


def hf_generate_tokens_per_s(mcfg, rows: int, prompt_len: int, new: int) -> float | None:
    """HF transformers `generate` tokens/s with a random-weight Qwen2 of the model's sizes, bf16
    on CUDA; None when torch with CUDA or transformers is not importable."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    hf_cfg = transformers.Qwen2Config(
        vocab_size=mcfg.vocab_size, hidden_size=mcfg.hidden_size,
        intermediate_size=mcfg.intermediate_size, num_hidden_layers=mcfg.num_layers,
        num_attention_heads=mcfg.num_heads, num_key_value_heads=mcfg.num_kv_heads,
        max_position_embeddings=max(mcfg.max_position_embeddings, prompt_len + new),
        tie_word_embeddings=mcfg.tie_word_embeddings, torch_dtype="bfloat16")
    # Built on the GPU in bf16 directly: a float32 init of 1.5B parameters on the host is slow.
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = transformers.Qwen2ForCausalLM(hf_cfg).eval()
    finally:
        torch.set_default_dtype(default)
    ids = torch.randint(3, mcfg.vocab_size, (rows, prompt_len), device="cuda")
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=True, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), **dict(kw, max_new_tokens=4,
                                                                         min_new_tokens=4))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    made = (out.shape[1] - prompt_len) * rows
    del model
    torch.cuda.empty_cache()
    return made / seconds


def main(argv: list[str]) -> None:
    del argv
    import jax

    from hfjax.parallel import targets
    from hfjax.run import mfu
    from hfjax.run.trainer import Trainer
    from launch import compile_cache

    compile_cache.enable(FLAGS.compilation_cache_dir)
    # Smoke mode (HFJAX_SMOKE=1, launch/smoke.py) runs the tiny shape.
    FLAGS.tiny = FLAGS.tiny or smoke.enabled()
    cfg = configure(_CONFIG.value, FLAGS.tiny)
    dev = jax.devices()[0]
    t_start = time.perf_counter()

    dry_peak = None
    if FLAGS.dry_run:
        from hfjax.run.dry_run import dry_run

        dry_peak = dry_run(cfg).peak_bytes_per_device

    trainer = Trainer(cfg)
    steps = []
    for i in range(1 + FLAGS.steps):
        metrics = trainer.train_step()
        if i:  # the first step compiles
            steps.append(metrics)

    def median(key: str) -> float:
        return statistics.median(m[key] for m in steps)

    mcfg = trainer.model_cfg
    rows = int(cfg.data.train_batch_size) * int(cfg.rollout.n)
    new = int(cfg.rollout.response_length)
    gen_s = median("timing_s/gen")
    peak_table = targets.peak_flops(dev.device_kind)
    measured = matmul_peak(256 if FLAGS.tiny else 8192)
    peak = peak_table or measured
    w = trainer.workers
    mfus = [mfu.step_mfu(
        mcfg, m, rows=rows, tokens=m["perf/total_num_tokens"],
        response_tokens=m["response_length/mean"] * rows, epochs=int(cfg.actor.ppo_epochs),
        actor_devices=w.actor.mesh.devices.size,
        ref_devices=(w.ref or w.actor).mesh.devices.size, peak=peak) for m in steps]
    decode_devices = w.actor.sampler.mesh.devices.size if w.actor.sampler.mesh is not None else 1

    hf = hf_generate_tokens_per_s(mcfg, rows, int(cfg.data.max_prompt_length), new) \
        if FLAGS.hf else None
    stats = dev.memory_stats() if dev.platform != "cpu" else None
    rollout_tps = rows * new / gen_s
    out = {
        "device_kind": dev.device_kind,
        "num_devices": jax.device_count(),
        "jax_version": jax.__version__,
        "decode_ms_per_step": 1e3 * gen_s / new,
        "decode_bound_ms": 1e3 * decode_step_flops(mcfg, rows) / decode_devices / measured,
        "matmul_peak_flops": measured,
        "rollout_tokens_per_s": rollout_tps,
        "update_mfu": statistics.median(m["perf/mfu/actor"] for m in mfus),
        "ref_mfu": statistics.median(m["perf/mfu/ref"] for m in mfus)
        if all("perf/mfu/ref" in m for m in mfus) else None,
        "mfu_peak": "table" if peak_table else "measured_matmul",
        "hf_generate_tokens_per_s": hf,
        "hf_generate_ratio": rollout_tps / hf if hf else None,
        "dry_run_peak_bytes": dry_peak,
        "measured_peak_bytes": (stats or {}).get("peak_bytes_in_use"),
        "step_s": median("timing_s/step"),
        "gen_s": gen_s,
        "ref_s": median("timing_s/ref") if all("timing_s/ref" in m for m in steps) else None,
        "update_actor_s": median("timing_s/update_actor"),
        "wall_s": time.perf_counter() - t_start,
        "config": {"model": cfg.model.path, "dtype": cfg.model.dtype,
                   "param_dtype": cfg.model.param_dtype,
                   "remat_policy": cfg.model.remat_policy, "prompts": cfg.data.train_batch_size,
                   "n": cfg.rollout.n, "new_tokens": new,
                   "prompt_tokens": cfg.data.max_prompt_length,
                   "actor_mesh": cfg.actor.mesh, "rollout_mesh": cfg.rollout.mesh,
                   "overrides": [a for a in sys.argv[1:] if a.startswith("--config.")],
                   "measured_steps": len(steps)},
    }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    app.run(main)
