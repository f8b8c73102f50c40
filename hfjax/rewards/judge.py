"""A generative judge's host side: the prompt it reads and how its verdict becomes a score.

The judge (`hfjax.workers.judge`) reads `reward.judge.template` with `{prompt}` and
`{response}` replaced by the row's texts (`render`), writes a verdict, and the verdict parser
turns the verdict's text into a number (`parser_call`):
- a verdict parser registered by name (`VERDICT_PARSERS`, `@register_verdict_parser`), a
  function `fn(verdict: str) -> float | None`; or
- a regular expression with one group (`regex_verdict`): the group of its first match, read as
  a number.

A parser that returns None, or raises, has found no verdict: the row scores the configured
default and is counted as unparsed. Parsers run in the reward's scorer processes
(`hfjax.rewards.pool`), so they are named by module and function, never pickled, and each
call is bounded by `reward.judge.timeout_s`.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from hfjax.numerics.core import Registry

VerdictParser = Callable[[str], "float | None"]
VERDICT_PARSERS: Registry[VerdictParser] = Registry("verdict parser")
PLACEHOLDERS = ("{prompt}", "{response}")


def register_verdict_parser(*names: str) -> Callable[[VerdictParser], VerdictParser]:
    """Decorator registering `fn(verdict) -> float | None` as `reward.judge.parser=NAME`. The
    function must be defined at module level of an importable module (the scorer processes
    import it by name)."""
    return VERDICT_PARSERS.register(*names)


_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


@register_verdict_parser("number")
def first_number(verdict: str) -> float | None:
    """The first number in the verdict (e.g. "7", "0.5", "-1"); None without one."""
    m = _NUMBER.search(verdict)
    return float(m.group(0)) if m else None


@register_verdict_parser("yes_no")
def yes_no(verdict: str) -> float | None:
    """1.0 when the verdict's first word is "yes", 0.0 when it is "no" (any case); else None."""
    words = verdict.strip().split(maxsplit=1)
    first = words[0].strip(".,:;!").lower() if words else ""
    return {"yes": 1.0, "no": 0.0}.get(first)


def regex_verdict(verdict: str, pattern: str) -> float | None:
    """The number in the one group of `pattern`'s first match in the verdict; None without a
    match (a group that is not a number raises ValueError: also unparsed)."""
    m = re.search(pattern, verdict)
    return None if m is None else float(m.group(1))


def parser_problem(spec) -> str | None:
    """Why `spec` is neither a registered verdict parser nor a regex with one group (None when
    it is one of them)."""
    if not isinstance(spec, str) or not spec:
        return (f"needs a registered verdict parser ({', '.join(VERDICT_PARSERS.names())}) or "
                "a regular expression with one group, e.g. '([01])'")
    if spec in VERDICT_PARSERS:
        return None
    try:
        groups = re.compile(spec).groups
    except re.error as err:
        return (f"is not a registered verdict parser ({', '.join(VERDICT_PARSERS.names())}) "
                f"and not a valid regular expression ({err})")
    if groups != 1:
        return (f"is not a registered verdict parser ({', '.join(VERDICT_PARSERS.names())}); as "
                f"a regular expression it has {groups} groups, and the score is read from "
                "exactly one, e.g. 'score: (\\d+)'")
    return None


def parser_call(spec: str) -> tuple[Callable, tuple]:
    """(function, extra arguments) that score a verdict: `fn(verdict, *extra)`. ValueError
    naming the problem for a spec `parser_problem` refuses."""
    problem = parser_problem(spec)
    if problem:
        raise ValueError(f"reward.judge.parser={spec!r} {problem}")
    if spec in VERDICT_PARSERS:
        return VERDICT_PARSERS.get(spec), ()
    return regex_verdict, (spec,)


def template_problem(template) -> str | None:
    """Why a judge template cannot be used (None when it holds both placeholders)."""
    if not isinstance(template, str):
        return "needs a string holding {prompt} and {response}"
    missing = [p for p in PLACEHOLDERS if p not in template]
    if missing:
        return (f"has no {' or '.join(missing)}; the judge reads the row's prompt and response "
                "where the template writes {prompt} and {response}")
    return None


def render(template: str, prompt: str, response: str) -> str:
    """The judge's input text for one row: the template with each `{prompt}` and `{response}`
    replaced in one pass (other braces stay as written, and a text that itself holds a
    placeholder is not read again)."""
    texts = {"{prompt}": prompt, "{response}": response}
    return _PLACEHOLDER.sub(lambda m: texts[m.group(0)], template)


_PLACEHOLDER = re.compile(r"\{prompt\}|\{response\}")
