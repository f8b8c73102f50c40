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


# One object for every unclosed tag: a turn of 32,768 of them builds no 32,768 messages.
_UNCLOSED = _error(f"{TOOL_CALL_OPEN} has no closing {TOOL_CALL_CLOSE}")


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
    Text outside the tags, and a closing tag with no opening tag, are ignored.

    Linear in the text: it is cut at the opening tags once, and each piece searched once for
    its closing tag (searching the rest of the text again at every opening tag made 32,768
    unclosed tags take seconds, holding the interpreter lock)."""
    out: list[ToolCall | Observation] = []
    for piece in text.split(TOOL_CALL_OPEN)[1:]:  # from one opening tag to the next
        end = piece.find(TOOL_CALL_CLOSE)
        out.append(_UNCLOSED if end < 0 else parse_one(piece[:end]))
    return out


def has_tool_call(text: str) -> bool:
    """Whether `text` opens a tool call (a turn that needs the environment)."""
    return TOOL_CALL_OPEN in text
