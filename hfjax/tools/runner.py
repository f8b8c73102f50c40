"""Runs tool calls off the decoding thread, so the engine keeps decoding other rows while a
row's tools run, and in worker processes, so no tool can stall the controller.

`ToolRunner.submit(calls)` returns at once with a Future of one Observation per call, in order.
The future never fails: a malformed call (already an Observation from the parser), an unknown
tool, arguments that do not fit the tool's schema, any exception in `call` or in sending the call
(BaseException included: RecursionError from deeply nested arguments, MemoryError, SystemExit,
KeyboardInterrupt), a call that runs past the tool's `timeout_s`, and an output longer than
`max_output_chars` (truncated, with a note of how much was cut) all become error observations;
the runner's threads outlive every call.

With `processes=True` (the default) each of the `max_workers` runner threads drives one worker
process (`hfjax.tools.worker`, JSON lines; the tools are sent by reference, see that
module). A call runs in the worker, outside the controller's interpreter: a tool that spins in C
holding its interpreter lock, hangs or crashes stalls nothing here. At the call's deadline its
worker process group is killed (SIGKILL) and the observation says it timed out; the thread
starts a fresh worker for its next call. So a hung tool leaves nothing behind: at most
`max_workers` threads and `max_workers` worker processes exist, whatever the tools do, and a
timeout is reported when it falls (the thread waits on the worker's pipe with the deadline as
its timeout), not when the tool returns.

With `processes=False` calls run on the runner's own threads, in this interpreter: for tools
that cannot be sent to a process (closures, shared state with the caller). A thread cannot be
killed, so a call past its timeout is abandoned: its observation says it timed out and a fresh
thread takes its place. A running or abandoned call holds one of `max_workers` places until
it returns; a call waits for a place, and once every place is held by an abandoned call, calls
are answered with an error. So at most `max_workers` abandoned threads exist at once, and
`2 * max_workers` runner threads in all. A tool that spins in C
holding the interpreter lock stalls the controller in this mode.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Sequence

from absl import logging

from hfjax.tools.base import Observation, Tool, ToolCall, ToolError
from hfjax.tools.schema import check_object
from hfjax.tools.worker import WorkerProcess, tool_reference

# How long a fresh worker process may take to import its tools (not counted in a call's time).
LOAD_TIMEOUT_S = 300.0


def _error(text: str) -> Observation:
    return Observation(f"Error: {text}", error=True)


def truncate(text: str, limit: int) -> tuple[str, bool]:
    """`text` cut to `limit` characters with a note of what was cut, and whether it was cut."""
    if len(text) <= limit:
        return text, False
    return text[:limit] + f"\n[output truncated: {len(text) - limit} more characters]", True


class _Slot:
    """One call's result, set once by whichever comes first: the call's end or its timeout."""

    def __init__(self, on_set):
        self._lock = threading.Lock()
        self._on_set = on_set
        self.done = False

    def set(self, obs: Observation, first=None) -> bool:
        """Delivers `obs` unless the slot is already set; `first()` runs between winning and
        delivering, so its bookkeeping is visible to whoever waits on the result."""
        with self._lock:
            if self.done:
                return False
            self.done = True
        if first is not None:
            first()
        self._on_set(obs)
        return True


class ToolRunner:
    """Runs `ToolCall`s on the tools `tools` (name -> Tool) with up to `max_workers` at once,
    in worker processes unless `processes=False` (see the module docstring).

    `max_output_chars` caps the text of one observation. Use as a context manager, or call
    `close()` when done.
    """

    def __init__(self, tools: dict[str, Tool], max_workers: int = 8,
                 max_output_chars: int = 4096, processes: bool = True):
        if max_workers < 1:
            raise ValueError(f"ToolRunner: max_workers must be >= 1, got {max_workers}")
        if max_output_chars < 1:
            raise ValueError(f"ToolRunner: max_output_chars must be >= 1, got {max_output_chars}")
        for key, tool in tools.items():
            if not isinstance(tool, Tool):
                raise ValueError(f"ToolRunner: tools[{key!r}] = {tool!r} is not a Tool")
            timeout = getattr(tool, "timeout_s", None)
            if (not isinstance(timeout, (int, float)) or isinstance(timeout, bool)
                    or not 0 < timeout < float("inf")):
                raise ValueError(f"ToolRunner: tool {key!r} has timeout_s={timeout!r}; give a "
                                 "finite number of seconds > 0")
        self.tools = dict(tools)
        self.max_workers = max_workers
        self.max_output_chars = max_output_chars
        self.processes = processes
        self._payload = ""
        if processes:
            self._payload = json.dumps(
                {"tools": {k: tool_reference(k, t) for k, t in self.tools.items()},
                 "max_chars": max_output_chars})
            self._env = dict(os.environ)
            # Workers see this process's import path: whatever module a tool came from is
            # importable there too.
            self._env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._place_freed = threading.Condition(self._lock)
        self._workers = 0
        self._stuck = 0  # processes=False: abandoned threads still inside a call
        self._busy = 0  # processes=False: calls running on live threads
        self._closed = False
        self.abandoned = 0  # calls given up on at their timeout

    # -- public -------------------------------------------------------------------------------

    def submit(self, calls: Sequence[ToolCall | Observation]
               ) -> concurrent.futures.Future[list[Observation]]:
        """A Future of one Observation per entry of `calls`, in order (see the module
        docstring); returns at once."""
        out: concurrent.futures.Future = concurrent.futures.Future()
        out.set_running_or_notify_cancel()
        results: list[Observation | None] = [None] * len(calls)
        remaining = [len(calls)]
        lock = threading.Lock()

        def setter(i):
            def on_set(obs: Observation) -> None:
                results[i] = obs
                with lock:
                    remaining[0] -= 1
                    last = remaining[0] == 0
                if last:
                    out.set_result(list(results))
            return on_set

        if not calls:
            out.set_result([])
            return out
        answered: list[tuple[_Slot, Observation]] = []
        for i, call in enumerate(calls):
            slot = _Slot(setter(i))
            try:
                obs = self._precheck(call)
            except Exception as err:  # a schema the check cannot read: still an observation
                obs = _error(f"cannot check the call's arguments: {type(err).__name__}: {err}")
            if obs is not None:
                answered.append((slot, obs))
                continue
            # Checked and queued under the lock, so close() cannot slip in between and leave
            # the job without a worker.
            with self._lock:
                if not self.processes and self._stuck >= self.max_workers:
                    answered.append((slot, self._all_hung()))
                    continue
                if not self._closed:
                    if self._workers < self.max_workers:
                        self._workers += 1
                        self._spawn()
                    self._jobs.put((self.tools[call.name], call.arguments, slot))
                    continue
            answered.append((slot, _error("the tool runner is closed")))
        # Set outside the lock: the last one resolves the future, which runs its callbacks.
        for slot, obs in answered:
            slot.set(obs)
        return out

    def run(self, calls: Sequence[ToolCall | Observation]) -> list[Observation]:
        """`submit(calls).result()`: the observations, blocking until all calls end."""
        return self.submit(calls).result()

    def close(self) -> None:
        """Stop the workers once the queued calls are done (each thread then ends its worker
        process); later submissions get an error observation. Abandoned calls are not waited
        for."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers = self._workers
        for _ in range(workers):
            self._jobs.put(None)

    def __enter__(self) -> ToolRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------

    def _precheck(self, call) -> Observation | None:
        if isinstance(call, Observation):
            return call
        if not isinstance(call, ToolCall):
            return _error(f"not a tool call: {call!r}")
        if call.name not in self.tools:
            return _error(f"unknown tool {call.name!r}; available: "
                          f"{', '.join(sorted(self.tools)) or '(none)'}")
        why = check_object(call.arguments, self.tools[call.name].parameters,
                           f"{call.name} arguments")
        if why:
            return _error(f"bad arguments: {why}")
        return None

    def _spawn(self) -> None:
        target = self._work_processes if self.processes else self._work
        threading.Thread(target=target, name="hfjax-tool", daemon=True).start()

    def _observe(self, name: str, kind: str, text: str, chars: int | None = None
                 ) -> Observation:
        """The observation for a call's outcome; `chars` is the text's length before a worker
        cut it to `max_output_chars`."""
        if kind == "ok":
            if chars is not None and chars > len(text):
                return Observation(text + f"\n[output truncated: {chars - len(text)} more "
                                   "characters]", error=True)
            text, cut = truncate(text, self.max_output_chars)
            return Observation(text, error=cut)
        if kind == "not_text":
            return _error(f"{name} returned {text}, not text")
        if kind == "tool_error":
            return _error(truncate(f"{name}: {text}", self.max_output_chars)[0])
        return _error(truncate(f"{name} failed: {text}", self.max_output_chars)[0])

    def _work_processes(self) -> None:
        """One runner thread and its worker process (started on demand, replaced when killed)."""
        worker: WorkerProcess | None = None
        try:
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                tool, args, slot = job
                try:
                    worker, obs = self._in_process(worker, tool, args)
                except BaseException as err:  # noqa: BLE001 (this thread must outlive any call)
                    # Arguments the protocol cannot encode (RecursionError from ~1,000 nested
                    # levels), MemoryError, an interrupt: that call's observation, and a fresh
                    # worker for the next call (this one may hold half a request).
                    if worker is not None:
                        worker.kill()
                    worker = None
                    obs = self._observe(tool.name, "error", f"{type(err).__name__}: {err}")
                slot.set(obs)
        finally:
            if worker is not None:
                worker.kill()

    def _in_process(self, worker, tool: Tool, args: dict):
        """(the worker to keep, or None, and the call's observation)."""
        if worker is None:
            try:
                worker = WorkerProcess(self._payload, self._env)
            except OSError as err:
                return None, _error(f"{tool.name}: cannot start a worker process: {err}")
            try:
                ready = worker.read(time.monotonic() + LOAD_TIMEOUT_S)
            except (EOFError, ValueError):
                ready = {"load_error": f"the worker process exited ({worker.exit_status()})"}
            if not ready or "ready" not in ready:
                worker.kill()
                why = (ready or {}).get("load_error",
                                        f"no answer within {LOAD_TIMEOUT_S:g} s")
                return None, _error(f"{tool.name}: the worker process could not load the "
                                    f"tools: {why}")
        deadline = time.monotonic() + tool.timeout_s
        try:
            answer = worker.call(tool.name, args, deadline)
        except (EOFError, OSError, ValueError):
            worker.kill()
            return None, _error(f"{tool.name} failed: its worker process died (exit status "
                                f"{worker.exit_status()})")
        if answer is None:
            worker.kill()
            with self._lock:
                self.abandoned += 1
            logging.warning("tool %s timed out after %s s; its worker process was killed",
                            tool.name, tool.timeout_s)
            return None, _error(f"{tool.name} timed out after {tool.timeout_s:g} s")
        return worker, self._observe(tool.name, answer["kind"], answer["text"],
                                     answer.get("chars"))

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            tool, args, slot = job
            # A running or stuck call holds one of max_workers places: a call waits for a place
            # while another call may still end, and is refused once every place is stuck. Every
            # stuck thread held a place, so at most max_workers threads are ever stuck.
            with self._place_freed:
                while self._stuck < self.max_workers and \
                        self._busy + self._stuck >= self.max_workers:
                    self._place_freed.wait()
                full = self._stuck >= self.max_workers
                if not full:
                    self._busy += 1
            if full:
                slot.set(self._all_hung())
                continue

            def on_timeout(tool=tool):
                logging.warning("tool %s timed out after %s s; its thread is abandoned",
                                tool.name, tool.timeout_s)
                with self._lock:
                    self.abandoned += 1
                    self._busy -= 1
                    self._stuck += 1
                    self._place_freed.notify_all()  # waiting calls now see every place stuck
                    # This thread is stuck in the call: a fresh worker takes its place.
                    if not self._closed:
                        self._spawn()

            def timed_out(tool=tool, slot=slot, on_timeout=on_timeout):
                slot.set(_error(f"{tool.name} timed out after {tool.timeout_s:g} s"),
                         first=on_timeout)

            timer = threading.Timer(tool.timeout_s, timed_out)
            timer.daemon = True
            timer.start()
            try:
                text = tool.call(args)
                if not isinstance(text, str):
                    obs = self._observe(tool.name, "not_text", type(text).__name__)
                else:
                    obs = self._observe(tool.name, "ok", text)
            except ToolError as err:
                obs = self._observe(tool.name, "tool_error", str(err))
            except BaseException as err:  # noqa: BLE001 (a tool's failure, even SystemExit or
                # KeyboardInterrupt, is the policy's observation: this thread must not die)
                obs = self._observe(tool.name, "error", f"{type(err).__name__}: {err}")
            finally:
                timer.cancel()
            if not slot.set(obs, first=self._unbusy):
                with self._lock:
                    self._stuck -= 1
                    self._place_freed.notify_all()
                return  # timed out: a replacement worker took this thread's place

    def _unbusy(self) -> None:
        with self._lock:
            self._busy -= 1
            self._place_freed.notify_all()

    def _all_hung(self) -> Observation:
        return _error(f"{self._stuck} earlier tool calls are still hung; no thread is left "
                      "to run this one")
