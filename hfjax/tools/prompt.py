"""The system message that tells a model which tools it has and how to call them.

Chat templates that take a `tools` list (Qwen2.5's, for one) write such a message themselves.
Many do not (SmolLM2's ignores `tools`), so a task's data can carry it instead: `prepare_data
--tools=...` puts `system_message(tools)` first in every prompt (docs/agents.md). The text lists
each tool's name, description and JSON schema of arguments, taken from the `Tool` objects, and
shows the call format that `hfjax.tools.parse` reads:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 34"}}
    </tool_call>
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

from hfjax.tools.base import Tool
from hfjax.tools.parse import TOOL_CALL_CLOSE, TOOL_CALL_OPEN


def _example(tool: Tool) -> dict:
    """Example arguments for `tool`: per required argument, the first of its schema's
    `examples` (JSON schema's keyword), else its first `enum` value, else a placeholder."""
    params = tool.parameters
    args = {}
    for key in params.get("required", []):
        prop = params.get("properties", {}).get(key, {})
        if isinstance(prop.get("examples"), list) and prop["examples"]:
            args[key] = prop["examples"][0]
        elif "enum" in prop and prop["enum"]:
            args[key] = prop["enum"][0]
        else:
            args[key] = {"string": "...", "integer": 0, "number": 0, "boolean": True,
                         "array": [], "object": {}}.get(prop.get("type"), "...")
    return args


def system_message(tools: Mapping[str, Tool]) -> str:
    """The system prompt describing `tools` (name -> Tool, as `resolve_tools` returns them)
    and the Hermes call format. ValueError when `tools` is empty: there is nothing to say."""
    if not tools:
        raise ValueError("no tools to describe; name at least one, e.g. 'calculator'")
    specs = "\n".join(json.dumps(t.schema()["function"]) for t in tools.values())
    first = next(iter(tools.values()))
    call = json.dumps({"name": first.name, "arguments": _example(first)})
    lines = [
        "You have tools. When a tool can do a step of the task, call it instead of working "
        "the step out yourself.",
        "",
        "The tools, one JSON object each (name, description, JSON schema of the arguments):",
        f"<tools>\n{specs}\n</tools>",
        "",
        "To call a tool, write its name and arguments as one JSON object between "
        f"{TOOL_CALL_OPEN} and {TOOL_CALL_CLOSE}, and stop. For example:",
        f"{TOOL_CALL_OPEN}\n{call}\n{TOOL_CALL_CLOSE}",
        "The result comes back in a message from the tool. Then call another tool or give "
        "your final answer.",
    ]
    return "\n".join(lines)


def tools_kwargs(names: Iterable[str], query: str) -> dict:
    """verl's `extra_info.tools_kwargs` for a row with the tools `names`: `{name:
    {"create_kwargs": {"query": query}}}`. Parquet cannot store an empty struct, so each tool's
    create_kwargs holds the row's question (the built-in tools ignore it; it is never the
    answer, which no tool should see)."""
    return {name: {"create_kwargs": {"query": query}} for name in names}
