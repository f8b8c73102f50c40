"""A dense reward for short multi-process training tests (loaded with reward.custom_fn).

The arithmetic task's own reward is 0 for anything but the exact `#### <answer>`, so a model
trained for a few steps from scratch scores 0 on every row, its advantages are 0 and nothing
moves. Partial credit per character of `#### <answer>` in its place gives such a model a signal
from the first step, so every stage of PPO (critic, advantages, actor update) computes on
non-zero numbers.
"""


def score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    want = f"#### {ground_truth}"
    return sum(a == b for a, b in zip(solution_str, want)) / len(want)
