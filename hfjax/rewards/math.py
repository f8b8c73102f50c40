"""Math rewards: the answer after `####` (GSM8K style), and math-verify for LaTeX answers.

`####` extraction follows verl's GSM8K scorer exactly:
- only the last 300 characters of the response are searched, so a late answer wins and a long
  response costs nothing;
- strict mode needs `#### <number>` and takes the last one, with `,` and `$` removed;
- flexible mode takes the last number-like run in the tail that is not "" or ".", as written;
- the score is `score` (1.0) on an exact string match with the ground truth, `format_score`
  (default 0.0) when an answer was found but differs, and 0.0 when none was found.

math-verify parses both sides to sympy and compares them symbolically, so `\\frac{1}{2}`,
`0.5` and `1/2` agree. The package is imported on first use.
"""

from __future__ import annotations

import re
import threading

import numpy as np

from hfjax.rewards.registry import register_reward

_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")
_TAIL = 300
_NOT_ANSWERS = ("", ".")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The final answer string of a response, or None when none is found."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"extraction method {method!r}; use 'strict' or 'flexible'")
    tail = solution_str[-_TAIL:]
    if method == "strict":
        found = _STRICT.findall(tail)
        if not found:
            return None
        return found[-1].replace(",", "").replace("$", "")
    found = _NUMBER.findall(tail)
    if not found:
        return None
    for cand in reversed(found):
        if cand not in _NOT_ANSWERS:
            return cand
    # Every run was "." alone: verl keeps the last one it looked at, an answer that can never
    # match, so the response earns format_score rather than 0.
    return found[0]


def gsm8k_score(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """`score` when the extracted answer equals the ground truth, `format_score` when it
    differs, 0.0 when there is no answer."""
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    return score if answer == ground_truth else format_score


def check_hashes_ground_truth(ground_truth: str, extra_info: dict | None = None) -> str | None:
    """Why `#### <ground_truth>` would not score 1.0 (commas, units, spaces...), or None."""
    if gsm8k_score(f"#### {ground_truth}", ground_truth) == 1.0:
        return None
    return (
        f"ground truth {ground_truth!r} is not a plain number that '####' extraction can match "
        "(write it like '72' or '-3.5': no commas, units or spaces)"
    )


@register_reward("openai/gsm8k", "hfjax/arith", "hfjax/arith_tool", "hfjax/shapes",
                 styles=("gsm8k",),
                 check=check_hashes_ground_truth)
def answer_after_hashes(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """1.0 for `#### <ground truth>` in the response's tail (strict mode), 0.0 otherwise."""
    return gsm8k_score(solution_str, ground_truth)


CHAIN_SOURCE = "hfjax/arith_chain"  # the data_source of hfjax.data.arith.chain_problems' rows
_CHAIN_ANSWER = re.compile(r"(?:^|\s)## (\d{3})\s*$")  # hfjax.data.arith.chain_close


def check_chain_row(ground_truth: str, extra_info: dict | None = None) -> str | None:
    """Why a chain row cannot be scored (its extra_info must give a, b and steps), or None."""
    x = extra_info or {}
    if not all(isinstance(x.get(k), (int, np.integer)) for k in ("a", "b", "steps")):
        return ("an hfjax/arith_chain row needs integer extra_info a, b and steps "
                "(hfjax.data.arith.chain_problems writes them)")
    if str(x["a"] + x["steps"] * x["b"]) != ground_truth:
        return f"ground truth {ground_truth!r} is not a + steps * b of its extra_info"
    return None


@register_reward(CHAIN_SOURCE, check=check_chain_row)
def chain_answer(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """1.0 when the response ends with the chain's closing line `## <ground truth>`, the
    answer in three digits (hfjax.data.arith.chain_close; trailing whitespace aside), 0.0
    otherwise. Only the answer is read, but only the chain reaches it (hfjax.data.arith.chain):
    each line's sum starts the next line, so a slip in any line moves every later sum and the
    answer with them. (An exact-match reward on the whole chain never fired on sampled
    responses: one slip among a thousand tokens scored 0 however close the rest was.)"""
    found = _CHAIN_ANSWER.search(solution_str)
    return float(found is not None and int(found.group(1)) == int(ground_truth))


# -- math-verify ---------------------------------------------------------------------------------


def _timeouts() -> dict:
    # math-verify's own timeouts use SIGALRM, which only the main thread may arm; elsewhere they
    # are switched off and the caller's pool timeout is the only limit.
    if threading.current_thread() is threading.main_thread():
        return {}
    return {"parsing_timeout": None}


def _parse_gold(ground_truth: str):
    from math_verify import LatexExtractionConfig, parse

    # A bare answer such as "\frac{1}{2}" is boxed so the LaTeX extractor finds all of it.
    text = ground_truth if "\\boxed" in ground_truth else f"\\boxed{{{ground_truth}}}"
    return parse(text, extraction_config=[LatexExtractionConfig()], **_timeouts())


def math_verify_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when math-verify finds the response's final answer equal to the ground truth."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    gold = _parse_gold(ground_truth)
    if not gold:
        return 0.0
    pred = parse(
        solution_str,
        extraction_config=[ExprExtractionConfig(), LatexExtractionConfig()],
        **_timeouts(),
    )
    if not pred:
        return 0.0
    kw = {} if not _timeouts() else {"timeout_seconds": None}
    return 1.0 if verify(gold, pred, **kw) else 0.0


def check_latex_ground_truth(ground_truth: str, extra_info: dict | None = None) -> str | None:
    """Why math-verify cannot use `ground_truth` as a gold answer, or None."""
    gold = _parse_gold(ground_truth)
    # math-verify keeps an unparseable answer as raw text, which only a character-identical
    # response would match: treat it as unparseable.
    if all(isinstance(g, str) for g in gold):
        return f"math-verify cannot parse ground truth {ground_truth!r} as math"
    if math_verify_score(f"\\boxed{{{ground_truth}}}", ground_truth) != 1.0:
        return f"math-verify does not find ground truth {ground_truth!r} equal to itself"
    return None


@register_reward(
    "hfjax/math", "math", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500", styles=("math_verify",), check=check_latex_ground_truth,
)
def latex_answer(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """1.0 when the response's final answer is mathematically equal to the ground truth."""
    return math_verify_score(solution_str, ground_truth)
