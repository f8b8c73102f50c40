"""A lost process, named: how the processes of a run notice that one of them is gone, and how
they end (docs/scaling.md, "When a process is lost").

JAX's coordination service (hosted by process 0) expects a heartbeat from every process; one
that misses them for --heartbeat_timeout_s is declared dead and, by JAX's default, every other
process is then terminated with a log line naming the task. `LossWatch` keeps a heartbeat of
its own in the same service's key-value store, bumped by a thread of its own (so a process
that compiles or waits in a collective still beats), and reports a peer whose heartbeat has
not moved for half of --heartbeat_timeout_s (`lost_after_s`; 30 s by default): a process
killed (SIGKILL, the OOM killer) or frozen (SIGSTOP, a hung host) alike. Every survivor then
ends with `EXIT_LOST_PROCESS`, naming the process, the pools it held and the command that
resumes from the last checkpoint. JAX's own termination stays the backstop. A lost process 0
takes the coordination service with it: the others report that they lost the coordinator.

A process that ends on an error of its own marks itself failed in the store before it exits,
so the others stop at once, naming it, with `EXIT_ERROR` (rerunning does not help there).

A collective whose peer has died fails in the survivor with JAX's runtime error, or, from
gloo on CPU, with a `ValueError` ("Connection reset by peer", "Connection closed by peer"):
`before_error_exit` recognises both (`is_peer_loss`) and waits for the watch to name the lost
peer, instead of reporting a user error.
"""

from __future__ import annotations

import atexit
import os
import re
import shlex
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

# The process-lost exit status: EX_TEMPFAIL, "try again later", which is what a rerun (resuming
# from the last checkpoint) does.
EXIT_LOST_PROCESS = 75
# An uncaught exception in a multi-process run (here or in a peer).
EXIT_ERROR = 1
# Set by a launcher (launch.local_cluster) to the command that reruns the whole job.
ENV_RESUME_COMMAND = "HFJAX_RESUME_COMMAND"

_WATCH: LossWatch | None = None
_POOLS: dict[int, list[str]] = {}  # process -> "pool (roles)" it holds devices of
# What a collective reports when its peer is gone (gloo on CPU raises these as ValueError).
_PEER_GONE = re.compile(r"gloo|connection (reset|closed|refused) by peer|socket closed|"
                        r"broken pipe|failed to (send|receive)|unavailable:", re.IGNORECASE)


def lost_after_s(heartbeat_timeout_s: float) -> float:
    """Seconds without a heartbeat after which a peer is reported lost."""
    return max(2.0, heartbeat_timeout_s / 2)


def name_pools(pools: Mapping[str, Any]) -> None:
    """Records which pools (and roles) each process holds devices of, from the run's
    {role: ResourcePool}, so that a lost process is reported with its pools."""
    by_pool: dict[str, tuple[Any, list[str]]] = {}
    for role, pool in pools.items():
        by_pool.setdefault(pool.name, (pool, []))[1].append(role)
    _POOLS.clear()
    for name, (pool, roles) in by_pool.items():
        for p in sorted({d.process_index for d in pool.devices}):
            _POOLS.setdefault(p, []).append(f"{name} ({'+'.join(roles)})")


def describe(process: int) -> str:
    """'process 1 (pool train (actor+ref))', or 'process 1' before the pools are known."""
    pools = _POOLS.get(process)
    if not pools:
        return f"process {process}"
    return f"process {process} (pool{'s' if len(pools) > 1 else ''} {', '.join(pools)})"


def resume_command() -> str:
    """The command that reruns this job: the launcher's, or this process's own command line."""
    given = os.environ.get(ENV_RESUME_COMMAND)
    if given:
        return given
    return shlex.join(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])


def is_peer_loss(exc: BaseException) -> bool:
    """Whether `exc` is what a collective raises when a peer process is gone: JAX's runtime
    error, or gloo's ValueError naming a closed or reset connection."""
    try:
        import jax

        if isinstance(exc, jax.errors.JaxRuntimeError):
            return True
    except ImportError:  # pragma: no cover - JAX is a dependency
        pass
    return isinstance(exc, (ValueError, RuntimeError)) and bool(_PEER_GONE.search(str(exc)))


def fail_now(message: str, status: int = 2) -> None:
    """Writes one line to stderr and ends the process at once (no orderly JAX shutdown: it
    would wait for peers that will never come)."""
    write_stderr(message)
    os._exit(status)


def write_stderr(message: str) -> None:
    """Writes one line straight to file descriptor 2: the process may be about to os._exit,
    which would drop anything still in Python's buffers."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream must not stop the message
            pass
    os.write(2, (message.rstrip("\n") + "\n").encode())


def start_watch(client: Any, process_id: int, num_processes: int, coordinator: str | None,
                heartbeat_timeout_s: float) -> LossWatch:
    """Starts this process's LossWatch (one per process)."""
    global _WATCH
    _WATCH = LossWatch(client, process_id, num_processes, coordinator, heartbeat_timeout_s)
    _WATCH.start()
    return _WATCH


def install_exit_paths(heartbeat_timeout_s: float) -> None:
    """Multi-process exits that do not wait on peers that will never come.

    An uncaught exception would otherwise run JAX's orderly shutdown, which waits (up to
    --shutdown_timeout_s) for the other processes, while they wait in a collective for this
    one. Ending the process instead lets the others see it lost. An error from a collective
    whose peer just died first gives LossWatch the time to name that peer.
    """
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        previous(exc_type, exc, tb)
        before_error_exit(exc)
        import jax

        fail_now(f"hfjax: process {jax.process_index()} stops on the error above", EXIT_ERROR)

    sys.excepthook = hook
    # atexit runs last-registered first: this stops the watch before JAX's own shutdown, so
    # peers leaving normally at the end are not reported as lost.
    atexit.register(lambda: _WATCH is not None and _WATCH.stop())


def before_error_exit(exc: BaseException) -> None:
    """For a process about to end on `exc`: when `exc` is a peer's loss seen from a
    collective, waits for LossWatch to name the peer (it then ends the process with
    EXIT_LOST_PROCESS); otherwise marks this process failed, so that the others stop at once,
    naming it."""
    watch = _WATCH
    if watch is None or not watch.is_alive():
        return
    if is_peer_loss(exc):
        watch.join(timeout=watch.lost_after_s + 2 * watch.interval_s + 5)
    watch.mark_failed()


class LossWatch(threading.Thread):
    """Ends this process, naming the lost one, when a peer stops beating (module docstring).

    Each process's watch bumps a counter of its own in the coordination service's key-value
    store (`hfjax/alive/<process id>`) every `interval_s` and reads every peer's counter in the
    same call. A peer whose counter has not moved for `lost_after_s` is reported; one whose
    value is FAILED ended on an error of its own and is reported at once.
    """

    PREFIX = "hfjax/alive/"
    DONE = "done"
    FAILED = "failed"

    def __init__(self, client: Any, process_id: int, num_processes: int,
                 coordinator: str | None, heartbeat_timeout_s: float, interval_s: float = 1.0):
        super().__init__(name="hfjax-loss-watch", daemon=True)
        self.client, self.me, self.n, self.coordinator = (client, process_id, num_processes,
                                                           coordinator)
        self.heartbeat_timeout_s, self.interval_s = heartbeat_timeout_s, interval_s
        self.lost_after_s = lost_after_s(heartbeat_timeout_s)
        self._stopping = threading.Event()

    def _set(self, value: str) -> None:
        try:
            self.client.key_value_set(f"{self.PREFIX}{self.me}", value, allow_overwrite=True)
        except Exception:  # the coordinator may be gone already; nothing waits on this
            pass

    def stop(self) -> None:
        """Stops watching and tells the peers this process is leaving on purpose (a process
        that ends its run first must not be reported lost by one still writing its outputs)."""
        self._stopping.set()
        self._set(self.DONE)

    def mark_failed(self) -> None:
        """Stops watching and tells the peers this process ends on an error of its own."""
        self._stopping.set()
        self._set(self.FAILED)

    def _fail(self, message: str, status: int = EXIT_LOST_PROCESS) -> None:
        if not self._stopping.is_set():
            fail_now(message, status)

    def run(self) -> None:
        me, n = self.me, self.n
        started = time.monotonic()
        seen: dict[int, tuple[str, float]] = {}  # peer -> (its last counter, when it moved)
        beat = 0
        while not self._stopping.is_set():
            beat += 1
            try:
                self.client.key_value_set(f"{self.PREFIX}{me}", str(beat), allow_overwrite=True)
                entries = self.client.key_value_dir_get(self.PREFIX)
            except Exception as err:
                reason = str(err).splitlines()[0] if str(err) else type(err).__name__
                self._fail(
                    f"hfjax: process {me} of {n} lost the coordinator ({describe(0)} at "
                    f"{self.coordinator}): {reason}. Stopping; resume from the last checkpoint "
                    f"with: {resume_command()}")
                return
            now = time.monotonic()
            for key, value in entries:
                peer = int(key.rsplit("/", 1)[-1])
                if seen.get(peer, (None,))[0] != value:
                    seen[peer] = (value, now)
            failed = [i for i in range(n) if i != me and seen.get(i, (None,))[0] == self.FAILED]
            if failed:
                self._fail(f"hfjax: process {me} of {n} stops: "
                           f"{', '.join(describe(i) for i in failed)} ended on an error (see its "
                           "output)", EXIT_ERROR)
                return
            lost = [i for i in range(n) if i != me and seen.get(i, (None,))[0] != self.DONE
                    and now - seen.get(i, (None, started))[1] > self.lost_after_s]
            if lost:
                self._fail(
                    f"hfjax: process {me} of {n} lost {', '.join(describe(i) for i in lost)}: "
                    f"no heartbeat from it for {self.lost_after_s:g} s (half of "
                    f"--heartbeat_timeout_s={self.heartbeat_timeout_s:g}); it was killed, ran "
                    "out of memory, hung or lost its host. Stopping; resume from the last "
                    f"checkpoint with: {resume_command()}")
                return
            self._stopping.wait(self.interval_s)
