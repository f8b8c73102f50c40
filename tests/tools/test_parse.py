"""Tool calls parsed from the policy's text (Hermes/Qwen <tool_call> format)."""

from hypothesis import given, settings
from hypothesis import strategies as st

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


def _reference(text):
    """The parse, written the straightforward (quadratic) way: at each opening tag, the first
    closing tag after it and the next opening tag, each searched from the body's start."""
    from hfjax.tools.parse import parse_one

    out, pos = [], 0
    while (start := text.find("<tool_call>", pos)) >= 0:
        body = start + len("<tool_call>")
        end, nxt = text.find("</tool_call>", body), text.find("<tool_call>", body)
        if end < 0 or 0 <= nxt < end:
            out.append("unclosed")
            if nxt < 0:
                return out
            pos = nxt
            continue
        out.append(parse_one(text[body:end]))
        pos = end + len("</tool_call>")
    return out


class _Scanned(str):
    """A text that counts the characters its `split` and `find` walk over: the parser's
    work. The pieces `split` returns count too."""

    scanned = 0

    def find(self, sub, start=0, *rest):
        at = str.find(self, sub, start, *rest)
        _Scanned.scanned += (at + len(sub) if at >= 0 else len(self)) - start
        return at

    def split(self, *args):
        _Scanned.scanned += len(self)
        return [_Scanned(p) for p in str.split(self, *args)]


def _scan(text):
    _Scanned.scanned = 0
    got = parse_tool_calls(_Scanned(text))
    return got, _Scanned.scanned


_PIECES = ["<tool_call>", "</tool_call>", '{"name": "a", "arguments": {}}', "x", "<", "/",
           "{", "tool_call>"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=60), st.integers(1, 8))
def test_the_parse_is_the_reference_one_and_linear_in_the_text(pieces, repeat):
    """Any arrangement of tags and bodies parses as the straightforward parser does, while
    walking the text at most twice; repeating the text `repeat` times repeats the work."""
    text = "".join(pieces) * repeat
    got, scanned = _scan(text)
    want = _reference(text)
    assert [("unclosed" if isinstance(g, Observation) and "no closing" in g.text else g)
            for g in got] == want
    # At least once (the parser reads the text through the counted methods), at most twice.
    assert len(text) <= scanned <= 2 * len(text), (scanned, len(text))


def test_the_red_teams_32768_unclosed_tags_are_one_pass():
    """The attack: one long turn of 32,768 opening tags (360 KB) and no closing one; the
    parser used to re-scan the rest of the text at every tag (3 to 4 s holding the
    interpreter lock). Each tag is an error in its place, and the text is walked twice."""
    text = "<tool_call>" * 32_768
    got, scanned = _scan(text)
    assert len(got) == 32_768 and all(o.error and "no closing" in o.text for o in got)
    assert len(text) <= scanned <= 2 * len(text)
    closed = "<tool_call>" * 32_767 + '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
    got, scanned = _scan(closed)
    assert got[-1] == call("a") and len(got) == 32_768 and scanned <= 2 * len(closed)
