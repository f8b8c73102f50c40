"""Rollout throughput: hfjax's KV-cache sampler vs HF transformers `generate` vs a naive JAX loop.

All three run greedy decoding of SmolLM2-135M-Instruct (the GGUF weights dequantised to float32,
the same numbers on both sides) for the same batch of prompts, forced to full length (no stop
tokens), one after another in one process on the same machine, in one precision for all
(`--precision`): `f32`, or `bf16` compute over the float32 weights (hfjax `dtype=bfloat16`,
HF under `torch.autocast("cpu", torch.bfloat16)`):

- hfjax: `Sampler.generate` (jitted prefill + `lax.while_loop` decode over a donated KV cache),
  timed after a warm-up call that compiles;
- HF: `model.generate(do_sample=False)` on torch CPU with its default dynamic KV cache;
- naive: a jitted full forward pass over the prompt plus a fixed `prompt + new_tokens` padded
  window, re-run for every new token (no KV cache). Its per-step cost is constant by
  construction, so it is timed for `--naive_steps` steps and its tokens/s is batch / median step
  time.

Tokens/s counts generated tokens (batch x new tokens) over the wall time of the whole call,
prefill included. The last line printed is JSON.

    python -m bench.rollout  # batch 16, prompt 64, 128 new tokens, f32
    python -m bench.rollout --precision=bf16
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time

from absl import app, flags

flags.DEFINE_integer("batch", 16, "prompts per batch")
flags.DEFINE_integer("prompt_len", 64, "tokens per prompt (no padding)")
flags.DEFINE_integer("new_tokens", 128, "generated tokens per prompt (forced: no EOS)")
flags.DEFINE_integer("repeats", 5, "timed runs per engine, alternating (median reported)")
flags.DEFINE_integer("naive_steps", 3, "timed steps of the naive loop")
flags.DEFINE_enum("precision", "f32", ["f32", "bf16"],
                  "compute precision of every engine: f32, or bf16 over float32 weights")
flags.DEFINE_string("model", None, "GGUF file (default: the SmolLM2-135M-Instruct GGUF)")
flags.DEFINE_bool("skip_hf", False, "skip the transformers side (for profiling hfjax alone)")
flags.DEFINE_bool("skip_naive", False, "skip the naive JAX loop")
flags.DEFINE_bool(
    "floor",
    True,
    "also time the decode step's matmuls alone (every layer's projections and the LM head at "
    "the decode batch) and report them against hfjax's measured step, with the ceiling they "
    "imply (prompt pass + matmuls alone per step)",
)
flags.DEFINE_list(
    "hf_threads",
    ["2", "1"],
    "torch thread counts to time HF with; the fastest median is reported. On 2 shared cores "
    "torch's 2-thread kernels can stall badly when other jobs run, 1 thread does not.",
)


def main(argv: list[str]) -> None:
    del argv
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import hfjax.models as M
    from hfjax.engine import Sampler, SamplingParams
    from hfjax.models.smollm2 import smollm2_gguf_path

    f = flags.FLAGS
    path = str(f.model or smollm2_gguf_path())
    batch, prompt_len, new = f.batch, f.prompt_len, f.new_tokens
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    print(f"load average (1, 5, 15 min) at the start: {os.getloadavg()}")
    print(f"model: {path}\nbatch={batch} prompt_len={prompt_len} new_tokens={new} (greedy), "
          f"precision {f.precision}")

    bf16 = f.precision == "bf16"
    model = M.load(path, dtype="bfloat16" if bf16 else "float32", param_dtype="float32")
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    # Ordinary (non-special) ids; every prompt full length, so no padding on either side.
    ids = rng.integers(100, vocab, (batch, prompt_len)).astype(np.int32)
    mask = np.ones_like(ids)
    generated = batch * new

    # ---- hfjax ----
    sampler = Sampler(model)
    _, state = nnx.split(model)
    params = SamplingParams(max_new_tokens=new, temperature=0.0)

    def run_hfjax():
        out = sampler.generate(state, ids, mask, params)
        return jax.block_until_ready(out)

    start = time.perf_counter()
    run_hfjax()
    print(f"hfjax: warm-up (compile + run) {time.perf_counter() - start:.1f}s", flush=True)

    # ---- HF transformers ----
    run_hf = None
    if not f.skip_hf:
        import torch
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
        ).eval()
        t_ids, t_mask = torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)

        def run_hf(max_new=new):
            with torch.inference_mode(), torch.autocast("cpu", torch.bfloat16, enabled=bf16):
                return hf.generate(
                    input_ids=t_ids,
                    attention_mask=t_mask,
                    do_sample=False,
                    max_new_tokens=max_new,
                    min_new_tokens=max_new,
                    pad_token_id=0,
                )

        run_hf(4)  # warm-up: allocator and oneDNN kernels
        print(f"HF: torch {torch.__version__}, threads {f.hf_threads}", flush=True)

    # The machine is shared: alternate the engines so both see the same background load.
    hfjax_times: list[float] = []
    hf_times: dict[int, list[float]] = {int(t): [] for t in f.hf_threads}
    out = hf_out = None
    for _ in range(f.repeats):
        start = time.perf_counter()
        out = run_hfjax()
        hfjax_times.append(time.perf_counter() - start)
        line = f"run {len(hfjax_times)}: hfjax {hfjax_times[-1]:.2f}s"
        if run_hf is not None:
            for threads, times in hf_times.items():
                torch.set_num_threads(threads)
                start = time.perf_counter()
                hf_out = run_hf()
                times.append(time.perf_counter() - start)
                line += f", HF/{threads} threads {times[-1]:.2f}s"
        print(line, flush=True)
    hfjax_s = statistics.median(hfjax_times)
    hfjax_tokens = np.asarray(out.tokens)
    assert int(np.asarray(out.mask).sum()) == generated, "hfjax stopped early"
    hfjax_tok_s = generated / hfjax_s
    print(f"hfjax: median {hfjax_s:.2f}s per batch -> {hfjax_tok_s:.1f} tok/s")
    hf_tok_s = float("nan")
    if run_hf is not None:
        hf_tokens = hf_out[:, prompt_len:].numpy()
        assert hf_tokens.shape == (batch, new), hf_tokens.shape
        agree = float((hf_tokens == hfjax_tokens).mean())
        medians = {threads: statistics.median(times) for threads, times in hf_times.items()}
        for threads, median in medians.items():
            print(f"HF/{threads} threads: median {median:.2f}s -> {generated / median:.1f} tok/s")
        hf_tok_s = generated / min(medians.values())
        print(f"HF (fastest setting): {hf_tok_s:.1f} tok/s; tokens equal to hfjax's: {agree:.1%}")
        del hf, run_hf

    # ---- where a decode step's time goes ----
    if f.floor:
        floor_s = _decode_floor(model, batch, hfjax_s, new)
        # The prompt pass as the engine runs it: a 1-token call is the prefill plus one
        # sampled token (compute-bound, near the machine's matmul peak).
        one = SamplingParams(max_new_tokens=1, temperature=0.0)
        jax.block_until_ready(sampler.generate(state, ids, mask, one))
        prefill_times = []
        for _ in range(3):
            start = time.perf_counter()
            jax.block_until_ready(sampler.generate(state, ids, mask, one))
            prefill_times.append(time.perf_counter() - start)
        prefill_s = statistics.median(prefill_times)
        # The most an engine on these matmuls could reach: the prompt pass, then every
        # decode step costing its weight matmuls and nothing else (no attention, norms or
        # sampling). An upper bound on speedup_vs_hf.
        ceiling = generated / (prefill_s + (new - 1) * floor_s)
        line = (
            f"ceiling: prompt pass {prefill_s:.2f}s + {new - 1} steps of matmuls alone "
            f"-> {ceiling:.0f} tok/s"
        )
        if not math.isnan(hf_tok_s):  # HF was measured
            line += f", {ceiling / hf_tok_s:.2f}x HF"
        print(line, flush=True)

    # ---- naive JAX: full forward per token over a fixed padded window ----
    naive_tok_s = float("nan")
    if not f.skip_naive:
        graphdef = nnx.graphdef(model)
        width = prompt_len + new

        @jax.jit
        def naive_step(state, ids, mask, idx):
            m = nnx.merge(graphdef, state)
            hidden, _ = m.model(ids, mask)  # no cache: every position recomputed
            logits = m.logits(jax.lax.dynamic_index_in_dim(hidden, idx, axis=1, keepdims=False))
            tok = jnp.argmax(logits, axis=-1).astype(ids.dtype)
            ids = jax.lax.dynamic_update_index_in_dim(ids, tok, idx + 1, axis=1)
            mask = jax.lax.dynamic_update_index_in_dim(mask, jnp.ones_like(tok), idx + 1, axis=1)
            return ids, mask

        w_ids = np.zeros((batch, width), np.int32)
        w_ids[:, :prompt_len] = ids
        w_mask = np.zeros((batch, width), np.int32)
        w_mask[:, :prompt_len] = 1
        carry = (jnp.asarray(w_ids), jnp.asarray(w_mask))
        carry = jax.block_until_ready(naive_step(state, *carry, prompt_len - 1))  # compile
        steps = []
        for k in range(f.naive_steps):
            start = time.perf_counter()
            carry = jax.block_until_ready(naive_step(state, *carry, prompt_len + k))
            steps.append(time.perf_counter() - start)
        naive_step_s = statistics.median(steps)
        naive_tok_s = batch / naive_step_s
        naive_tokens = np.asarray(carry[0])[:, prompt_len : prompt_len + 1 + f.naive_steps]
        agree = float((naive_tokens == hfjax_tokens[:, : 1 + f.naive_steps]).mean())
        print(
            f"naive JAX: {naive_step_s:.2f}s per step -> {naive_tok_s:.1f} tok/s "
            f"({width}-token window, {f.naive_steps} timed steps); "
            f"first tokens equal to hfjax's: {agree:.1%}"
        )

    result = {
        "hfjax_tok_s": round(hfjax_tok_s, 2),
        "hf_tok_s": round(hf_tok_s, 2),
        "naive_tok_s": round(naive_tok_s, 2),
        "speedup_vs_hf": round(hfjax_tok_s / hf_tok_s, 2),
        "precision": f.precision,
    }
    print(f"load average (1, 5, 15 min) at the end: {os.getloadavg()}")
    print(json.dumps(result))


def _decode_floor(model, rows: int, hfjax_s: float, new_tokens: int) -> float:
    """Times one decode step's weight matmuls alone and prints them next to the engine's step.

    A [rows, D] activation goes through every layer's q, k, v, o, gate, up and down projections
    and the LM head, each a 2-D matmul on the model's own weights (sliced per layer beforehand,
    as the engine does), with no attention, norms or sampling. The median engine step is the
    whole call's time over the new tokens (prefill included, so it is an upper bound).
    Returns the matmuls' median time.
    """
    import jax
    import jax.numpy as jnp

    cfg = model.config
    stacked = model.model.layers.arrays()
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    def as_2d(name: str, w):  # the engine's 2-D matmul form of each projection
        return w.reshape(-1, cfg.hidden_size) if name == "o_proj" else w.reshape(w.shape[0], -1)

    # Weights in the compute dtype, cast once (as the engine's decode loop has them).
    dt = cfg.jnp_dtype
    layers = [[as_2d(n, stacked[n][i]).astype(dt) for n in names] for i in range(cfg.num_layers)]
    head = model.model.embed_tokens[...] if cfg.tie_word_embeddings else model.lm_head[...]
    head = (head.T if cfg.tie_word_embeddings else head).astype(dt)

    def mm(x, w):  # the engine's form: compute-dtype operands, float32 accumulation
        return jnp.dot(x.astype(dt), w, preferred_element_type=jnp.float32).astype(dt)

    @jax.jit
    def matmuls(x, layers, head):
        for q, k, v, o, g, u, d in layers:
            a = mm(x, q)
            x = x + mm(a, o) + jnp.sum(mm(x, k)) + jnp.sum(mm(x, v))
            x = x + mm(jax.nn.silu(mm(x, g)) * mm(x, u), d)
            x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
        return jnp.dot(x, head, preferred_element_type=jnp.float32)

    x = jnp.ones((rows, cfg.hidden_size), cfg.jnp_dtype)
    jax.block_until_ready(matmuls(x, layers, head))
    times = []
    for _ in range(20):
        start = time.perf_counter()
        jax.block_until_ready(matmuls(x, layers, head))
        times.append(time.perf_counter() - start)
    step = statistics.median(times)
    params = sum(w.size for layer in layers for w in layer) + head.size
    flops = 2 * rows * params
    engine_step = hfjax_s / new_tokens
    print(
        f"decode step: matmuls alone {step * 1e3:.1f} ms ({flops / 1e9:.2f} GFLOP, "
        f"{flops / step / 1e9:.0f} GFLOP/s, "
        f"{params * jnp.dtype(dt).itemsize / step / 1e9:.1f} GB/s of "
        f"weights); hfjax's whole step {engine_step * 1e3:.1f} ms, so matmuls are "
        f"{step / engine_step:.0%} of it",
        flush=True,
    )
    return step


if __name__ == "__main__":
    app.run(main)
