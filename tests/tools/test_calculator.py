"""The calculator: exact answers, and everything but arithmetic refused (no eval)."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hfjax.tools import ToolError, resolve_tools
from hfjax.tools.calculator import MAX_DIGITS, MAX_EXPRESSION_CHARS, calculate


@pytest.mark.parametrize("expr, want", [
    ("0.1 + 0.2", "0.3"),
    ("0.1 + 0.2 - 0.3", "0"),
    ("1.1 * 1.1", "1.21"),
    ("7 / 2", "3.5"),
    ("2 ** -2", "0.25"),
    ("-3 ** 2", "-9"),
    ("(-2) ** 3", "-8"),
    ("7 // 2", "3"),
    ("-7 // 2", "-4"),
    ("7 % 3", "1"),
    ("1.5 % 1", "0.5"),
    ("--5", "5"),
    ("+5 - -5", "10"),
    ("1e3 + 1", "1001"),
    ("1_000 * 3", "3000"),
    ("(1234 * 5678) - 0.5", "7006651.5"),
    ("2 ** 200", str(2 ** 200)),
    ("123456789123456789 * 987654321987654321", str(123456789123456789 * 987654321987654321)),
    ("10 / 4 / 5", "0.5"),
    ("-1 / 8", "-0.125"),
    # A floor division's result to a negative power (an int's would be a float).
    ("((1) // (1)) ** -1", "1"),
    ("(7 // 2) ** -2", "1/9 ≈ 0.111111111111111111111111111111"),
])
def test_exact_values(expr, want):
    assert calculate(expr) == want


def test_non_terminating_fraction_gives_the_fraction_and_a_rounded_decimal():
    assert calculate("1 / 3") == "1/3 ≈ 0.333333333333333333333333333333"
    assert calculate("-2 / 3") == "-2/3 ≈ -0.666666666666666666666666666667"


def test_products_match_integer_arithmetic():
    rng = random.Random(0)
    for _ in range(200):
        a, b, c = rng.randrange(100, 10000), rng.randrange(100, 10000), rng.randrange(1, 999)
        assert calculate(f"{a} * {b} - {c}") == str(a * b - c)
        assert calculate(f"({a} + {b}) * {c}") == str((a + b) * c)


@pytest.mark.parametrize("expr, why", [
    ("__import__('os').system('true')", "Call"),
    ("x + 1", "Name"),
    ("abs(-1)", "Call"),
    ("(1).real", "Attribute"),
    ("[1, 2][0]", "Subscript"),
    ("'a' * 3", "is not a number"),
    ("1 < 2", "Compare"),
    ("True + 1", "is not a number"),
    ("2 ^ 3", r"write \*\*"),
    ("1 & 3", "BitAnd"),
    ("lambda: 1", "Lambda"),
    ("2 ** 0.5", "integer exponents"),
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("10 ** 100000", "exponent"),
    ("9 ** 9999", "digits"),
    ("1j * 2", "is not a number"),
    ("1 +", "cannot parse"),
    ("", "empty"),
    ("1; 2", "cannot parse"),
])
def test_refused(expr, why):
    with pytest.raises(ToolError, match=why):
        calculate(expr)


def test_limits_on_length_and_repeated_squaring():
    with pytest.raises(ToolError, match="longer than"):
        calculate("1+" * MAX_EXPRESSION_CHARS + "1")
    # Each power is in bounds; their product is not.
    with pytest.raises(ToolError, match="digits"):
        calculate("*".join(["(9 ** 2000)"] * 6))


def test_tool_call_and_schema():
    calc = resolve_tools("calculator")["calculator"]
    assert calc.call({"expression": "12 * 12"}) == "144"
    spec = calc.schema()
    assert spec["type"] == "function"
    assert spec["function"]["name"] == "calculator"
    assert spec["function"]["parameters"]["required"] == ["expression"]


def test_huge_literals_are_refused_from_their_text():
    # Fraction("1e15000000") would build a 15-million-digit integer (seconds holding the GIL)
    # before the digit check; the literal's text is checked first.
    for text in ("1e15000000", "1e-15000000", "1.5e5001", "1e" + "9" * 400, "2 * 1e9999"):
        with pytest.raises(ToolError, match=f"more than {MAX_DIGITS} digits"):
            calculate(text)
    assert calculate("1.5e3") == "1500"
    assert calculate("1_0.0_1e3") == "10010"


def test_the_limit_on_digits_is_below_the_interpreters_own():
    """str() of an integer past sys.int_info's 4,300 digits raises ValueError: every number
    the calculator keeps, and every answer, stays below that."""
    import sys

    assert MAX_DIGITS < sys.int_info.default_max_str_digits


@pytest.mark.parametrize("expr", ["1/3**10000", "1e4999", "2**-10000", "-1e4300",
                                  "(10**3000+1)/2**3000", "1/2**9000", "1e-4999", "7**-4700"])
def test_the_red_teams_answers_past_str_are_the_tools_own_errors_or_answers(expr):
    """These raised ValueError (int -> str past 4,300 digits) from inside format_number."""
    try:
        out = calculate(expr)
    except ToolError as err:
        assert "digits" in str(err) or "exponent" in str(err), err
    else:
        assert "≈" in out and len(out) < 3 * MAX_DIGITS, out


def _literal():
    ints = st.integers(-10**5, 10**5).map(str)
    huge = st.sampled_from(["3", "2", "10", "7", "0.1", "0.5", "1e4999", "1e4299", "1e-4999",
                            "9" * 4000, "9" * 4301, "1.5e3999", "0", "1_0.0_1e3"])
    exp_literal = st.builds(lambda m, e: f"{m}e{e}", st.sampled_from(["1", "2.5", "9.99"]),
                            st.integers(-6000, 6000))
    return st.one_of(ints, huge, exp_literal)


_EXPRESSIONS = st.recursive(
    _literal(),
    lambda inner: st.one_of(
        st.builds(lambda a, op, b: f"({a}) {op} ({b})", inner,
                  st.sampled_from(["+", "-", "*", "/", "//", "%"]), inner),
        st.builds(lambda a, n: f"({a}) ** {n}", inner, st.integers(-12000, 12000)),
        st.builds(lambda a, b: f"({a}) ** ({b})", inner, inner),
        st.builds(lambda a: f"-({a})", inner)),
    max_leaves=6)


@settings(max_examples=150, deadline=None)
@given(_EXPRESSIONS)
def test_every_expression_is_an_answer_or_the_tools_own_error(expr):
    """Whatever arithmetic is written (powers and literals at and past every limit), the
    calculator answers in text or raises ToolError: never ValueError, OverflowError or
    another exception the policy would see as a crash."""
    try:
        out = calculate(expr)
    except ToolError:
        return
    assert isinstance(out, str) and out
