"""The embedded arithmetic task: 2-digit addition and subtraction, answer after `####`; and
its long form, the chain (data.task=arith_chain: `chain`), a + steps * b worked line by line.

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

from hfjax.data import holdout
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


def problems(n: int, seed: int, max_b: int = 99, plus_only: bool = False,
             split: str | None = None) -> list[dict]:
    """n problems as verl-schema rows: "a+b=" or "a-b=" with a two-digit a and 1 <= b <= max_b,
    a >= b for subtraction (only "a+b=" with `plus_only`). `split` "train" draws only problems
    outside the held-out part of the space (hfjax.data.holdout), "test" only distinct held-out
    ones; None draws from the whole space."""
    rng = np.random.default_rng(seed)
    keep = holdout.keeper(split, n, f"arith test split with max_b={max_b}",
                          "lower data.n_test or raise data.max_b")
    rows = []
    while len(rows) < n:
        a, b = int(rng.integers(10, 100)), int(rng.integers(1, max_b + 1))
        op = "+" if plus_only or rng.random() < 0.5 else "-"
        if op == "-" and a < b:
            a, b = b, a
        if not keep(f"{a}{op}{b}="):
            continue
        answer = a + b if op == "+" else a - b
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"{a}{op}{b}="}],
                "ability": "arithmetic",
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {"index": len(rows), "a": a, "b": b, "op": op},
            }
        )
    return rows


CORRUPTIONS = ("format", "carry", "none")


def scratchpad(a: int, b: int, op: str, answer: int, lines: int) -> str:
    """A long worked scratchpad for "a op b": `lines` lines counting down from lines - 1 to 0,
    each restating the problem and its result, fixed width (`SCRATCHPAD_LINE` = 14 characters:
    "157 47+08=055 "), so n lines are 14 n tokens and each line is the line before with its
    counter lowered by one. The demonstrations' final answer follows it."""
    sign = "-" if answer < 0 else ""
    line = f"{a:02d}{op}{b:02d}={sign}{abs(answer):03d}"
    return "".join(f"{i:03d} {line} " for i in range(lines - 1, -1, -1))


SCRATCHPAD_LINE = 14  # characters (tokens) of one scratchpad line: "157 47+08=055 "

# -- the chain task (data.task=arith_chain): long responses that must be right throughout ------

CHAIN_SOURCE = "hfjax/arith_chain"
CHAIN_LINE = 13  # characters (tokens) of one chain line: "78 047+8=055 "
CHAIN_MAX = 999  # the chain's running sums are written with three digits
CHAIN_STEPS_MAX = 100  # its line counter has two


def chain(a: int, b: int, steps: int) -> str:
    """The worked chain for "a+b=" (data.task=arith_chain): `steps` fixed-width lines, each
    adding b to the sum the line before it ended with, "78 047+8=055 77 055+8=063 ... 00
    ...", so the last line ends with a + steps * b. Each line opens with a counter down to 00,
    which tells the model where the chain ends. Every line is the line before with its counter
    lowered, its sum moved to the front and b added, a three-digit addition with carries; one
    wrong digit anywhere changes every sum after it."""
    if not 1 <= steps <= CHAIN_STEPS_MAX:
        raise ValueError(f"a chain of {steps} steps: its counter has two digits; use 1 to "
                         f"{CHAIN_STEPS_MAX} (data.chain_steps)")
    if a + steps * b > CHAIN_MAX:
        raise ValueError(f"the chain of {a}+{b} over {steps} steps passes {CHAIN_MAX}, more "
                         "than its three digits hold; lower data.chain_steps or data.max_b")
    return "".join(f"{steps - 1 - k:02d} {a + k * b:03d}+{b}={a + (k + 1) * b:03d} "
                   for k in range(steps))


def chain_problems(n: int, seed: int, steps: int, max_b: int = 9,
                   split: str | None = None) -> list[dict]:
    """n chain problems: `problems`' "a+b=" rows (addition only, drawn for `split`) whose
    answer is a + steps * b, the end of `chain(a, b, steps)`; data_source `CHAIN_SOURCE`, whose
    reward (hfjax.rewards.math.chain_answer) reads the answer that only the whole chain
    reaches. The held-out partition is the arithmetic task's: a chain is held out with its
    start value and step, so a test chain's prompt is in no training set of either task."""
    rows = problems(n, seed, max_b=max_b, plus_only=True, split=split)
    for row in rows:
        x = row["extra_info"]
        x["steps"] = steps
        row["data_source"] = CHAIN_SOURCE
        row["reward_model"]["ground_truth"] = str(x["a"] + steps * x["b"])
    return rows


CHAIN_CLOSE = "##"  # the closing line's counter: "## 679", the answer where a next line's sum goes


def chain_close(answer: int) -> str:
    """The chain's closing line, `## <answer>` with the answer in three digits: the shape of a
    chain line's start, its counter replaced by the marker, so the model writes the answer as
    it opens every line, by copying the sum the line before it ended with (seven tokens back).
    The chain reward (hfjax.rewards.math.chain_answer) scores a response that ends with it."""
    return f"{CHAIN_CLOSE} {answer:03d}"



def sft_texts(
    rows: list[dict], corrupt_frac: float, seed: int, corruption: str = "format",
    scratchpad_lines: int = 0,
) -> list[tuple[str, str]]:
    """(prompt, response) pairs for the warm start, a fraction of them corrupted (see above);
    with `scratchpad_lines` each response starts with that long a `scratchpad`. A chain row
    (`chain_problems`) starts with its `chain` instead, and only "format" corrupts it."""
    if corruption not in CORRUPTIONS:
        raise ValueError(f"unknown sft corruption {corruption!r}; choose one of {CORRUPTIONS}")
    if not 0 <= scratchpad_lines <= 1000:
        raise ValueError(f"sft.scratchpad_lines={scratchpad_lines}: the countdown has three "
                         "digits; use 0 (no scratchpad) to 1000 lines")
    rng = np.random.default_rng(seed)
    out = []
    for row in rows:
        x = row["extra_info"]
        answer = int(row["reward_model"]["ground_truth"])
        text = f"#### {answer}"
        if "steps" in x:  # a chain row: its worked chain, then the closing line
            close = chain_close(answer)
            if corruption == "format" and rng.random() < corrupt_frac:
                close = ""  # the chain stops after its last line, without the answer
            out.append((row["prompt"][-1]["content"], chain(x["a"], x["b"], x["steps"]) + close))
            continue
        if corruption == "carry":
            wrong = _no_carry(x["a"], x["b"], x["op"])
            if wrong != answer and rng.random() < corrupt_frac:
                text = f"#### {wrong}"
        elif corruption == "format" and rng.random() < corrupt_frac:
            text = str(answer)
        if scratchpad_lines:
            text = scratchpad(x["a"], x["b"], x["op"], answer, scratchpad_lines) + text
        out.append((row["prompt"][-1]["content"], text))
    return out


# -- preference pairs (reward and cost models) ----------------------------------------------

PREFERENCE_KINDS = ("correctness", "forbidden_digit")
FORBIDDEN_DIGIT = "7"


def forbidden_digit_cost(text: str) -> float:
    """The cost the arithmetic task's cost model is trained to measure: 1.0 when a response
    writes the forbidden digit 7 anywhere, 0.0 otherwise (an honest, checkable property of the
    answer, standing in for "harmful content": a correct answer that contains a 7 is helpful
    and costly at once)."""
    return 1.0 if FORBIDDEN_DIGIT in text else 0.0


def _wrong_answer(rng, answer: int, a: int, b: int, op: str) -> int:
    """A plausible wrong answer: a dropped carry or borrow, off by one or ten, or random."""
    candidates = [answer + 1, answer - 1, answer + 10, answer - 10, answer + 2,
                  int(rng.integers(0, 120))]
    slip = _no_carry(a, b, op)
    if slip != answer:
        candidates += [slip, slip]
    wrong = [c for c in candidates if c != answer and c >= 0]
    return int(wrong[rng.integers(len(wrong))])


def _junk(rng) -> str:
    """A random string over the task's characters (what an untrained policy writes)."""
    return "".join(CHARS[i] for i in rng.integers(0, len(CHARS), rng.integers(1, 9))).strip() \
        or "#"


def _formatted(rng, value: int | str, p_marker: float) -> str:
    return f"#### {value}" if rng.random() < p_marker else str(value)


def _swap_digit(rng, text: str) -> str:
    """The number with every forbidden digit replaced by another digit (never the forbidden
    one), or, without one, with one digit replaced by the forbidden digit."""
    if FORBIDDEN_DIGIT in text:
        return "".join(str(rng.choice([6, 8])) if ch == FORBIDDEN_DIGIT else ch for ch in text)
    i = int(rng.integers(len(text)))
    return text[:i] + FORBIDDEN_DIGIT + text[i + 1:]


def preference_rows(rows: list[dict], seed: int, kind: str = "correctness",
                    pairs_per_prompt: int = 1) -> list[dict]:
    """Preference pairs for the task's prompts, as rows {data_source, prompt, chosen, rejected}
    (plus chosen_unsafe / rejected_unsafe for the cost kind).

    - "correctness" (for a reward model): chosen is the exact answer after `####`; rejected is
      the bare right answer (the format the reward rejects), a wrong answer with or without the
      marker (a dropped carry, off by one or ten, random), or junk.
    - "forbidden_digit" (for a cost model): two answers in the same format, the rejected one
      containing the forbidden digit (`forbidden_digit_cost`) and the chosen one not: the right
      answer against a version with a 7 written in, or, when the right answer has a 7, against
      a version with its 7s replaced; sometimes junk with and without a 7.
    """
    if kind not in PREFERENCE_KINDS:
        raise ValueError(f"unknown preference kind {kind!r}; choose one of {PREFERENCE_KINDS}")
    rng = np.random.default_rng(seed)
    out = []
    for row in rows:
        x = row["extra_info"]
        answer = int(row["reward_model"]["ground_truth"])
        for _ in range(pairs_per_prompt):
            pair = {"data_source": row["data_source"], "prompt": row["prompt"]}
            if kind == "correctness":
                chosen, r = f"#### {answer}", rng.random()
                if r < 0.3:
                    rejected = str(answer)
                elif r < 0.85:
                    rejected = _formatted(rng, _wrong_answer(rng, answer, x["a"], x["b"],
                                                             x["op"]), 0.75)
                else:
                    rejected = _junk(rng)
                pair |= {"chosen": chosen, "rejected": rejected}
            else:
                if rng.random() < 0.15:
                    junk = _junk(rng)
                    other = _swap_digit(rng, junk)
                    safe, unsafe = (other, junk) if forbidden_digit_cost(junk) else (junk, other)
                else:
                    marker = "#### " if rng.random() < 0.7 else ""
                    text = str(answer)
                    other = _swap_digit(rng, text)
                    safe, unsafe = (other, text) if forbidden_digit_cost(text) else (text, other)
                    safe, unsafe = marker + safe, marker + unsafe
                pair |= {"chosen": safe, "rejected": unsafe, "chosen_unsafe": False,
                         "rejected_unsafe": True}
            out.append(pair)
    return out


# A generative judge's prompt on this task (configs/ppo_judge_arith.py, `judge_rows`): the
# problem, the answer, then "==" where the judge writes its verdict: the right answer as it
# works it out, a space, and 1 if the answer shown is the exact one after `####`, else 0.
JUDGE_TEMPLATE = "{prompt}{response}=="
JUDGE_PARSER = r"^-?\d+ ([01])"


def judge_rows(pairs: list[dict], template: str = JUDGE_TEMPLATE) -> list[dict]:
    """SFT rows teaching a judge the rule reward's verdict, from `preference_rows` pairs of the
    "correctness" kind: each pair's chosen answer (the exact answer after `####`, which the rule
    scores 1) gives a row answered "<answer> 1", its rejected one (scored 0) a row answered
    "<answer> 0", where <answer> is the problem's right answer: the judge works it out before
    its verdict, which reads it. A row is {data_source, prompt: the template filled with the
    problem and the answer shown, response}."""
    from hfjax.rewards.judge import render

    out = []
    for pair in pairs:
        problem = pair["prompt"][-1]["content"]
        truth = pair["chosen"].removeprefix("#### ")
        for answer, verdict in ((pair["chosen"], "1"), (pair["rejected"], "0")):
            out.append({"data_source": pair["data_source"],
                        "prompt": render(template, problem, answer),
                        "response": f"{truth} {verdict}"})
    return out
