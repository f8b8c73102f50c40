"""Tool calls in the policy's text, in the Hermes/Qwen format the Qwen chat templates use:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "123 * 456"}}
    </tool_call>

`parse_tool_calls` returns one entry per `<tool_call>` opening tag, in order: a `ToolCall` when
the body is a JSON object with a string "name" and an object "arguments", else an error
`Observation` saying what is wrong, so the policy is told about its malformed call in that call's
place (and the runner passes it through untouched). Parsing never raises, whatever the text
(deep nesting, numbers too long to convert, lone surrogates): the policy's text is untrusted.
"""

from __future__ import annotations

import json

from hfjax.tools.base import Observation, ToolCall

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

_FORM = '<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>'


def _error(why: str) -> Observation:
    return Observation(f"Error: malformed tool call: {why}. Write {_FORM}", error=True)


def parse_one(body: str) -> ToolCall | Observation:
    """The call in one tag's body (the text between the tags), or an error Observation."""
    body = body.strip()
    if not body:
        return _error("the call is empty")
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as err:
        return _error(f"invalid JSON ({err.msg} at character {err.pos})")
    except RecursionError:
        # The decoder recurses once per nesting level: `[[[[...` past ~1000 levels.
        return _error("the JSON is nested too deeply")
    except (ValueError, MemoryError) as err:
        # e.g. an integer literal longer than the interpreter converts (4300 digits).
        return _error(f"invalid JSON ({type(err).__name__}: {str(err)[:120]})")
    if not isinstance(obj, dict):
        return _error(f"expected a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return _error('the object has no string "name"')
    args = obj.get("arguments", {})
    if isinstance(args, str):
        # Some models write the arguments as a JSON string (the OpenAI wire form).
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as err:
            return _error(f'"arguments" is a string that is not JSON ({err.msg})')
        except RecursionError:
            return _error('"arguments" is a string of JSON nested too deeply')
        except (ValueError, MemoryError) as err:
            return _error(f'"arguments" is a string that is not JSON ({type(err).__name__})')
    if not isinstance(args, dict):
        return _error(f'"arguments" must be a JSON object, got {type(args).__name__}')
    return ToolCall(name=name, arguments=args)


def parse_tool_calls(text: str) -> list[ToolCall | Observation]:
    """Every tool call in `text`, in order (see the module docstring). An opening tag with no
    closing tag before the next opening tag or the end of the text yields an error Observation.
    Text outside the tags, and a closing tag with no opening tag, are ignored."""
    out: list[ToolCall | Observation] = []
    pos = 0
    while True:
        start = text.find(TOOL_CALL_OPEN, pos)
        if start < 0:
            return out
        body_start = start + len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, body_start)
        next_open = text.find(TOOL_CALL_OPEN, body_start)
        if end < 0 or 0 <= next_open < end:
            out.append(_error(f"{TOOL_CALL_OPEN} has no closing {TOOL_CALL_CLOSE}"))
            if next_open < 0:
                return out
            pos = next_open
            continue
        out.append(parse_one(text[body_start:end]))
        pos = end + len(TOOL_CALL_CLOSE)


def has_tool_call(text: str) -> bool:
    """Whether `text` opens a tool call (a turn that needs the environment)."""
    return TOOL_CALL_OPEN in text
