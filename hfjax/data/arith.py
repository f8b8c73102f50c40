"""The embedded arithmetic task: 2-digit addition and subtraction, answer after `####`.

It needs no download: prompts, ground truths and a character-level tokenizer are generated
here. Rows follow the verl prompt schema (data_source, prompt messages, ability,
reward_model{style, ground_truth}, extra_info), so the same trainer path serves parquet data.

The SFT warm-start data is deliberately imperfect, in one of two ways (`corruption`):
- "format": a fraction `corrupt_frac` of the demonstrations give the bare answer without the
  `####` marker, so the warm-started model mostly answers in a form the reward rejects;
- "carry": in a fraction `corrupt_frac` of the examples whose answer needs a carry or a borrow,
  the written answer drops it.
Either way greedy accuracy starts low while the right behaviour keeps real probability mass,
which an RL reward for exact answers can find and reinforce.
"""

from __future__ import annotations

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from hfjax.models.tokenizer import Tokenizer

DATA_SOURCE = "hfjax/arith"
SPECIALS = ["<pad>", "<bos>", "<eos>"]
CHARS = list("0123456789+-=# ")


def tokenizer() -> Tokenizer:
    """A character-level tokenizer over digits, + - = # and space."""
    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIALS)
    return Tokenizer(backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


def _no_carry(a: int, b: int, op: str) -> int:
    """The answer a student gets by working digit by digit and forgetting carries and borrows."""
    if op == "+":
        ones = (a % 10 + b % 10) % 10
        tens = a // 10 + b // 10
        return tens * 10 + ones
    ones = (a % 10 - b % 10) % 10
    tens = a // 10 - b // 10
    return tens * 10 + ones


def problems(n: int, seed: int, max_b: int = 99) -> list[dict]:
    """n problems as verl-schema rows: "a+b=" or "a-b=" with a two-digit a and 1 <= b <= max_b,
    a >= b for subtraction."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        a, b = int(rng.integers(10, 100)), int(rng.integers(1, max_b + 1))
        op = "+" if rng.random() < 0.5 else "-"
        if op == "-" and a < b:
            a, b = b, a
        answer = a + b if op == "+" else a - b
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"{a}{op}{b}="}],
                "ability": "arithmetic",
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {"index": i, "a": a, "b": b, "op": op},
            }
        )
    return rows


CORRUPTIONS = ("format", "carry", "none")


def sft_texts(
    rows: list[dict], corrupt_frac: float, seed: int, corruption: str = "format"
) -> list[tuple[str, str]]:
    """(prompt, response) pairs for the warm start, a fraction of them corrupted (see above)."""
    if corruption not in CORRUPTIONS:
        raise ValueError(f"unknown sft corruption {corruption!r}; choose one of {CORRUPTIONS}")
    rng = np.random.default_rng(seed)
    out = []
    for row in rows:
        x = row["extra_info"]
        answer = int(row["reward_model"]["ground_truth"])
        text = f"#### {answer}"
        if corruption == "carry":
            wrong = _no_carry(x["a"], x["b"], x["op"])
            if wrong != answer and rng.random() < corrupt_frac:
                text = f"#### {wrong}"
        elif corruption == "format" and rng.random() < corrupt_frac:
            text = str(answer)
        out.append((row["prompt"][-1]["content"], text))
    return out
