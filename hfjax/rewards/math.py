"""Answer-after-`####` rewards (GSM8K style) and the embedded arithmetic task's reward.

Extraction looks at the last 300 characters of the response only, so a long response cannot
hide an answer early and a late one wins. Strict mode needs `#### <number>`; flexible mode takes
the last number in the tail.
"""

from __future__ import annotations

import re

from hfjax.rewards.registry import register_reward

_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")
_TAIL = 300


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
    for cand in reversed(_NUMBER.findall(tail)):
        if cand not in ("", "."):
            return cand.replace(",", "")
    return None


def gsm8k_score(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """`score` when the extracted answer equals the ground truth, `format_score` otherwise."""
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    return score if answer == str(ground_truth).strip() else format_score


@register_reward("openai/gsm8k", "hfjax/arith")
def answer_after_hashes(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """1.0 for an exact `#### answer`, 0.0 otherwise."""
    return gsm8k_score(solution_str, ground_truth)
