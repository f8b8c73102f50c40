"""The reward of configs/grpo_smollm2_arith.py (`reward.custom_fn`): the response's final number
against the ground truth, as verl's GSM8K "flexible" extraction does. An untuned
SmolLM2-135M-Instruct almost never writes the "####" that reasoning-gym's own scorer needs, but
it does end with its answer ("So, the final answer is 127."), so this reward sees what it knows.
"""

import re

_NUMBER = re.compile(r"-?\d+")


def last_number(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """1.0 when the last number in the response's last 300 characters (in the text after its
    last "####", when it writes one) equals the ground truth, else 0.0."""
    tail = solution_str[-300:]
    at = tail.rfind("####")
    if at >= 0:
        tail = tail[at:]
    numbers = _NUMBER.findall(tail.replace(",", ""))
    return float(bool(numbers) and numbers[-1] == str(ground_truth).strip())
