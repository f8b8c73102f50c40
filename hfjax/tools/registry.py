"""Tools by name: `--config.rollout.multi_turn.tools=calculator,python` or `pkg.mod:MyTool`.

Built-in tools register themselves with `@register_tool` when their module is imported; the
package's `__init__` imports them, so they are known before `resolve_tools` runs. A user's tool
needs no registration: `package.module:ClassName` (or `path/to/file.py:ClassName`) names a
`Tool` subclass, which is imported and built with no arguments.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Mapping, Sequence
from typing import Any

from hfjax.rewards.custom import import_file
from hfjax.tools.base import FILE_SPEC, Tool

_TOOLS: dict[str, type[Tool]] = {}


def register_tool(cls: type[Tool]) -> type[Tool]:
    """Class decorator registering a Tool subclass under its `name` (ValueError on a clash or
    on a class that is not a complete Tool)."""
    if not (isinstance(cls, type) and issubclass(cls, Tool)):
        raise ValueError(f"register_tool: {cls!r} is not a subclass of hfjax.tools.Tool")
    _check_class(cls, f"register_tool({cls.__name__})")
    if cls.name in _TOOLS and _TOOLS[cls.name] is not cls:
        raise ValueError(
            f"a tool named {cls.name!r} is already registered ({_TOOLS[cls.name].__qualname__}); "
            "give yours another name")
    _TOOLS[cls.name] = cls
    return cls


def known_tools() -> list[str]:
    """The registered tool names, sorted."""
    return sorted(_TOOLS)


def _check_class(cls: type, where: str) -> None:
    for attr in ("name", "description", "parameters"):
        if not hasattr(cls, attr):
            raise ValueError(f"{where}: the tool class has no `{attr}` attribute; set it")
    if not isinstance(cls.name, str) or not cls.name.isidentifier():
        raise ValueError(f"{where}: tool name {cls.name!r} must be an identifier")
    params = cls.parameters
    if not isinstance(params, dict) or params.get("type") != "object":
        raise ValueError(
            f"{where}: `parameters` must be a JSON schema dict with \"type\": \"object\"")
    props = params.get("properties", {})
    missing = [k for k in params.get("required", []) if k not in props]
    if missing:
        raise ValueError(f"{where}: required arguments {missing} are not in `properties`")


def _import_class(spec: str) -> type[Tool]:
    where, _, attr = spec.rpartition(":")
    if not where or not attr.isidentifier():
        raise ValueError(
            f"tool {spec!r}: write a registered name, package.module:ClassName or "
            "path/to/file.py:ClassName")
    try:
        if where.endswith(".py"):
            path = os.path.abspath(where)
            if not os.path.isfile(path):
                raise ValueError(f"tool {spec!r}: no file {path}")
            module = import_file(path, "hfjax_user_tool_", f"tool {spec!r}")
        else:
            module = importlib.import_module(where)
    except ValueError:
        raise
    except Exception as err:
        raise ValueError(f"tool {spec!r}: importing {where} failed: {err!r}") from err
    cls = getattr(module, attr, None)
    if cls is None:
        raise ValueError(f"tool {spec!r}: {where} has no attribute {attr!r}")
    if not (isinstance(cls, type) and issubclass(cls, Tool)):
        raise ValueError(f"tool {spec!r}: {attr} is not a subclass of hfjax.tools.Tool")
    _check_class(cls, f"tool {spec!r}")
    if where.endswith(".py"):  # how a worker process loads it again (hfjax.tools.worker)
        setattr(cls, FILE_SPEC, f"{os.path.abspath(where)}:{attr}")
    return cls


def _split(spec: str | Sequence[str]) -> list[str]:
    parts = [spec] if isinstance(spec, str) else list(spec)
    names = []
    for part in parts:
        if not isinstance(part, str):
            raise ValueError(f"tools: {part!r} is not a string; give tool names or pkg.mod:Class")
        names += [p.strip() for p in part.split(",") if p.strip()]
    return names


def tool_classes(spec: str | Sequence[str]) -> list[tuple[str, type[Tool]]]:
    """The tool classes `spec` names, each with its item, without building any: ValueError
    naming the known tools and the `pkg.mod:Class` form for an unknown name."""
    classes = []
    for item in _split(spec):
        if item in _TOOLS:
            classes.append((item, _TOOLS[item]))
        elif ":" in item:
            classes.append((item, _import_class(item)))
        else:
            raise ValueError(
                f"unknown tool {item!r}; known: {', '.join(known_tools()) or '(none)'}, or a "
                "tool class of your own as package.module:ClassName (or "
                "path/to/file.py:ClassName)")
    return classes


def resolve_tools(spec: str | Sequence[str],
                  options: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Tool]:
    """The tools named by `spec` ("calculator,python", "pkg.mod:MyTool", or a list of such),
    built and keyed by their `name`; {} for "" or an empty list. `options[name]` are keyword
    arguments for the registered tool `name` (e.g. {"python": {"isolation": "none"}}); a tool
    not in `spec` ignores its options. ValueError naming the known tools and the
    `pkg.mod:Class` form for an unknown name, for two tools with one name, and for a tool whose
    constructor refuses (the python tool where its jail cannot start)."""
    options = options or {}
    tools: dict[str, Tool] = {}
    for item, cls in tool_classes(spec):
        kwargs = dict(options.get(item, {})) if item in _TOOLS else {}
        try:
            tool = cls(**kwargs)
        except ValueError as err:  # a tool's own refusal, worded for the user
            raise ValueError(f"tool {item!r}: {err}") from None
        except Exception as err:
            raise ValueError(
                f"tool {item!r}: {cls.__qualname__}() failed: {err!r}; a tool class must be "
                "constructible with no arguments") from err
        if tool.name in tools:
            raise ValueError(f"tools: {tool.name!r} is named twice in {spec!r}")
        tools[tool.name] = tool
    return tools
