"""Tool calls in worker processes (`main`, run by `python -c`), speaking JSON lines.

A `ToolRunner` (hfjax/tools/runner.py) runs each call in one of these processes, so a tool that
holds the interpreter lock in C (`10 ** (10 ** 8)`), hangs, or crashes stalls nothing in the
controller, and a call past its deadline is ended by killing its process. As with the reward
scorers (hfjax/rewards/pool.py): no fork of the multi-threaded JAX process, and tools are sent
by reference, never as code: a tool's class as `module:QualName` (or the `path/to/file.py:Class`
spec it was loaded from, `base.FILE_SPEC`), and its instance's attributes pickled (the
controller's own objects, going to its own child). The worker imports the class and rebuilds
the instance without calling its constructor, so the python tool's jail probe runs once, in the
controller, not per worker.

Protocol. First line in: {"tools": {name: [class reference, base64 pickle of __dict__]},
"max_chars": n}; the worker answers {"ready": true} or {"load_error": text}. Then one line in per
call, {"tool": name, "args": {...}}, one line out: {"kind": "ok" | "tool_error" | "error" |
"not_text", "text": ..., "chars": length before the cut}, the text cut to `max_chars` here, so
a tool that returns a gigabyte does not send it. The worker's stdout (fd 1) is its stderr: a
tool that prints cannot corrupt the protocol, which runs on a private copy of the original
stdout.
"""

from __future__ import annotations

import atexit
import base64
import importlib
import json
import os
import pickle
import select
import signal
import subprocess
import sys
import time
from typing import Any

from hfjax.tools.base import FILE_SPEC, Tool, ToolError


def tool_reference(key: str, tool: Tool, where: str = "ToolRunner") -> list[str]:
    """How a worker process rebuilds `tool`: [class reference, base64 pickle of its attributes].
    ValueError, in one line naming the fix, where it cannot be sent; `where` is "ToolRunner"
    (whose caller may pass processes=False instead) or "run" (which always uses workers)."""
    cls = type(tool)
    alt = (", or pass processes=False (the call then runs in this process, and a hung call "
           "cannot be stopped)") if where == "ToolRunner" else ""
    head = "ToolRunner: " if where == "ToolRunner" else ""
    spec = cls.__dict__.get(FILE_SPEC)
    module = cls.__module__
    if module == "__main__":  # `python -m pkg.mod`: the worker imports it as pkg.mod
        main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        module = getattr(main_spec, "name", None) or module
    if spec:
        ref = "file:" + spec
    elif (module == "__main__" or "<locals>" in cls.__qualname__
          or not _importable(module)):
        raise ValueError(
            f"{head}tool {key!r} ({cls.__qualname__}) is defined in __main__, inside a "
            f"function or in a module no import finds ({module}), so a worker process "
            "cannot import it; define it at module level of an importable module (or load it "
            f"as path/to/file.py:Class){alt}")
    else:
        ref = f"module:{module}:{cls.__qualname__}"
    try:
        state = pickle.dumps(tool.__dict__)
    except Exception as err:
        raise ValueError(
            f"{head}tool {key!r} ({cls.__qualname__}) has attributes a worker process "
            f"cannot receive ({type(err).__name__}: {err}); keep plain settings on the instance "
            f"and build the rest in `call`{alt}") from None
    return [ref, base64.b64encode(state).decode("ascii")]


def _importable(module: str) -> bool:
    """Whether a fresh interpreter with this one's import path finds `module`'s top-level
    package (sys.modules aside: a module made by exec is there, but no import finds it)."""
    top = module.partition(".")[0]
    if top in sys.builtin_module_names:
        return True
    for finder in sys.meta_path:  # the path finder, and editable installs' finders
        try:
            if getattr(finder, "find_spec", None) and finder.find_spec(top, None):
                return True
        except Exception:  # noqa: BLE001 (a broken finder finds nothing)
            continue
    return False


def _load(ref: str, state: str) -> Tool:
    kind, _, where = ref.partition(":")
    if kind == "file":
        from hfjax.tools.registry import tool_classes

        [(_, cls)] = tool_classes(where)
    else:
        module, _, qualname = where.partition(":")
        cls = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
    tool = cls.__new__(cls)
    tool.__dict__.update(pickle.loads(base64.b64decode(state)))
    return tool


def _answer(tool: Tool, args: Any, max_chars: int) -> dict:
    try:
        text = tool.call(args)
    except ToolError as err:
        kind, text = "tool_error", str(err)
    except BaseException as err:  # noqa: BLE001 (SystemExit, KeyboardInterrupt too: the
        # policy's observation, and the worker lives on for the next call)
        kind, text = "error", f"{type(err).__name__}: {err}"
    else:
        kind = "ok"
        if not isinstance(text, str):
            kind, text = "not_text", type(text).__name__
    return {"kind": kind, "text": text[:max_chars], "chars": len(text)}


def _die_with_parent() -> None:
    """SIGKILL this worker when the runner thread that started it ends (the controller killed,
    say), even mid-call; exit at once if that already happened."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: a hung call then runs on alone
        pass
    if len(sys.argv) > 1 and os.getppid() != int(sys.argv[1]):
        os._exit(0)


def main() -> None:
    _die_with_parent()
    proto = os.fdopen(os.dup(1), "w", encoding="utf-8", errors="surrogatepass")
    os.dup2(2, 1)  # what tools print goes to stderr, not into the protocol
    lines = sys.stdin.buffer
    first = lines.readline()
    if not first:
        return
    try:
        setup = json.loads(first)
        max_chars = int(setup["max_chars"])
        tools = {name: _load(ref, state) for name, (ref, state) in setup["tools"].items()}
    except BaseException as err:  # noqa: BLE001 (anything a tool's import raises is reported)
        proto.write(json.dumps({"load_error": f"{type(err).__name__}: {err}"}) + "\n")
        proto.flush()
        return
    proto.write('{"ready": true}\n')
    proto.flush()
    for line in lines:
        req = json.loads(line)
        proto.write(json.dumps(_answer(tools[req["tool"]], req["args"], max_chars)) + "\n")
        proto.flush()


# Not `-m hfjax.tools.worker`: the package's __init__ imports this module first.
_ENTRY = "from hfjax.tools.worker import main; main()"
_LIVE: set[WorkerProcess] = set()  # killed at exit: a daemon runner thread never ends them


@atexit.register
def _kill_all() -> None:
    for worker in list(_LIVE):
        worker.kill()


class WorkerProcess:
    """One worker subprocess, driven by one runner thread at a time."""

    def __init__(self, payload: str, env: dict[str, str]):
        # Its own session, so killing it at a deadline also ends what its tool started in the
        # same group (the python tool's bwrap, whose namespace dies with it).
        self.proc = subprocess.Popen([sys.executable, "-c", _ENTRY, str(os.getpid())],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                     bufsize=0, start_new_session=True)
        self._buf = b""
        _LIVE.add(self)
        try:
            self._send(payload)
        except OSError:
            pass  # it died at once: the first read reports it

    def _send(self, line: str) -> None:
        self.proc.stdin.write(line.encode("utf-8", errors="surrogatepass") + b"\n")

    def read(self, deadline: float) -> dict | None:
        """The next line as JSON, or None at `deadline` (the caller kills the process); EOFError
        when the process has died."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    def call(self, name: str, args: dict, deadline: float) -> dict | None:
        self._send(json.dumps({"tool": name, "args": args}))
        return self.read(deadline)

    def kill(self) -> None:
        _LIVE.discard(self)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass

    def exit_status(self) -> int | None:
        return self.proc.poll()

