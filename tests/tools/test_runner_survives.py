"""A tool runner's threads outlive every call: whatever a call raises, in the tool or in sending
it to a worker (RecursionError from deeply nested arguments, MemoryError, SystemExit,
KeyboardInterrupt, a BaseException of the tool's own), that call's future holds an error
observation and the next call on the same thread completes. Each runner has one thread, so a
thread that died would leave the next call hanging (bounded here by a result timeout)."""

import pytest

from hfjax.tools import Observation, Tool, ToolCall, ToolRunner
from hfjax.tools.runner import truncate

WAIT_S = 60  # far above a call's time; only a dead thread reaches it


class Escape(BaseException):
    """Neither an Exception nor one of Python's own."""


class Raiser(Tool):
    name = "raiser"
    description = "raises what it is asked to, or echoes"
    parameters = {"type": "object",
                  "properties": {"kind": {"type": "string"}, "nest": {"type": "object"},
                                 "text": {"type": "string"}}}
    timeout_s = 20.0

    def call(self, arguments):
        kind = arguments.get("kind")
        if kind == "recursion":
            def down(n):
                return down(n + 1) + 1
            return str(down(0))
        if kind == "memory":
            return str(len(bytearray(1 << 62)))  # a real MemoryError, nothing allocated
        if kind == "interrupt":
            raise KeyboardInterrupt("pressed")
        if kind == "exit":
            raise SystemExit(3)
        if kind == "escape":
            raise Escape("out")
        return arguments.get("text", "ok")


@pytest.fixture(scope="module", params=["processes", "threads"])
def runner(request):
    with ToolRunner({"raiser": Raiser()}, max_workers=1, max_output_chars=64,
                    processes=request.param == "processes") as r:
        yield r


def nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth):
        value = {"a": value}
    return value


@pytest.mark.parametrize("kind,name", [("recursion", "RecursionError"),
                                       ("memory", "MemoryError"),
                                       ("interrupt", "KeyboardInterrupt"),
                                       ("exit", "SystemExit"), ("escape", "Escape")])
def test_any_exception_of_a_call_is_its_observation(runner, kind, name):
    bad = runner.submit([ToolCall("raiser", {"kind": kind})]).result(WAIT_S)
    assert bad[0].error and name in bad[0].text, bad
    after = runner.submit([ToolCall("raiser", {"text": "next"})]).result(WAIT_S)
    assert after == [Observation("next", False)]


def test_arguments_nested_past_the_encoders_depth_are_an_observation(runner):
    """The red team's attack: a call whose arguments nest deeper than the JSON encoder goes
    made the runner's thread die re-encoding them for the worker, and every later call hang."""
    bad = runner.submit([ToolCall("raiser", {"nest": nested(100_000)})]).result(WAIT_S)
    if runner.processes:
        assert bad[0].error and "RecursionError" in bad[0].text, bad
    else:  # nothing to encode: the tool gets the arguments as they are
        assert bad == [Observation("ok", False)]
    after = runner.submit([ToolCall("raiser", {"text": "next"})] * 3).result(WAIT_S)
    assert after == [Observation("next", False)] * 3


def test_a_result_over_the_limit_says_how_much_was_cut(runner):
    (obs,) = runner.run([ToolCall("raiser", {"text": "y" * 1000})])
    assert obs.error and obs.text == "y" * 64 + "\n[output truncated: 936 more characters]"
    assert truncate("z" * 10, 4) == ("zzzz\n[output truncated: 6 more characters]", True)
    assert truncate("z" * 4, 4) == ("zzzz", False)
