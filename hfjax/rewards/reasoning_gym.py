"""reasoning-gym's own scorers for every `reasoning_gym/<task>` data source.

`launch.prepare_data` stores each generated entry (question, answer, metadata) as JSON in
`extra_info["entry"]`, because reasoning-gym's scorers read task-specific metadata (countdown
needs the numbers and the target, for instance). The reward extracts the response's final
answer, the text after its last `####` (within the last 300 characters, up to the end of that
line), and hands it with the entry to the task's `score_answer`.

Scores are reasoning-gym's, partial credit included: gsm_symbolic gives 0.01 to a wrong number
and countdown 0.05 to an expression that misuses the numbers.

The package is imported on first use, so the registry stays cheap to load.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable

from hfjax.rewards.registry import Reward, register_prefix

PREFIX = "reasoning_gym/"
_TAIL = 300


def task_of(data_source: str) -> str:
    """The reasoning-gym task name in `reasoning_gym/<task>`."""
    if not data_source.startswith(PREFIX) or len(data_source) == len(PREFIX):
        raise ValueError(f"data_source {data_source!r} is not of the form {PREFIX}<task>")
    return data_source[len(PREFIX):]


@functools.cache
def _scorer(task: str) -> Callable[[str | None, dict], float]:
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        raise ValueError(
            f"reasoning-gym has no task {task!r} (data_source {PREFIX}{task}); "
            f"e.g. {', '.join(sorted(DATASETS)[:8])}, ..."
        )
    return reasoning_gym.get_score_answer_fn(task)


def extract_answer(solution_str: str) -> str | None:
    """The text after the last `####` in the response's tail, to the end of that line."""
    tail = solution_str[-_TAIL:]
    at = tail.rfind("####")
    if at < 0:
        return None
    answer = tail[at + 4 :].strip().split("\n", 1)[0].strip()
    return answer or None


def entry_of(ground_truth: str, extra_info: dict | None) -> dict:
    """The reasoning-gym entry stored in `extra_info["entry"]`; ValueError saying what is off."""
    if not isinstance(extra_info, dict) or "entry" not in extra_info:
        raise ValueError("extra_info.entry is missing (the reasoning-gym entry as JSON)")
    raw = extra_info["entry"]
    entry = json.loads(raw) if isinstance(raw, str) else raw
    if not isinstance(entry, dict) or "answer" not in entry or "metadata" not in entry:
        raise ValueError("extra_info.entry is not a reasoning-gym entry {question, answer, "
                         "metadata}")
    return entry


def score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """reasoning-gym's score for the response's final answer (0.0 to 1.0)."""
    entry = entry_of(ground_truth, extra_info)
    return float(_scorer(task_of(data_source))(extract_answer(solution_str), entry))


def _checker(task: str):
    def check(ground_truth: str, extra_info: dict | None) -> str | None:
        try:
            entry = entry_of(ground_truth, extra_info)
        except (ValueError, json.JSONDecodeError) as err:
            return str(err)
        if str(entry["answer"]) != ground_truth:
            return (f"ground truth {ground_truth!r} differs from the reasoning-gym entry's "
                    f"answer {entry['answer']!r}")
        got = _scorer(task)(ground_truth, entry)
        if got != 1.0:
            return f"reasoning-gym scores the ground truth {ground_truth!r} itself {got}, not 1.0"
        if extract_answer(f"#### {ground_truth}") != ground_truth:
            return (f"ground truth {ground_truth!r} does not survive '####' extraction "
                    "(it spans lines or has surrounding spaces)")
        return None

    return check


def _resolve(data_source: str) -> Reward:
    task = task_of(data_source)
    _scorer(task)  # unknown tasks fail here, at load time
    return Reward(score, _checker(task))


register_prefix(PREFIX, _resolve)
