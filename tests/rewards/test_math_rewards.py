"""`####` extraction with verl's GSM8K semantics, and math-verify for LaTeX answers."""

import pytest

from hfjax.rewards.math import extract_solution, gsm8k_score, math_verify_score
from hfjax.rewards.registry import check_ground_truth, get_reward_fn


@pytest.mark.parametrize(
    "text, strict, flexible",
    [
        ("so the total is 12 apples.\n#### 72", "72", "72"),
        ("#### 1,234", "1234", "1,234"),           # strict drops commas, flexible keeps them
        ("#### -3.5 dollars", "-3.5", "-3.5"),
        ("####72", None, "72"),                     # strict needs the space
        ("the answer is 42.", None, "42."),
        ("#### 5 then #### 6", "6", "6"),           # the last answer wins
        ("no numbers here", None, None),
        ("only a dot .", None, "."),                # flexible keeps verl's quirk
    ],
)
def test_extraction_modes(text, strict, flexible):
    assert extract_solution(text, "strict") == strict
    assert extract_solution(text, "flexible") == flexible


def test_only_the_last_300_characters_are_searched():
    early = "#### 72\n" + "x" * 300
    assert extract_solution(early, "strict") is None
    assert gsm8k_score(early, "72") == 0.0
    late = "#### 11\n" + "x" * 292 + "#### 72"
    assert len(late) > 300 and extract_solution(late, "strict") == "72"
    # The window starts mid-answer: only the characters inside it count.
    cut = "#### 123" + "y" * 299
    assert extract_solution(cut, "strict") is None
    assert extract_solution(cut, "flexible") == "3"
    edge = "#### 123" + "y" * 292   # exactly 300 characters: the whole answer is inside
    assert len(edge) == 300 and extract_solution(edge) == "123"


def test_scores_and_format_score():
    assert gsm8k_score("#### 72", "72") == 1.0
    assert gsm8k_score("#### 71", "72") == 0.0
    assert gsm8k_score("#### 71", "72", format_score=0.1) == 0.1
    assert gsm8k_score("no answer", "72", format_score=0.1) == 0.0
    assert gsm8k_score("it is 72", "72", method="flexible") == 1.0
    assert gsm8k_score("#### 72", "72", score=2.0) == 2.0
    with pytest.raises(ValueError, match="extraction method"):
        extract_solution("#### 1", "loose")


def test_registered_gsm8k_sources():
    for source in ("openai/gsm8k", "hfjax/arith"):
        fn = get_reward_fn(source)
        assert fn(source, "work...\n#### 18", "18", None) == 1.0
        assert fn(source, "work...\n#### 19", "18", None) == 0.0
    assert get_reward_fn("anything", style="gsm8k")("anything", "#### 3", "3", None) == 1.0
    assert check_ground_truth("openai/gsm8k", "18") is None
    assert "not a plain number" in check_ground_truth("openai/gsm8k", "18 apples")


@pytest.mark.parametrize(
    "response, truth, want",
    [
        ("so $x = \\boxed{\\frac{1}{2}}$", "\\frac{1}{2}", 1.0),
        ("the answer is $\\boxed{0.5}$", "\\frac{1}{2}", 1.0),
        ("the answer is $\\boxed{\\frac{2}{4}}$", "0.5", 1.0),
        ("we get $\\boxed{\\sqrt{2}}$", "\\sqrt{2}", 1.0),
        ("we get $\\boxed{x^2 + 2x + 1}$", "(x+1)^2", 1.0),
        ("the answer is $\\boxed{0.6}$", "\\frac{1}{2}", 0.0),
        ("I don't know", "\\frac{1}{2}", 0.0),
        ("$\\boxed{[0, 1)}$", "[0,1)", 1.0),
        ("$\\boxed{[0, 1]}$", "[0,1)", 0.0),
    ],
)
def test_math_verify(response, truth, want):
    assert math_verify_score(response, truth) == want
    assert get_reward_fn("hfjax/math")("hfjax/math", response, truth, None) == want


def test_math_verify_by_style_and_truth_check():
    fn = get_reward_fn("my/dataset", style="math_verify")
    assert fn("my/dataset", "$\\boxed{3}$", "3", None) == 1.0
    assert check_ground_truth("hfjax/math", "\\frac{1}{2}") is None
    assert "cannot parse" in check_ground_truth("hfjax/math", "\\frac{")
