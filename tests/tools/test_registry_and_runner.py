"""Tools by name or pkg.mod:Class, and the runner: concurrent, ordered, never raising."""

import threading
import time

import pytest
from support import python_isolation

from hfjax.tools import (
    Observation,
    Tool,
    ToolCall,
    ToolError,
    ToolRunner,
    known_tools,
    register_tool,
    resolve_tools,
)


class Echo(Tool):
    name = "echo"
    description = "returns its text"
    parameters = {"type": "object",
                  "properties": {"text": {"type": "string"}, "times": {"type": "integer"},
                                 "mode": {"type": "string", "enum": ["plain", "upper"]}},
                  "required": ["text"], "additionalProperties": False}

    def call(self, arguments):
        text = arguments["text"] * arguments.get("times", 1)
        return text.upper() if arguments.get("mode") == "upper" else text


class Failing(Tool):
    name = "failing"
    description = "fails"
    parameters = {"type": "object", "properties": {"how": {"type": "string"}}}

    def call(self, arguments):
        how = arguments.get("how")
        if how == "tool_error":
            raise ToolError("the input is out of range")
        if how == "not_text":
            return 42
        raise RuntimeError("boom")


class Gate(Tool):
    """Blocks until its event is set, so tests control when a call ends."""

    name = "gate"
    description = "waits"
    parameters = {"type": "object", "properties": {}}
    timeout_s = 30.0

    def __init__(self):
        self.release = threading.Event()
        self.started = threading.Semaphore(0)

    def call(self, arguments):
        self.started.release()
        self.release.wait(60)
        return "released"


def test_resolve_builtin_names_and_empty():
    assert {"calculator", "python"} <= set(known_tools())
    assert resolve_tools("") == {}
    assert resolve_tools([]) == {}
    py = {"python": {"isolation": python_isolation()}}
    tools = resolve_tools(" calculator , python ", py)
    assert list(tools) == ["calculator", "python"]
    assert list(resolve_tools(["python", "calculator"], py)) == ["python", "calculator"]


def test_resolve_unknown_names_the_known_tools_and_the_class_form():
    with pytest.raises(
            ValueError, match=r"unknown tool 'calculater'.*calculator.*package\.module:ClassName"):
        resolve_tools("calculater")
    with pytest.raises(ValueError, match="named twice"):
        resolve_tools("calculator,calculator")


def test_resolve_class_by_module_and_by_file(tmp_path):
    tools = resolve_tools("hfjax.tools.calculator:Calculator")
    assert tools["calculator"].call({"expression": "2 + 2"}) == "4"
    path = tmp_path / "my_tools.py"
    path.write_text(
        "from hfjax.tools import Tool\n"
        "class Shout(Tool):\n"
        "    name = 'shout'\n"
        "    description = 'upper-cases'\n"
        "    parameters = {'type': 'object', 'properties': {'s': {'type': 'string'}},\n"
        "                  'required': ['s']}\n"
        "    def call(self, arguments):\n"
        "        return arguments['s'].upper()\n"
        "class NotATool:\n"
        "    pass\n")
    tools = resolve_tools(f"{path}:Shout,calculator")
    assert set(tools) == {"shout", "calculator"}
    with ToolRunner(tools) as runner:
        assert runner.run([ToolCall("shout", {"s": "hi"})]) == [Observation("HI", False)]
    with pytest.raises(ValueError, match="not a subclass of hfjax.tools.Tool"):
        resolve_tools(f"{path}:NotATool")
    with pytest.raises(ValueError, match="has no attribute 'Missing'"):
        resolve_tools(f"{path}:Missing")
    with pytest.raises(ValueError, match="importing no_such_module_xyz failed"):
        resolve_tools("no_such_module_xyz:Tool")


def test_register_refuses_clashes_and_bad_schemas():
    class Other(Echo):
        name = "calculator"

    with pytest.raises(ValueError, match="already registered"):
        register_tool(Other)

    class BadSchema(Echo):
        name = "bad_schema"
        parameters = {"type": "object", "properties": {}, "required": ["x"]}

    with pytest.raises(ValueError, match=r"required arguments \['x'\]"):
        register_tool(BadSchema)


def test_runner_checks_calls_and_keeps_order():
    calls = [
        ToolCall("echo", {"text": "ab", "times": 2}),
        Observation("Error: malformed tool call", True),
        ToolCall("nope", {}),
        ToolCall("echo", {}),
        ToolCall("echo", {"text": 3}),
        ToolCall("echo", {"text": "a", "times": True}),
        ToolCall("echo", {"text": "a", "times": 2.0}),
        ToolCall("echo", {"text": "a", "mode": "loud"}),
        ToolCall("echo", {"text": "a", "colour": "red"}),
        ToolCall("echo", {"text": "a", "mode": "upper"}),
    ]
    with ToolRunner({"echo": Echo()}) as runner:
        out = runner.run(calls)
    assert out[0] == Observation("abab", False)
    assert out[1] == calls[1]
    assert out[2].error and "unknown tool 'nope'; available: echo" in out[2].text
    assert out[3].error and "missing required 'text'" in out[3].text
    assert out[4].error and "arguments.text must be of type string, got int" in out[4].text
    assert out[5].error and "must be of type integer, got bool" in out[5].text
    assert out[6].error and "must be of type integer, got float" in out[6].text
    assert out[7].error and "must be one of" in out[7].text
    assert out[8].error and "unknown 'colour'" in out[8].text
    assert out[9] == Observation("A", False)


def test_runner_turns_failures_into_error_observations():
    with ToolRunner({"failing": Failing(), "echo": Echo()}, max_output_chars=50) as runner:
        boom, worded, not_text, huge = runner.run([
            ToolCall("failing", {}), ToolCall("failing", {"how": "tool_error"}),
            ToolCall("failing", {"how": "not_text"}), ToolCall("echo", {"text": "x" * 1000})])
    assert boom.error and boom.text == "Error: failing failed: RuntimeError: boom"
    assert worded.error and worded.text == "Error: failing: the input is out of range"
    assert not_text.error and "returned int, not text" in not_text.text
    assert huge.error and huge.text.startswith("x" * 50 + "\n[output truncated: 950 more")


def test_submit_does_not_wait_and_calls_run_concurrently():
    gate = Gate()
    # The gate shares its events with this test: the calls run in this process.
    with ToolRunner({"gate": gate, "echo": Echo()}, max_workers=2, processes=False) as runner:
        slow = runner.submit([ToolCall("gate", {}), ToolCall("gate", {})])
        # Both gate calls are running at once on the two workers ...
        assert gate.started.acquire(timeout=30) and gate.started.acquire(timeout=30)
        assert not slow.done()
        gate.release.set()
        assert slow.result(timeout=30) == [Observation("released", False)] * 2
        # ... and the workers are free again afterwards.
        assert runner.run([ToolCall("echo", {"text": "ok"})]) == [Observation("ok", False)]


def test_timeout_abandons_the_call_and_a_fresh_worker_takes_over():
    """In-process calls (processes=False): a thread cannot be killed, so it is abandoned."""
    gate = Gate()
    gate.timeout_s = 0.2
    with ToolRunner({"gate": gate, "echo": Echo()}, max_workers=2, processes=False) as runner:
        (obs,) = runner.run([ToolCall("gate", {})])
        assert obs.error and obs.text == "Error: gate timed out after 0.2 s"
        assert runner.abandoned == 1
        # A worker is stuck in the gate, yet the next call is served.
        assert runner.run([ToolCall("echo", {"text": "next"})]) == [Observation("next", False)]
        gate.release.set()


def test_closed_runner_and_empty_submit():
    runner = ToolRunner({"echo": Echo()})
    assert runner.run([]) == []
    runner.close()
    (obs,) = runner.run([ToolCall("echo", {"text": "a"})])
    assert obs.error and "closed" in obs.text


def test_runner_refuses_bad_settings():
    with pytest.raises(ValueError, match="max_workers must be >= 1"):
        ToolRunner({}, max_workers=0)
    with pytest.raises(ValueError, match=r"tools\['x'\].*is not a Tool"):
        ToolRunner({"x": object()})
    echo = Echo()
    echo.timeout_s = None
    with pytest.raises(ValueError, match="timeout_s=None; give a finite number"):
        ToolRunner({"echo": echo})


class Slow(Tool):
    """Echoes after a short, varying pause, so calls finish out of order."""

    name = "slow"
    description = "echoes slowly"
    parameters = {"type": "object", "properties": {"i": {"type": "integer"}},
                  "required": ["i"]}

    def call(self, arguments):
        time.sleep((arguments["i"] * 7919 % 5) / 1000)
        return str(arguments["i"])


def test_many_submitters_get_their_own_results_in_order():
    errors = []
    with ToolRunner({"slow": Slow(), "echo": Echo()}, max_workers=3) as runner:
        def submitter(t):
            try:
                for k in range(25):
                    base = 1000 * t + 10 * k
                    calls = [ToolCall("slow", {"i": base + j}) for j in range(4)]
                    calls.insert(2, ToolCall("nope", {}))
                    out = runner.submit(calls).result(timeout=60)
                    texts = [o.text for o in out]
                    want = [str(base), str(base + 1), texts[2], str(base + 2), str(base + 3)]
                    if texts != want or not out[2].error:
                        errors.append((t, k, texts))
            except Exception as err:  # surfaced below: a thread's exception is not a failure
                errors.append((t, repr(err)))

        threads = [threading.Thread(target=submitter, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
    assert errors == []
