"""The chain task (data.task=arith_chain): "a+b=" answered with a + steps * b, worked in one
fixed-width line per step; its reward reads the answer, which only a slip-free chain reaches."""

import pytest

from hfjax.data import arith
from hfjax.rewards import math, registry

STEPS = 79  # configs/grpo_long_arith.py's chain


def _reference_chain(a: int, b: int, steps: int, slip_at: int = -1) -> str:
    """The chain written out by a running sum, digit by digit with carries, independently of
    hfjax.data.arith.chain; with `slip_at` the ones digit of that line's sum comes out one too
    high (no carry), and every later line carries on from the wrong sum."""
    out, digits = [], [int(ch) for ch in f"{a:03d}"]
    for k in range(steps):
        before = "".join(map(str, digits))
        carry = b
        for i in range(2, -1, -1):  # right to left
            total = digits[i] + carry
            digits[i], carry = total % 10, total // 10
        assert carry == 0
        if k == slip_at:
            digits[2] = (digits[2] + 1) % 10
        counter = steps - 1 - k
        out.append(f"{counter // 10}{counter % 10} {before}+{b}={''.join(map(str, digits))} ")
    return "".join(out)


def _last_sum(chain: str) -> str:
    return str(int(chain.rstrip()[-3:]))


def _score(row, text):
    fn = registry.get_reward_fn(row["data_source"], row["reward_model"]["style"])
    return fn(row["data_source"], text, row["reward_model"]["ground_truth"], row["extra_info"])


def test_chain_rows_and_demonstrations_are_long_and_exact():
    rows = arith.chain_problems(24, seed=5, steps=STEPS)
    pairs = arith.sft_texts(rows, 0.0, seed=0, corruption="none")
    tok = arith.tokenizer()
    for row, (prompt, response) in zip(rows, pairs):
        x = row["extra_info"]
        assert prompt == f"{x['a']}+{x['b']}=" and 10 <= x["a"] <= 99 and 1 <= x["b"] <= 9
        assert row["reward_model"]["ground_truth"] == str(x["a"] + STEPS * x["b"])
        last = _reference_chain(x["a"], x["b"], STEPS).rstrip()[-3:]
        assert response == _reference_chain(x["a"], x["b"], STEPS) + f"## {last}"
        assert int(last) == x["a"] + STEPS * x["b"]
        assert len(tok.encode(response, add_special_tokens=False)) >= 1024
        assert registry.check_ground_truth(row["data_source"],
                                           row["reward_model"]["ground_truth"], x) is None
    # "format" corruption drops the closing line from a share of the demonstrations, never the
    # chain: those end after the chain's last line.
    bare = arith.sft_texts(rows, 0.5, seed=1, corruption="format")
    kinds = {"##" in r for _, r in bare}
    assert kinds == {True, False}
    for row, (_, r) in zip(rows, bare):
        x = row["extra_info"]
        chain = _reference_chain(x["a"], x["b"], STEPS)
        assert r in (chain, chain + f"## {chain.rstrip()[-3:]}")


def test_reward_reads_the_answer_that_only_the_whole_chain_reaches():
    """The demonstration scores 1 with or without trailing whitespace; the bare answer, a
    wrong answer, an answer not in three digits, text after the answer, or a chain with a slip
    in any line, which carries the slip to its last sum and writes that after the marker,
    score 0."""
    row = arith.chain_problems(1, seed=9, steps=STEPS)[0]
    x = row["extra_info"]
    good = arith.sft_texts([row], 0.0, seed=0, corruption="none")[0][1]
    assert _score(row, good) == 1.0 and _score(row, good + " \n") == 1.0
    answer = row["reward_model"]["ground_truth"]
    chain_len = STEPS * arith.CHAIN_LINE
    assert good[:chain_len] == _reference_chain(x["a"], x["b"], STEPS)
    for k in range(0, STEPS, 6):  # a slip early, midway and late
        slipped = _reference_chain(x["a"], x["b"], STEPS, slip_at=k)
        written = _last_sum(slipped)
        assert written != answer, k
        assert _score(row, slipped + f"## {int(written):03d}") == 0.0, k
    assert _score(row, good[:chain_len] + f"{int(answer):03d}") == 0.0  # no marker
    assert _score(row, good[:chain_len] + f"## {int(answer) + 1:03d}") == 0.0
    assert _score(row, good[:chain_len] + f"## 0{int(answer):03d}") == 0.0
    assert _score(row, good[:chain_len] + f"x## {int(answer):03d}") == 0.0
    assert _score(row, good + " 00") == 0.0  # the answer must end the response
    assert _score(row, good[:chain_len] + f"## {int(answer):03d}x") == 0.0
    assert registry.check_ground_truth(row["data_source"], str(int(answer) + 1), x) is not None
    assert row["data_source"] == math.CHAIN_SOURCE  # the reward is registered for these rows


def test_chain_past_four_digits_is_refused():
    with pytest.raises(ValueError, match="passes 999"):
        arith.chain(99, 12, 80)
    with pytest.raises(ValueError, match="counter has two digits"):
        arith.chain(10, 1, 101)
