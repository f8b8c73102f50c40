"""The calculator: exact answers, and everything but arithmetic refused (no eval)."""

import random

import pytest

from hfjax.tools import ToolError, resolve_tools
from hfjax.tools.calculator import MAX_EXPRESSION_CHARS, calculate


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
        with pytest.raises(ToolError, match="more than 5000 digits"):
            calculate(text)
    assert calculate("1.5e3") == "1500"
    assert calculate("1_0.0_1e3") == "10010"
