"""Writes the workloads' shared inputs: weights, tokenizer and prompts (idempotent).

    python bench/peers/make_assets.py tiny      # in the TRL venv: torch + transformers
    python bench/peers/make_assets.py smollm2   # after launch.convert wrote <dir>/model
    python bench/peers/make_assets.py smollm2_natural  # hfjax's python (reasoning_gym), ditto

tiny: a Qwen2ForCausalLM drawn by transformers' own initialiser under torch.manual_seed(0)
(f32, one model.safetensors), a word-level tokenizer "<pad> <eos> <unk> t3 ... t1023" saved as
tokenizer.json + tokenizer_config.json, and 16 prompts of 32 random words.

smollm2: 8 prompts of 32 tokens, BOS then 31 tokens drawn from SmolLM2's vocabulary among those
that are a space and a lowercase word, kept only when the text tokenizes back to those ids.

smollm2_natural: 8 reasoning-gym gsm_symbolic questions (seed 0), each with hfjax's GSM
instruction to end with the answer after "####" (`hfjax.data.prepare.make_splits`, the rows
the GRPO recipe trains on), rendered as text by SmolLM2's own chat template with the
generation prompt: the default system turn, the user turn, then `<|im_start|>assistant\n`.
The text starts with `<|im_start|>`, SmolLM2's BOS, so Tunix's BOS prepending (which drops a
duplicate) leaves the ids as they are.

prompts.json holds each prompt's text and its token ids; every runner checks that its own
tokenization of the text gives these ids. The assets follow the workload's defaults: the
PEERS_PROMPTS / PEERS_NEW_TOKENS debug overrides only cut what the runners read.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload  # noqa: E402

SPECIALS = ["<pad>", "<eos>", "<unk>"]


def _write_prompts(w: workload.Workload, texts: list[str], ids: list[list[int]]) -> None:
    with open(os.path.join(w.dir, "prompts.json"), "w") as f:
        json.dump({"texts": texts, "ids": ids}, f)


def make_tiny(w: workload.Workload) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = 1024
    os.makedirs(w.model_dir, exist_ok=True)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=True,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=1,
        pad_token_id=0,
        dtype="float32",
    )
    torch.manual_seed(w.seed)
    model = Qwen2ForCausalLM(cfg).to(torch.float32)
    # Non-zero q/k/v biases, so every framework's bias path matters.
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.02)
    model.save_pretrained(w.model_dir, safe_serialization=True)

    words = SPECIALS + [f"t{i}" for i in range(len(SPECIALS), vocab)]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    fast.save_pretrained(w.model_dir)

    rng = np.random.default_rng(1234)
    ids = rng.integers(len(SPECIALS), vocab, size=(w.prompts, w.prompt_len)).tolist()
    texts = [" ".join(words[i] for i in row) for row in ids]
    for t, row in zip(texts, ids):
        assert fast(t)["input_ids"] == row, "word-level tokenizer does not round-trip"
    _write_prompts(w, texts, ids)


def make_smollm2(w: workload.Workload) -> None:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(w.model_dir)
    words = [
        i for t, i in tok.get_vocab().items()
        if t.startswith("Ġ") and len(t) >= 4 and t[1:].isascii() and t[1:].isalpha()
        and t[1:].islower()
    ]
    words.sort()
    rng = np.random.default_rng(1234)
    texts, ids = [], []
    # Tunix prepends the tokenizer's BOS to every prompt; starting each prompt with it gives
    # every framework the same ids.
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    while len(texts) < w.prompts:
        row = bos + rng.choice(words, size=w.prompt_len - len(bos), replace=False).tolist()
        text = tok.decode(row)
        # TRL tokenizes with special tokens on, hfjax with them off; both must give `row`.
        plain = tok(text, add_special_tokens=False)["input_ids"]
        if tok(text)["input_ids"] == row and plain == row:
            texts.append(text)
            ids.append(row)
    _write_prompts(w, texts, ids)


def make_natural(w: workload.Workload) -> None:
    from transformers import PreTrainedTokenizerFast

    from hfjax.data.prepare import make_splits

    tok = PreTrainedTokenizerFast.from_pretrained(w.model_dir)
    if not tok.chat_template:
        raise SystemExit(f"{w.model_dir}: the tokenizer has no chat template")
    rows, _ = make_splits("gsm_symbolic", w.prompts, 0, seed=w.seed)
    texts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
             for r in rows]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    for t, row in zip(texts, ids):
        # TRL tokenizes with special tokens on, hfjax with them off; both must give `row`, and
        # the row must start with BOS for Tunix (module docstring).
        if tok(t)["input_ids"] != row or row[0] != tok.bos_token_id:
            raise AssertionError(f"{t[:60]!r}...: ids differ with special tokens, or no BOS")
    _write_prompts(w, texts, ids)


def main() -> None:
    name = sys.argv[1]
    workload.get(name)  # checks the name
    w = workload.WORKLOADS[name]
    if os.path.exists(w.prompts_path):
        print(f"{w.dir}: assets already there")
        return
    os.makedirs(w.dir, exist_ok=True)
    {"tiny": make_tiny, "smollm2": make_smollm2, "smollm2_natural": make_natural}[name](w)
    print(f"{w.dir}: wrote model, tokenizer and {w.prompts} prompts")


if __name__ == "__main__":
    main()
