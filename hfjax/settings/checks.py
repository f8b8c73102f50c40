"""The value checks that a spec field's key declares and that need a registry or the file
system (`hfjax.config.validators` holds those of the keys no spec reads). Each imports what it
reads inside the check, so this package stays below every package whose specs use it."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def registry(name: str) -> Callable[[], tuple[str, ...]]:
    def names() -> tuple[str, ...]:
        from hfjax.numerics import core

        return getattr(core, name).names()

    return names


def kl_names() -> tuple[str, ...]:
    from hfjax.numerics import core

    return core.KL_PENALTIES.names()


def mesh(optional: bool) -> Callable[[Any], str | None]:
    def check(v) -> str | None:
        if optional and v == "":
            return None
        from hfjax.parallel.mesh import MeshSpec

        try:
            MeshSpec.parse(v)
        except (TypeError, ValueError) as err:
            return str(err)
        return None

    return check


def model_path(optional: bool, preset: Callable[[str], str | None] | None = None,
               ) -> Callable[[Any], str | None]:
    """An HF model directory or a .gguf file (empty where `optional`); with `preset`, also a
    "preset:<name>" path, which `preset` checks (`hfjax.config.validators.model_path`: the
    presets are the models package's, above this one)."""
    def check(v) -> str | None:
        if v is None or v == "":
            return None if optional else "needs an HF model directory or a .gguf file"
        if not isinstance(v, str):
            return "needs a path string"
        if preset is not None and v.startswith("preset:"):
            return preset(v)
        if v.endswith(".gguf"):
            return None if os.path.isfile(v) else "no such .gguf file"
        if os.path.isfile(v):
            return "is a file but not a .gguf; pass a .gguf file or an HF model directory"
        if not os.path.isdir(v):
            return "no such file or directory"
        if not os.path.isfile(os.path.join(v, "config.json")):
            return "has no config.json; is it an HF model directory?"
        return None

    return check


def tool_spec(v) -> str | None:
    """Tool names or pkg.mod:Class specs, comma-separated (empty: no tools); resolved here, so
    an unknown tool fails before anything compiles. Built where they run (the python tool's
    jail is probed then, with its isolation setting: config.rules `_tools_build`)."""
    if not isinstance(v, str):
        return "needs a string of tool names, e.g. 'calculator' or 'calculator,python'"
    from hfjax.tools.registry import tool_classes

    try:
        tool_classes(v)
    except (ValueError, ImportError) as err:
        return str(err)
    return None


def level_or_off(levels: tuple[str, ...], auto: bool = False) -> Callable[[Any], str | None]:
    """A check for a setting that is one of `levels`, "none" or "" for off, and with `auto`
    also "auto" (rollout correction's)."""
    extra = ("auto",) if auto else ()

    def check(v) -> str | None:
        if isinstance(v, str) and v in ("", "none", *levels, *extra):
            return None
        return f"needs one of {', '.join((*levels, *extra))}, or none (off)"

    return check
