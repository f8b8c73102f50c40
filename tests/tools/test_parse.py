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


# -- the parser never raises, whatever the policy writes ------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from hfjax.tools.parse import TOOL_CALL_CLOSE, TOOL_CALL_OPEN  # noqa: E402


def _check_parsed(text):
    out = parse_tool_calls(text)
    assert len(out) == text.count(TOOL_CALL_OPEN)
    for entry in out:
        assert isinstance(entry, (ToolCall, Observation))
        if isinstance(entry, Observation):
            assert entry.error and entry.text.startswith("Error: malformed tool call")


def test_deep_nesting_and_huge_numbers_are_error_observations():
    deep = TOOL_CALL_OPEN + "[" * 100_000 + TOOL_CALL_CLOSE
    (obs,) = parse_tool_calls(deep)
    assert obs.error and "nested too deeply" in obs.text
    deep_args = (TOOL_CALL_OPEN + '{"name": "a", "arguments": "' + "{" * 5000 + '"}'
                 + TOOL_CALL_CLOSE)
    assert parse_tool_calls(deep_args)[0].error
    big = TOOL_CALL_OPEN + '{"name": "a", "arguments": {"x": ' + "9" * 5000 + "}}" + TOOL_CALL_CLOSE
    (obs,) = parse_tool_calls(big)
    assert obs.error and "invalid JSON" in obs.text
    # Numbers the decoder can build stay numbers.
    (ok,) = parse_tool_calls(TOOL_CALL_OPEN + '{"name": "a", "arguments": {"x": 1e999999}}'
                             + TOOL_CALL_CLOSE)
    assert ok == call("a", x=float("inf"))


_pieces = st.sampled_from([
    TOOL_CALL_OPEN, TOOL_CALL_CLOSE, "{", "}", "[", "]", '"', ":", ",", '"name"', '"arguments"',
    '"a"', "1e999999", "9" * 4400, "-", "\\", "\\ud800", "\ud800", "null", " ", "\n"])
_adversarial = st.lists(st.one_of(_pieces, st.text(max_size=8)), max_size=60).map("".join)
_nested = st.tuples(st.sampled_from("[{"), st.integers(0, 3000), st.booleans()).map(
    lambda t: TOOL_CALL_OPEN + (t[0] if t[0] == "[" else '{"a":') * t[1]
    + (TOOL_CALL_CLOSE if t[2] else ""))
_bytes = st.binary(max_size=200).map(lambda b: TOOL_CALL_OPEN + b.decode("utf-8", "surrogateescape")
                                     + TOOL_CALL_CLOSE)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(), _adversarial, _nested, _bytes))
def test_parser_never_raises(text):
    _check_parsed(text)
