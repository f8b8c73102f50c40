"""Tools for multi-turn rollouts: what a tool is, the built-in ones, how calls in the policy's
text are parsed, and how they run without stalling the engine (docs/agents.md)."""

from hfjax.tools import calculator as calculator  # noqa: F401  (registers `calculator`)
from hfjax.tools import python as python  # noqa: F401  (registers `python`)
from hfjax.tools.base import Observation, Tool, ToolCall, ToolError
from hfjax.tools.parse import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, parse_tool_calls
from hfjax.tools.registry import known_tools, register_tool, resolve_tools
from hfjax.tools.runner import ToolRunner

__all__ = [
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "Observation",
    "Tool",
    "ToolCall",
    "ToolError",
    "ToolRunner",
    "known_tools",
    "parse_tool_calls",
    "register_tool",
    "resolve_tools",
]
