"""reasoning-gym rows scored by reasoning-gym's own scorers, through the registry."""

import json

import pytest
import reasoning_gym

from hfjax.rewards.reasoning_gym import extract_answer
from hfjax.rewards.registry import check_ground_truth, get_reward_fn

TASKS = ["gsm_symbolic", "basic_arithmetic", "countdown", "chain_sum"]


def entries(task, n=4, seed=3):
    return list(reasoning_gym.create_dataset(task, size=n, seed=seed))


def as_row_args(task, entry):
    source = f"reasoning_gym/{task}"
    return source, str(entry["answer"]), {"entry": json.dumps(entry, default=str)}


@pytest.mark.parametrize("task", TASKS)
def test_own_answer_scores_one_and_a_wrong_one_does_not(task):
    for entry in entries(task):
        source, truth, extra = as_row_args(task, entry)
        fn = get_reward_fn(source)
        right = f"Let me work it out.\n#### {entry['answer']}"
        assert fn(source, right, truth, extra) == 1.0
        assert fn(source, "I give up.", truth, extra) < 0.02  # no answer at all
        assert check_ground_truth(source, truth, extra) is None


@pytest.mark.parametrize("task", ["basic_arithmetic", "chain_sum"])
def test_wrong_number_scores_zero(task):
    for entry in entries(task):
        source, truth, extra = as_row_args(task, entry)
        wrong = str(int(entry["answer"]) + 1)
        assert get_reward_fn(source)(source, f"#### {wrong}", truth, extra) == 0.0


def test_partial_credit_is_reasoning_gyms_own():
    # gsm_symbolic gives 0.01 to a wrong number, countdown 0.05 to a wrong use of the numbers.
    entry = entries("gsm_symbolic")[0]
    source, truth, extra = as_row_args("gsm_symbolic", entry)
    wrong = str(int(float(entry["answer"])) + 1)
    assert get_reward_fn(source)(source, f"#### {wrong}", truth, extra) == 0.01
    entry = entries("countdown")[0]
    source, truth, extra = as_row_args("countdown", entry)
    assert get_reward_fn(source)(source, "#### 1 + 1", truth, extra) == 0.05


def test_answer_extraction():
    assert extract_answer("blah\n#### 42\nthanks") == "42"
    assert extract_answer("#### 1\n#### 2*3 + 4  ") == "2*3 + 4"
    assert extract_answer("no marker") is None
    assert extract_answer("#### 9\n" + "z" * 300) is None  # outside the last 300 characters


def test_bad_extra_info_is_a_counted_skip_reason():
    entry = entries("chain_sum")[0]
    source, truth, extra = as_row_args("chain_sum", entry)
    assert "extra_info.entry is missing" in check_ground_truth(source, truth, {})
    assert "differs from the reasoning-gym entry" in check_ground_truth(source, "0.5", extra)
