"""What a tool is: a name, a JSON schema for its arguments, and `call(arguments) -> str`.

A policy asks for a tool with a `ToolCall` (parsed from its text, `hfjax.tools.parse`); the
environment answers with an `Observation`, the text appended to the trajectory as tokens the
policy did not generate. `error=True` marks an observation that reports a failure (malformed call,
unknown tool, bad arguments, timeout, crash); the policy still sees its text, so it can recover.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar

# Set on a class that hfjax.tools.registry loaded from a file: the `path/to/file.py:Class` spec
# that loads it again (in a worker process, hfjax.tools.worker). Here, below both, so neither
# imports the other for it.
FILE_SPEC = "_hfjax_tool_spec"


class ToolError(Exception):
    """Raised by a tool's `call` for a failure the policy should read as it is (bad input, a
    limit hit): the runner reports `Error: <tool>: <message>`, without a Python type name."""


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call the policy made: the tool's name and its (JSON object) arguments."""

    name: str
    arguments: dict


@dataclasses.dataclass(frozen=True)
class Observation:
    """What the environment returns for one call; `error` says the call failed."""

    text: str
    error: bool


class Tool(abc.ABC):
    """A tool the policy can call.

    Subclasses set the class attributes `name`, `description` and `parameters` (a JSON schema of
    type "object" whose `properties` and `required` say what `call` accepts) and implement
    `call`. `call` returns the text the policy sees; it may raise (`ToolError` for a failure
    worded for the policy), and `ToolRunner` turns the exception into an error observation, so a
    tool need not catch everything itself. `call` receives arguments already checked against
    `parameters` (required keys and types) when it runs under a `ToolRunner`. It runs in
    a worker thread, so it must be thread-safe. `timeout_s` bounds one call's wall time.
    """

    name: ClassVar[str]
    description: ClassVar[str]
    parameters: ClassVar[dict]
    timeout_s: float = 10.0

    @abc.abstractmethod
    def call(self, arguments: dict) -> str:
        """Run the tool on validated `arguments` and return the text the policy sees."""

    def schema(self) -> dict[str, Any]:
        """The function spec a chat template takes in its `tools` list (the OpenAI/Qwen form:
        {"type": "function", "function": {"name", "description", "parameters"}})."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
