"""Tool calls parsed from the policy's text (Hermes/Qwen <tool_call> format)."""

from hfjax.tools import Observation, ToolCall, parse_tool_calls
from hfjax.tools.parse import has_tool_call


def call(name, **args):
    return ToolCall(name=name, arguments=args)


def test_one_call_with_text_around_it():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": '
            '{"expression": "12 * 34"}}\n</tool_call>')
    assert parse_tool_calls(text) == [call("calculator", expression="12 * 34")]
    assert has_tool_call(text)


def test_no_call():
    assert parse_tool_calls("The answer is 42.") == []
    assert not has_tool_call("The answer is 42.")


def test_two_calls_in_order():
    text = ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and '
            '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    assert parse_tool_calls(text) == [call("a", x=1), call("b")]


def test_malformed_json_is_an_error_in_its_place():
    text = ('<tool_call>{"name": "a", "arguments": {x: 1}}</tool_call>'
            '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    first, second = parse_tool_calls(text)
    assert isinstance(first, Observation) and first.error
    assert "invalid JSON" in first.text and "<tool_call>" in first.text
    assert second == call("b")


def test_missing_close_tag():
    (obs,) = parse_tool_calls('<tool_call>{"name": "a", "arguments": {}}')
    assert obs.error and "no closing </tool_call>" in obs.text
    # An unclosed call followed by a complete one: the error, then the call.
    out = parse_tool_calls('<tool_call>{"name": "a"<tool_call>{"name": "b"}</tool_call>')
    assert out[0].error and out[1] == call("b")


def test_shapes_that_are_not_calls():
    cases = {
        "<tool_call></tool_call>": "empty",
        "<tool_call>[1, 2]</tool_call>": "expected a JSON object",
        '<tool_call>{"arguments": {}}</tool_call>': 'no string "name"',
        '<tool_call>{"name": 3}</tool_call>': 'no string "name"',
        '<tool_call>{"name": "a", "arguments": [1]}</tool_call>': "must be a JSON object",
        '<tool_call>{"name": "a", "arguments": "{oops"}</tool_call>': "not JSON",
    }
    for text, why in cases.items():
        (obs,) = parse_tool_calls(text)
        assert isinstance(obs, Observation) and obs.error and why in obs.text, (text, obs)


def test_arguments_as_a_json_string_and_missing_arguments():
    text = ('<tool_call>{"name": "a", "arguments": "{\\"x\\": 2}"}</tool_call>'
            '<tool_call>{"name": "b"}</tool_call>')
    assert parse_tool_calls(text) == [call("a", x=2), call("b")]


def test_stray_close_tag_is_ignored():
    assert parse_tool_calls("done </tool_call>") == []
