"""Runs tool calls off the decoding thread, so the engine keeps decoding other rows while a
row's tools run.

`ToolRunner.submit(calls)` returns at once with a Future of one Observation per call, in order.
The future never fails: a malformed call (already an Observation from the parser), an unknown
tool, arguments that do not fit the tool's schema, an exception in `call`, a call that runs past
the tool's `timeout_s`, and an output longer than `max_output_chars` (truncated) all become
error observations.

Calls run on daemon worker threads. A thread cannot be killed, so a call past its timeout is
abandoned: its observation says it timed out, a fresh worker takes its place, and the old thread
ends whenever the call returns (daemon, so it never holds up the process's exit). A tool that can
hang for good should bound itself, as the `python` tool does by killing its subprocess.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Sequence

from absl import logging

from hfjax.tools.base import Observation, Tool, ToolCall, ToolError
from hfjax.tools.schema import check_object


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
    """Runs `ToolCall`s on the tools `tools` (name -> Tool) with up to `max_workers` at once.

    `max_output_chars` caps the text of one observation. Use as a context manager, or call
    `close()` when done.
    """

    def __init__(self, tools: dict[str, Tool], max_workers: int = 8,
                 max_output_chars: int = 4096):
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
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._workers = 0
        self._closed = False
        self.abandoned = 0  # calls given up on at their timeout, whose threads may still run

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
        """Stop the workers once the queued calls are done; later submissions get an error
        observation. Abandoned calls are not waited for."""
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
        threading.Thread(target=self._work, name="hfjax-tool", daemon=True).start()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            tool, args, slot = job

            def on_timeout(tool=tool):
                logging.warning("tool %s timed out after %s s; its thread is abandoned",
                                tool.name, tool.timeout_s)
                with self._lock:
                    self.abandoned += 1
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
                    obs = _error(f"{tool.name} returned {type(text).__name__}, not text")
                else:
                    text, cut = truncate(text, self.max_output_chars)
                    obs = Observation(text, error=cut)
            except ToolError as err:
                obs = _error(truncate(f"{tool.name}: {err}", self.max_output_chars)[0])
            except Exception as err:  # a tool's failure is the policy's observation
                obs = _error(truncate(f"{tool.name} failed: {type(err).__name__}: {err}",
                                      self.max_output_chars)[0])
            finally:
                timer.cancel()
            if not slot.set(obs):
                return  # timed out: a replacement worker took this thread's place
