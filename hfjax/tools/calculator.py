"""`calculator`: exact arithmetic on integers and decimals, without eval.

The expression is parsed with `ast` and walked over a whitelist of nodes: numbers, + - * / // %
**, unary minus and plus, and parentheses. Anything else (names, attributes, calls, subscripts,
strings, comparisons) is refused. Numbers are `fractions.Fraction`s built from the literal's
source text, so 0.1 + 0.2 is exactly 0.3 and integers have no size limit but ours. The answer is
an integer, a terminating decimal, or, for a fraction with no finite decimal (1/3), the fraction
and a 30-digit decimal.
"""

from __future__ import annotations

import ast
import operator
import re
from fractions import Fraction

from hfjax.tools.base import Tool, ToolError
from hfjax.tools.registry import register_tool

MAX_EXPRESSION_CHARS = 500
MAX_EXPONENT = 10_000
# Digits of any intermediate numerator or denominator, and of any answer. Below CPython's
# 4,300-digit limit on int <-> str conversion (sys.int_info.default_max_str_digits), which
# str() of a larger answer would hit with a ValueError instead of this tool's own message.
MAX_DIGITS = 4_000
APPROX_DIGITS = 30
# A non-terminating answer smaller than this is approximated in scientific notation: 30 decimal
# places of 1/7**2000 would read 0.
_SCIENTIFIC_BELOW = Fraction(1, 10**6)

_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_SYMBOLS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//",
            ast.Mod: "%", ast.Pow: "**"}


def _digits(x: Fraction) -> int:
    # bit_length * log10(2), rounded up: cheap and never an underestimate by more than one digit
    return max(abs(x.numerator).bit_length(), x.denominator.bit_length()) * 30103 // 100000 + 1


_FLOAT_TEXT = re.compile(r"([0-9_]*)\.?([0-9_]*)(?:[eE]([+-]?[0-9_]+))?")


def _literal_digits(text: str) -> int:
    """An upper bound on the digits of the numerator or denominator of the float literal
    `text`, from the text alone (nothing is built)."""
    match = _FLOAT_TEXT.fullmatch(text.strip())
    if match is None:
        return 0  # not a plain literal (repr of inf, say): Fraction refuses it cheaply
    whole, frac, exp = (g.replace("_", "") if g else "" for g in match.groups())
    # len(exp) > 6 means an exponent of at least a million: far past any limit, and never
    # converted (int() of a long digit string is itself the cost being avoided).
    shift = 10**7 if len(exp.lstrip("+-")) > 6 else abs(int(exp or "0"))
    return len(whole) + len(frac) + shift


def _checked(x: Fraction) -> Fraction:
    if _digits(x) > MAX_DIGITS:
        raise ToolError(f"a number in the calculation has more than {MAX_DIGITS} digits")
    return x


class _Evaluator:
    def __init__(self, source: str):
        self.source = source

    def eval(self, node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return self.eval(node.body)
        if isinstance(node, ast.Constant):
            return self._number(node)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = self.eval(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and type(node.op) in _SYMBOLS:
            left, right = self.eval(node.left), self.eval(node.right)
            if isinstance(node.op, ast.Pow):
                return self._power(left, right)
            if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
                raise ToolError("division by zero")
            # Fraction // Fraction is an int, and an int to a negative power a float.
            return _checked(Fraction(_BINOPS[type(node.op)](left, right)))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
            raise ToolError("^ is not a power here; write ** (2 ** 10)")
        raise ToolError(f"{self._describe(node)} is not allowed; use numbers, + - * / // % ** "
                        "and parentheses")

    def _number(self, node: ast.Constant) -> Fraction:
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ToolError(f"{value!r} is not a number")
        if isinstance(value, int):
            return _checked(Fraction(value))
        # A float literal is taken from its text, so 0.1 is exactly one tenth. Its size is
        # checked on the text first: Fraction("1e15000000") would build the 15-million-digit
        # integer (seconds holding the interpreter lock) before any check on the result.
        text = ast.get_source_segment(self.source, node) or repr(value)
        if _literal_digits(text) > MAX_DIGITS:
            raise ToolError(f"{text[:40]!r} has more than {MAX_DIGITS} digits")
        try:
            return _checked(Fraction(text.replace("_", "")))
        except (ValueError, ZeroDivisionError):
            raise ToolError(f"{text!r} is not a finite number") from None

    def _power(self, base: Fraction, exponent: Fraction) -> Fraction:
        if exponent.denominator != 1:
            raise ToolError("only integer exponents are exact; this calculator refuses "
                            f"{_format_short(exponent)}")
        n = exponent.numerator
        if abs(n) > MAX_EXPONENT:
            raise ToolError(f"exponent {n} is larger than {MAX_EXPONENT} in size")
        if base == 0 and n < 0:
            raise ToolError("division by zero (0 to a negative power)")
        if base not in (0, 1, -1) and _digits(base) * abs(n) > MAX_DIGITS * 2:
            raise ToolError(f"the power would have more than {MAX_DIGITS} digits")
        return _checked(base ** n)

    def _describe(self, node: ast.AST) -> str:
        segment = ast.get_source_segment(self.source, node)
        kind = type(node).__name__
        if isinstance(node, (ast.BinOp, ast.UnaryOp, ast.BoolOp)):
            kind = f"the operator {type(node.op).__name__}"
        return f"{kind} ({segment})" if segment else kind


def _format_short(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"


def format_number(x: Fraction) -> str:
    """`x` as an integer, an exact terminating decimal, or `p/q ≈ decimal` (30 digits; in
    scientific notation when the exact decimal would pass MAX_DIGITS digits or a
    non-terminating value is below 1e-6)."""
    if x.denominator == 1:
        return str(x.numerator)
    den, twos, fives = x.denominator, 0, 0
    while den % 2 == 0:
        den //= 2
        twos += 1
    while den % 5 == 0:
        den //= 5
        fives += 1
    places = max(twos, fives)
    whole_digits = max(1, _digits(Fraction(abs(x.numerator) // x.denominator)))
    if den == 1 and places + whole_digits <= MAX_DIGITS:
        return _decimal(x, places)
    if den == 1 or abs(x) < _SCIENTIFIC_BELOW:
        return f"{x.numerator}/{x.denominator} ≈ {_scientific(x, APPROX_DIGITS)}"
    return f"{x.numerator}/{x.denominator} ≈ {_decimal(x, APPROX_DIGITS, exact=False)}"


def _scientific(x: Fraction, digits: int) -> str:
    """`x` (not 0) rounded half up to `digits` significant digits, as m.mmm…e±E."""
    sign, a = ("-" if x < 0 else ""), abs(x)
    # floor(log10(a)): the digit counts' difference, or one less.
    exp = len(str(a.numerator)) - len(str(a.denominator))
    if a < Fraction(10) ** exp:
        exp -= 1
    scaled = a * Fraction(10) ** (digits - 1 - exp)
    mantissa = scaled.numerator // scaled.denominator
    if 2 * (scaled - mantissa) >= 1:
        mantissa += 1
    if mantissa >= 10**digits:  # rounding carried into a new digit
        mantissa //= 10
        exp += 1
    text = str(mantissa)
    tail = text[1:].rstrip("0")
    return f"{sign}{text[0]}{'.' + tail if tail else ''}e{exp:+d}"


def _decimal(x: Fraction, places: int, exact: bool = True) -> str:
    sign = "-" if x < 0 else ""
    scaled = abs(x) * 10 ** places
    whole = scaled.numerator // scaled.denominator
    if not exact and 2 * (scaled - whole) >= 1:
        whole += 1  # round half up on the last printed digit
    digits = str(whole).rjust(places + 1, "0")
    head, tail = digits[:-places], digits[-places:].rstrip("0")
    return f"{sign}{head}.{tail}" if tail else f"{sign}{head}"


def calculate(expression: str) -> str:
    """The exact value of an arithmetic `expression` as text (see the module docstring);
    ToolError saying what is wrong otherwise."""
    if not isinstance(expression, str):
        raise ToolError("the expression must be a string")
    expression = expression.strip()
    if not expression:
        raise ToolError("the expression is empty")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as err:
        raise ToolError(f"cannot parse {expression!r}: {err.msg}") from None
    except (ValueError, MemoryError, RecursionError):
        raise ToolError(f"cannot parse {expression!r}") from None
    try:
        return format_number(_Evaluator(expression).eval(tree))
    except RecursionError:
        raise ToolError("the expression is nested too deeply") from None


@register_tool
class Calculator(Tool):
    """Exact arithmetic on integers and decimals (see the module docstring)."""

    name = "calculator"
    description = ("Evaluate an arithmetic expression exactly. Supports integers, decimals, "
                   "+ - * / // % ** and parentheses, e.g. \"(1234 * 5678) - 0.5\".")
    parameters = {
        "type": "object",
        "properties": {
            "expression": {"type": "string",
                           "description": "the arithmetic expression, e.g. 1234 * 5678",
                           "examples": ["1234 * 5678"]},
        },
        "required": ["expression"],
    }
    timeout_s = 5.0

    def call(self, arguments: dict) -> str:
        return calculate(arguments["expression"])
