"""ToolRunner's worker processes: a tool's timeout holds within a second of its setting whatever
the tool does (spinning in C with the interpreter lock held included), the controller keeps
running meanwhile, and a flood of hanging calls leaves a bounded number of threads and
processes. Wall-time bounds carry slack for a loaded machine; they are containment claims, not
performance ones."""

import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest

from hfjax.tools import Observation, Tool, ToolCall, ToolRunner


class Power(Tool):
    """Holds its interpreter's lock in C for a long time (minutes): 10 ** (10 ** 8), after
    creating the file `mark` if given."""

    name = "power"
    description = "a huge power"
    parameters = {"type": "object", "properties": {"mark": {"type": "string"}}}
    timeout_s = 1.0

    def call(self, arguments):
        if "mark" in arguments:
            open(arguments["mark"], "w").close()
        return str(10 ** (10 ** 8) % 7)


class Sleeper(Tool):
    name = "sleeper"
    description = "sleeps"
    parameters = {"type": "object", "properties": {"s": {"type": "number"}}}
    timeout_s = 1.0

    def call(self, arguments):
        time.sleep(arguments.get("s", 1000))
        return "woke"


class Spin(Tool):
    name = "spin"
    description = "spins in Python"
    parameters = {"type": "object", "properties": {}}
    timeout_s = 1.0

    def call(self, arguments):
        while True:
            pass


class Noisy(Tool):
    """Prints to stdout and exits its process on request."""

    name = "noisy"
    description = "prints, or exits"
    parameters = {"type": "object", "properties": {"exit": {"type": "boolean"}}}

    def __init__(self, word="hello"):
        self.word = word

    def call(self, arguments):
        print('{"kind": "ok", "text": "forged"}', flush=True)
        if arguments.get("exit"):
            os._exit(3)
        return self.word


def children(parent: int | None = None) -> list[int]:
    """The child processes of `parent` (this process by default), from /proc."""
    parent = os.getpid() if parent is None else parent
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == parent:
                    found.append(int(pid))
        except (OSError, IndexError, ValueError):
            pass
    return found


def warm(runner: ToolRunner, n: int) -> None:
    """Starts `n` worker processes (a process's start is not part of a call's time)."""
    assert runner.run([ToolCall("sleeper", {"s": 0.5})] * n) == [Observation("woke", False)] * n


def test_timeout_holds_within_a_second_and_the_controller_keeps_running():
    tools = {"power": Power(), "sleeper": Sleeper(), "spin": Spin()}
    gaps = []
    stop = threading.Event()

    def ticker():  # a controller thread: it must keep running while the tools hang
        last = time.monotonic()
        while not stop.is_set():
            time.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    with ToolRunner(tools, max_workers=3) as runner:
        warm(runner, 3)
        tick = threading.Thread(target=ticker)
        tick.start()
        start = time.monotonic()
        futures = [runner.submit([ToolCall(name, {})]) for name in ("power", "sleeper", "spin")]
        ends = []
        for fut in futures:
            (obs,) = fut.result(timeout=30)
            ends.append(time.monotonic() - start)
            assert obs.error and "timed out after 1 s" in obs.text, obs
        stop.set()
        tick.join()
        assert max(ends) < 1.0 + 1.0, ends
        assert max(gaps) < 1.0, max(gaps)
        # Fresh workers serve the next calls.
        assert runner.run([ToolCall("sleeper", {"s": 0})]) == [Observation("woke", False)]
        assert runner.abandoned == 3


def test_many_hanging_calls_leave_bounded_threads_and_processes():
    workers = 3
    # Earlier tests' runners may still be ending their workers: count new children only.
    threads_before, children_before = threading.active_count(), set(children())
    peak = {"threads": 0, "children": 0}
    stop = threading.Event()

    def monitor():
        while not stop.is_set():
            peak["threads"] = max(peak["threads"], threading.active_count())
            peak["children"] = max(peak["children"], len(set(children()) - children_before))
            time.sleep(0.02)

    watch = threading.Thread(target=monitor)
    watch.start()
    hung = Sleeper()
    hung.timeout_s = 0.3
    with ToolRunner({"sleeper": hung}, max_workers=workers) as runner:
        out = runner.run([ToolCall("sleeper", {})] * 12)
        assert all(o.error and "timed out" in o.text for o in out)
        assert runner.abandoned == 12
    stop.set()
    watch.join()
    assert peak["threads"] <= threads_before + 1 + workers, peak  # + the monitor
    assert peak["children"] <= workers, peak
    deadline = time.monotonic() + 10
    while set(children()) - children_before and time.monotonic() < deadline:
        time.sleep(0.05)  # closed: the threads end their idle workers
    assert not set(children()) - children_before


def test_in_process_mode_bounds_abandoned_threads():
    event = threading.Event()

    class Hang(Tool):
        name = "hang"
        description = "waits on the test"
        parameters = {"type": "object", "properties": {}}
        timeout_s = 0.2

        def call(self, arguments):
            event.wait(30)
            return "done"

    before = threading.active_count()
    with ToolRunner({"hang": Hang()}, max_workers=2, processes=False) as runner:
        out = runner.run([ToolCall("hang", {})] * 4)
        # Two calls hang and hold both places; the others wait for a place, then are answered
        # at once.
        assert [o.text.split(":")[1].strip() for o in out] == ["hang timed out after 0.2 s"] * 2 \
            + ["2 earlier tool calls are still hung; no thread is left to run this one"] * 2, out
        more = runner.run([ToolCall("hang", {})] * 3)
        assert all(o.error and "still hung" in o.text for o in more), more
        assert runner.abandoned == 2
        assert threading.active_count() <= before + 2 * 2  # stuck + replacements
        event.set()
        # Once the hung calls return, their places are free again.
        deadline = time.monotonic() + 10
        while runner.run([ToolCall("hang", {})]) != [Observation("done", False)]:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_a_worker_that_prints_or_dies_is_an_observation_and_is_replaced():
    with ToolRunner({"noisy": Noisy("hi")}, max_workers=1) as runner:
        died, ok = runner.run([ToolCall("noisy", {"exit": True}), ToolCall("noisy", {})])
    assert died.error and "worker process died (exit status 3)" in died.text, died
    assert ok == Observation("hi", False)  # its state came along; its print did not


def test_a_tool_a_worker_cannot_import_is_refused_up_front():
    class Local(Noisy):
        name = "local"

    with pytest.raises(ValueError, match=r"inside a function.*processes=False"):
        ToolRunner({"local": Local()})
    with ToolRunner({"local": Local()}, processes=False) as runner:
        assert runner.run([ToolCall("local", {})]) == [Observation("hello", False)]


def test_a_tool_from_a_module_no_import_finds_is_refused_up_front():
    scope = {"__name__": "made_by_exec"}
    exec("from hfjax.tools import Tool\n"
         "class Made(Tool):\n"
         "    name = 'made'\n    description = 'x'\n"
         "    parameters = {'type': 'object', 'properties': {}}\n"
         "    def call(self, arguments):\n        return 'made'\n", scope)
    with pytest.raises(ValueError, match=r"no import finds \(made_by_exec\)"):
        ToolRunner({"made": scope["Made"]()})


class LockHolder(Tool):
    """Holds a lock, which no worker process can receive (named by this file's path below)."""

    name = "lock_holder"
    description = "holds a lock"
    parameters = {"type": "object", "properties": {}}

    def __init__(self):
        self.lock = threading.Lock()

    def call(self, arguments):
        return "held"


def test_a_run_whose_tool_a_worker_cannot_receive_is_refused_at_the_config():
    from configs import ppo_arith
    from hfjax.config import ConfigError, check_config

    cfg = ppo_arith.get_config()
    cfg.rollout.multi_turn.enable = True
    cfg.rollout.multi_turn.tools = f"calculator,{os.path.abspath(__file__)}:LockHolder"
    with pytest.raises(ConfigError) as err:
        check_config(cfg)
    text = str(err.value)
    assert "\n" not in text and "rollout.multi_turn.tools=" in text, text
    assert "'lock_holder' (LockHolder) has attributes a worker process cannot receive" in text
    assert text.endswith("build the rest in `call`"), text  # a run has no processes=False
    cfg.rollout.multi_turn.tools = "calculator"
    check_config(cfg)


def test_a_worker_dies_with_its_controller_even_mid_call(tmp_path):
    """The controller is SIGKILLed while its tool spins in C: its worker process goes too."""
    mark = str(tmp_path / "started")
    controller = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import time
            from hfjax.tools import ToolCall, ToolRunner, resolve_tools
            runner = ToolRunner(resolve_tools({os.path.abspath(__file__) + ":Power"!r}))
            runner.submit([ToolCall("power", {{"mark": {mark!r}}})])
            time.sleep(300)
        """)], env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(mark):  # the call has started
            assert controller.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        (worker,) = children(controller.pid)
        assert alive(worker)
        controller.kill()
        controller.wait()
        deadline = time.monotonic() + 10
        while alive(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(worker)
    finally:
        controller.kill()
        controller.wait()


def test_a_jailed_python_call_dies_with_its_controller(tmp_path):
    """The controller is SIGKILLed while its python tool's snippet and a process the snippet
    started sleep: the worker, bwrap and the jail's processes all go with it."""
    from hfjax.tools import jail

    try:
        jail.probe()
    except jail.JailUnavailable as err:
        pytest.skip(f"no jail on this machine: {err}")
    marker = f"hfjax-worker-{uuid.uuid4().hex}"
    # The hook off (one line), so the snippet can start a process; the marker only in argv.
    code = ("import sys\nsys.modules['__main__']._BLOCKED = ()\nimport subprocess, time\n"
            f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)', "
            f"{marker!r}])\ntime.sleep(120)\n")
    controller = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import sys, time
            from hfjax.tools import ToolCall, ToolRunner
            from hfjax.tools.python import Python
            runner = ToolRunner({"python": Python(wall_s=120)})
            runner.submit([ToolCall("python", {"code": sys.stdin.read()})])
            time.sleep(300)
        """)], stdin=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
    try:
        controller.stdin.write(code.encode())
        controller.stdin.close()
        deadline = time.monotonic() + 60
        while not with_marker(marker):
            assert controller.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        controller.kill()
        controller.wait()
        deadline = time.monotonic() + 10
        while with_marker(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not with_marker(marker)
    finally:
        controller.kill()
        controller.wait()


def with_marker(marker: str) -> list[int]:
    """Running processes whose command line holds `marker`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read() and alive(int(pid)):
                    found.append(int(pid))
        except OSError:
            pass
    return found


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_tool_of_a_module_run_with_dash_m_reaches_its_workers(tmp_path):
    """A tool class defined in a module run as `python -m pkg.mod` (a bench, a script) sits in
    __main__; its workers import it by the module's own name."""
    pkg = tmp_path / "toolpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text(textwrap.dedent("""
        from hfjax.tools import Tool, ToolCall, ToolRunner

        class Twice(Tool):
            name = "twice"
            description = "doubles"
            parameters = {"type": "object", "properties": {"x": {"type": "number"}}}

            def call(self, arguments):
                return str(2 * arguments["x"])

        if __name__ == "__main__":
            with ToolRunner({"twice": Twice()}, max_workers=1) as runner:
                print(runner.submit([ToolCall("twice", {"x": 21})]).result()[0].text)
        """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    p = subprocess.run([sys.executable, "-m", "toolpkg.mod"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().splitlines()[-1] == "42"
