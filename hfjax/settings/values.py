"""Value checks for config keys and flags: each returns None for a valid value, else what a
valid value looks like. `ConfigError` is the one exception every refusal raises."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any


class ConfigError(ValueError):
    """A setting refused before any work starts."""



@dataclasses.dataclass(frozen=True)
class Int:
    """An int (not a bool) in [lo, hi]."""

    lo: int | None = None
    hi: int | None = None
    note: str = ""

    def __call__(self, v) -> str | None:
        ok = isinstance(v, int) and not isinstance(v, bool)
        ok = ok and (self.lo is None or v >= self.lo) and (self.hi is None or v <= self.hi)
        return None if ok else _with_note(f"needs an int{_bounds(self.lo, self.hi)}", self.note)


@dataclasses.dataclass(frozen=True)
class Float:
    """A finite number in the interval given by lo/hi, each bound open or closed."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    note: str = ""

    def __call__(self, v) -> str | None:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if ok and self.lo is not None:
            ok = v > self.lo if self.lo_open else v >= self.lo
        if ok and self.hi is not None:
            ok = v < self.hi if self.hi_open else v <= self.hi
        if ok:
            return None
        if self.lo is not None and self.hi is not None:
            want = (f"a float in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}"
                    f"{')' if self.hi_open else ']'}")
        elif self.lo is not None:
            want = f"a float {'>' if self.lo_open else '>='} {self.lo:g}"
        elif self.hi is not None:
            want = f"a float {'<' if self.hi_open else '<='} {self.hi:g}"
        else:
            want = "a finite float"
        return _with_note(f"needs {want}", self.note)


@dataclasses.dataclass(frozen=True)
class Bool:
    def __call__(self, v) -> str | None:
        return None if isinstance(v, bool) else "needs True or False"


@dataclasses.dataclass(frozen=True)
class Choice:
    """One of a fixed tuple of names, or of a registry's names (`names` is then a function,
    called when checked, so registries fill up on import first)."""

    names: tuple[str, ...] | Callable[[], tuple[str, ...]]
    note: str = ""

    def __call__(self, v) -> str | None:
        names = self.names() if callable(self.names) else self.names
        if isinstance(v, str) and v in names:
            return None
        return _with_note(f"needs one of {', '.join(names)}", self.note)


@dataclasses.dataclass(frozen=True)
class Text:
    """A string, optionally non-empty."""

    nonempty: bool = False
    note: str = ""

    def __call__(self, v) -> str | None:
        if not isinstance(v, str) or (self.nonempty and not v.strip()):
            return _with_note("needs a non-empty string" if self.nonempty else "needs a string",
                              self.note)
        return None


@dataclasses.dataclass(frozen=True)
class Check:
    """Any other value check: `fn(value)` returns the problem, or None."""

    fn: Callable[[Any], str | None]

    def __call__(self, v) -> str | None:
        return self.fn(v)


def _bounds(lo, hi) -> str:
    if lo is not None and hi is not None:
        return f" in [{lo}, {hi}]"
    if lo is not None:
        return f" >= {lo}"
    return "" if hi is None else f" <= {hi}"


def _with_note(text: str, note: str) -> str:
    return f"{text} ({note})" if note else text
