"""The embedded tool-use task: products of 3- and 4-digit numbers, which the tiny model cannot
work out in its head, with the `calculator` tool at hand.

A prompt is "a*b="; a good response calls the calculator in the Hermes/Qwen format,

    <tool_call>{"name": "calculator", "arguments": {"expression": "a*b"}}</tool_call>

reads the result the environment appends (`<tool_response>N</tool_response>`: the fixed
rendering of a tokenizer without a chat template, `hfjax.agents.render`), and answers
`#### N`. The reward is the arithmetic task's (`####` then the exact product).

The tokenizer is character-level over printable ASCII plus added tokens for the tags and the
JSON keys and tool name, so a tool call is about 27 tokens and every id decodes back to the
text it stands for (the parser reads real JSON, and error observations read as written).

The warm-start demonstrations are deliberately imperfect: only a fraction `tool_frac` of them
use the tool; the rest answer straight away with the right product, which the model cannot
reproduce. The warm-started policy therefore calls the tool in only some of its samples, and
an exact-answer reward can find and reinforce the calls.
"""

from __future__ import annotations

import json

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from hfjax.data import holdout
from hfjax.data.sft import SFTData, SFTExample
from hfjax.models.tokenizer import Tokenizer
from hfjax.tools.prompt import tools_kwargs

DATA_SOURCE = "hfjax/arith_tool"
SPECIALS = ["<pad>", "<bos>", "<eos>"]
# Every printable ASCII character, so error observations ("Error: malformed tool call: ...")
# reach the policy as written.
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
# Added (not special) tokens: decoding keeps them, so the policy's text holds its tool calls.
WORDS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", '"name"',
         '"arguments"', '"calculator"', '"expression"']


def tokenizer() -> Tokenizer:
    """The task's tokenizer (module docstring)."""
    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS + WORDS)}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIALS)
    backend.add_tokens(WORDS)
    return Tokenizer(backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


def tool_call_text(a: int, b: int) -> str:
    """The calculator call for a * b, as the policy writes it."""
    body = json.dumps({"name": "calculator", "arguments": {"expression": f"{a}*{b}"}})
    return f"<tool_call>{body}</tool_call>"


AGENT_NAME = "tool_agent"


def draw(rng: np.random.Generator, lo: int, hi: int) -> tuple[int, int]:
    """Two operands of lo..hi digits each (the number of digits drawn first, per operand)."""
    a, b = (int(rng.integers(10 ** (d - 1), 10 ** d)) for d in rng.integers(lo, hi + 1, size=2))
    return a, b


def row(a: int, b: int, index: int | None = None) -> dict:
    """The row in verl's schema for "a*b=": the product as ground truth, and verl's multi-turn
    fields (`agent_name`, `extra_info.tools_kwargs`, `extra_info.interaction_kwargs`)."""
    query, product = f"{a}*{b}=", str(a * b)
    extra = {} if index is None else {"index": index}
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": query}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": product},
        "agent_name": AGENT_NAME,
        "extra_info": {
            **extra,
            "a": a,
            "b": b,
            "tools_kwargs": tools_kwargs(("calculator",), query),
            "interaction_kwargs": {"name": "arith_tool", "query": query,
                                   "ground_truth": product},
        },
    }


def problems(n: int, seed: int, digits: tuple[int, int] = (3, 4),
             split: str | None = None) -> list[dict]:
    """n rows (`row`) with operands of digits[0]..digits[1] digits each; `split` "train" or
    "test" draws from its side of the held-out partition (hfjax.data.holdout), None from all."""
    lo, hi = digits
    if not 1 <= lo <= hi:
        raise ValueError(f"digits={digits}: give (fewest, most) digits, 1 <= fewest <= most")
    rng = np.random.default_rng(seed)
    keep = holdout.keeper(split, n, f"arith_tool test split with digits={digits}",
                          "lower data.n_test")
    rows: list[dict] = []
    while len(rows) < n:
        a, b = draw(rng, lo, hi)
        if keep(f"{a}*{b}="):
            rows.append(row(a, b, index=len(rows)))
    return rows


def demonstrations(tok: Tokenizer, rows: list[dict], tool_frac: float, seed: int) -> SFTData:
    """Warm-start examples for `rows`: a fraction `tool_frac` call the calculator, read its
    result and answer (the result's tokens are context: loss mask 0, as in RL); the rest
    answer `#### <product>` straight away."""
    if not 0.0 <= tool_frac <= 1.0:
        raise ValueError(f"tool_frac={tool_frac}: it must lie in [0, 1]")
    rng = np.random.default_rng(seed)
    eos = [tok.eos_id]
    out = []
    for row in rows:
        x = row["extra_info"]
        prompt = tok.encode(row["prompt"][-1]["content"], add_special_tokens=False)
        answer = tok.encode(f"#### {x['a'] * x['b']}", add_special_tokens=False) + eos
        if rng.random() < tool_frac:
            call = tok.encode(tool_call_text(x["a"], x["b"]), add_special_tokens=False)
            result = tok.encode(f"<tool_response>{x['a'] * x['b']}</tool_response>",
                                add_special_tokens=False)
            ids = call + result + answer
            mask = [1] * len(call) + [0] * len(result) + [1] * len(answer)
        else:
            ids, mask = answer, [1] * len(answer)
        out.append(SFTExample(tuple(prompt), tuple(ids), tuple(mask)))
    return SFTData(out, "arith_tool demonstrations", rows_read=len(out))
