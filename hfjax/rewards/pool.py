"""Runs rule rewards on the host, in scorer processes, with a per-call timeout.

Why processes and not threads: a thread cannot be stopped, so a reward function that hangs
would hold its thread (and, if it spins in Python, a share of the GIL) for the rest of the run.
A process can be killed: a call past its deadline ends its process, scores 0 and is counted,
and a fresh process takes its place. Processes also let math-verify arm its SIGALRM timeouts,
which it refuses to do off the main thread, and keep rule scoring off the controller's GIL.

The scorers are plain `python -m hfjax.rewards.scorer` subprocesses speaking JSON lines (see
that module): no fork of the multithreaded JAX process, no re-import of the controller's main
module, and no pickling. A function is sent by reference, as its module and qualified name, or
as the `file.py:fn` spec a custom reward was loaded from; the scorer imports it once.

`num_processes=0` scores in the calling thread instead: errors are still caught and counted, but
nothing can stop a hung function. It is meant for debugging and for callers that are already
isolated.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from absl import logging

from hfjax.rewards.custom import SPEC_ATTR
from hfjax.rewards.scorer import to_score

FnRef = tuple[str, ...]

OK, ERROR, TIMEOUT = "ok", "error", "timeout"


@dataclass(frozen=True)
class Outcome:
    """The result of one reward call: its score (0.0 unless `status` is "ok") and any error."""

    score: float
    status: str
    error: str = ""


def reference(fn) -> FnRef:
    """How a scorer process finds `fn`: its custom spec, or its module and qualified name."""
    spec = getattr(fn, SPEC_ATTR, None)
    if spec:
        return ("file", spec)
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<locals>" in qualname or not qualname:
        raise ValueError(
            f"reward function {fn!r} cannot be imported by a scorer process (it is defined in "
            "__main__ or inside a function); define it at module level in an importable "
            "module, load it with reward.custom_fn=path/to/file.py:fn, or use "
            "reward.num_processes=0"
        )
    return ("module", module, qualname)


class _Scorer:
    """One scorer subprocess and the call it is running, if any."""

    def __init__(self, env: dict[str, str]):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hfjax.rewards.scorer"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            bufsize=0,
        )
        self.fd = self.proc.stdout.fileno()
        self.buf = b""
        self.call: int | None = None
        self.deadline = 0.0

    def send(self, msg: dict) -> None:
        self.proc.stdin.write((json.dumps(msg, default=_jsonable) + "\n").encode())

    def messages(self) -> list[dict] | None:
        """Complete answers read so far; None at end of file (the process died)."""
        chunk = os.read(self.fd, 1 << 16)
        if not chunk:
            return None
        self.buf += chunk
        *lines, self.buf = self.buf.split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class RewardPool:
    """Scores reward calls in `num_processes` processes, each call limited to `timeout_s`.

    `map` returns one Outcome per call, in order. A call that raises, returns something that is
    not a finite number, or kills its process is an "error"; one that runs past `timeout_s` is a
    "timeout" and its process is replaced. Either way the score is 0.0. Processes start on the
    first `map` and stay until `close` (or interpreter exit).
    """

    def __init__(self, num_processes: int = 2, timeout_s: float = 10.0,
                 load_timeout_s: float = 120.0):
        if num_processes < 0:
            raise ValueError(f"reward num_processes must be >= 0, got {num_processes}")
        if timeout_s <= 0:
            raise ValueError(f"reward timeout_s must be positive, got {timeout_s}")
        self.num_processes = num_processes
        self.timeout_s = float(timeout_s)
        self.load_timeout_s = float(load_timeout_s)
        self._procs: list[_Scorer] = []
        self._next_id = 0
        self._env = dict(os.environ)
        # Workers see the parent's import path, so any module the parent imported a reward
        # function from is importable there too.
        self._env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        atexit.register(self.close)

    def map(self, fns: Sequence[Any], args: Sequence[tuple]) -> list[Outcome]:
        """Outcome of `fns[i](*args[i])` for each i; never raises for a function's failure."""
        if len(fns) != len(args):
            raise ValueError(f"{len(fns)} functions for {len(args)} argument tuples")
        if self.num_processes == 0:
            return [_call_inline(fn, a) for fn, a in zip(fns, args)]
        refs = [reference(fn) for fn in fns]
        return self._map_processes(refs, args)

    def preload(self, fn, timeout_s: float | None = None) -> None:
        """Imports `fn` in every scorer process, starting them, before any call is made.

        Each process's import must finish within `timeout_s` (default: the per-call timeout)
        once the process is up. Raises ValueError naming the function when an import raises or
        runs out of time (that process is ended); a no-op with num_processes=0. This is how a
        custom reward file is checked: only the scorers import it, so a file that hangs while
        importing ends here, in bounded time, instead of hanging the controller.
        """
        if self.num_processes == 0:
            return
        ref = reference(fn)
        limit = self.timeout_s if timeout_s is None else float(timeout_s)
        while len(self._procs) < self.num_processes:
            self._procs.append(_Scorer(self._env))
        pending: dict[int, tuple[_Scorer, int]] = {}
        for w in self._procs:
            rid = self._next_id
            self._next_id += 1
            w.send({"id": rid, "fn": list(ref)})
            # Until the process says it is importing, it is starting up: the longer limit.
            w.deadline = time.monotonic() + self.load_timeout_s
            pending[w.fd] = (w, rid)
        problem = None
        while pending and problem is None:
            wait = max(0.0, min(w.deadline for w, _ in pending.values()) - time.monotonic())
            ready, _, _ = select.select(list(pending), [], [], wait)
            for fd in ready:
                w, rid = pending[fd]
                msgs = w.messages()
                if msgs is None:
                    problem = f"its scorer process exited with code {w.proc.wait()}"
                    break
                for msg in (m for m in msgs if m["id"] == rid):
                    if msg["event"] == "loading":
                        w.deadline = time.monotonic() + limit
                    elif msg["event"] == "loaded":
                        del pending[fd]
                    else:
                        problem = msg["error"].removeprefix("loading the reward: ")
            if problem is None and any(time.monotonic() >= w.deadline
                                       for w, _ in pending.values()):
                problem = (f"importing it took longer than {limit:g} s (reward.timeout_s); a "
                           "reward file must import quickly: move slow setup into the function "
                           "or raise reward.timeout_s")
        if problem is not None:
            for w, _ in pending.values():  # stuck or broken: end them, map starts fresh ones
                w.kill()
            self._procs = [w for w in self._procs if w.proc.poll() is None]
            if problem.startswith("reward.custom_fn"):
                raise ValueError(problem)
            what = f"reward.custom_fn {ref[1]!r}" if ref[0] == "file" else f"reward {ref[-1]}"
            raise ValueError(f"{what}: {problem}")

    def _map_processes(self, refs: list[FnRef], args: Sequence[tuple]) -> list[Outcome]:
        out: list[Outcome | None] = [None] * len(refs)
        todo = deque(range(len(refs)))
        while len(self._procs) < min(self.num_processes, len(refs)):
            self._procs.append(_Scorer(self._env))
        ids: dict[int, int] = {}  # request id -> call index
        while todo or any(w.call is not None for w in self._procs):
            for k, w in enumerate(self._procs):
                if w.call is None and todo:
                    i = todo.popleft()
                    rid = self._next_id
                    self._next_id += 1
                    ids[rid] = i
                    try:
                        w.send({"id": rid, "fn": list(refs[i]), "args": list(args[i])})
                    except (BrokenPipeError, OSError):
                        todo.appendleft(i)
                        self._replace(k)
                        continue
                    w.call, w.deadline = i, time.monotonic() + self.load_timeout_s
            busy = [w for w in self._procs if w.call is not None]
            wait = max(0.0, min(w.deadline for w in busy) - time.monotonic())
            ready, _, _ = select.select([w.fd for w in busy], [], [], wait)
            for k, w in enumerate(self._procs):
                if w.call is None or w.fd not in ready:
                    continue
                msgs = w.messages()
                if msgs is None:
                    code = w.proc.wait()
                    out[w.call] = Outcome(0.0, ERROR, f"reward scorer exited with code {code}")
                    self._replace(k)
                    continue
                for msg in msgs:
                    i = ids.pop(msg["id"]) if msg["event"] != "start" else ids[msg["id"]]
                    if msg["event"] == "start":
                        w.deadline = time.monotonic() + self.timeout_s
                    elif msg["event"] == "done":
                        out[i], w.call = Outcome(float(msg["score"]), OK), None
                    else:
                        out[i], w.call = Outcome(0.0, ERROR, msg["error"]), None
            now = time.monotonic()
            for k, w in enumerate(self._procs):
                if w.call is not None and now >= w.deadline:
                    for rid in [r for r, i in ids.items() if i == w.call]:
                        del ids[rid]
                    out[w.call] = Outcome(0.0, TIMEOUT, f"no result within {self.timeout_s:g} s")
                    self._replace(k)
        return out  # type: ignore[return-value]

    def _replace(self, k: int) -> None:
        self._procs[k].kill()
        self._procs[k] = _Scorer(self._env)

    def close(self) -> None:
        """Stop the scorer processes (a later `map` starts new ones)."""
        for w in self._procs:
            w.kill()
        self._procs = []


def _call_inline(fn, args: tuple) -> Outcome:
    try:
        return Outcome(to_score(fn(*args)), OK)
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # noqa: B036  (a broken rule must not kill the run)
        return Outcome(0.0, ERROR, f"{type(err).__name__}: {err}"[:500])


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, bytes):
        return x.decode("utf-8", "replace")
    raise TypeError(f"reward argument of type {type(x).__name__} is not JSON-serialisable")


_SHARED: dict[tuple[int, float], RewardPool] = {}


def shared_pool(num_processes: int, timeout_s: float) -> RewardPool:
    """One pool per (num_processes, timeout_s) in this process, so rewards that score
    training and validation batches share warm scorer processes."""
    key = (num_processes, float(timeout_s))
    if key not in _SHARED:
        _SHARED[key] = RewardPool(num_processes, timeout_s)
        logging.info("reward pool: %d scorer processes, %.3g s per call", num_processes, timeout_s)
    return _SHARED[key]


def close_shared_pools() -> None:
    """Stops the scorer processes of every shared pool; a later `map` starts fresh ones."""
    for pool in _SHARED.values():
        pool.close()
