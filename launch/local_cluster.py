"""Runs one job as several processes on this machine, joined by jax.distributed over 127.0.0.1.

    python -m launch.local_cluster --num_processes=2 --devices_per_process=4 -- \\
        --config.actor.mesh=fsdp=4,tensor=2
    python -m launch.local_cluster --num_processes=2 --module=launch.generate -- --prompt=Hi
    python -m launch.local_cluster --num_processes=2 --script=path/to/job.py -- --its_flag=1

Everything after `--` goes to every process: launch.train's arguments by default, or those of
`--module` / `--script`. Each process gets the coordinator (a free port on 127.0.0.1), the
process count, its number and its CPU device count through the environment
(hfjax.parallel.distributed reads HFJAX_COORDINATOR_ADDRESS, HFJAX_NUM_PROCESSES,
HFJAX_PROCESS_ID and HFJAX_CPU_DEVICES), so the job's own command line stays the same as on a
real cluster. Processes run on CPU: this simulates hosts, it does not share out accelerators.

Each output line is prefixed with the process number, e.g. `[1] ...`. When a process exits
with an error, the others get --stop_grace_s to notice and exit by themselves (they name the
lost process), then are terminated. SIGTERM or Ctrl-C is passed on to every process (launch.train
then checkpoints and stops). The exit status is the worst one: the largest, with a process
ended by signal N counted as 128+N; processes the launcher had to terminate do not count, so
the status is that of the failure, not of the clean-up.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import app, flags

from hfjax.parallel import distributed as dist
from hfjax.parallel import lost_process

_NUM = flags.DEFINE_integer("num_processes", 2, "processes to start", lower_bound=1)
_DEVICES = flags.DEFINE_integer("devices_per_process", 4,
                                "simulated CPU devices per process (0: leave XLA's default)",
                                lower_bound=0)
_MODULE = flags.DEFINE_string("module", "launch.train", "module each process runs (python -m)")
_SCRIPT = flags.DEFINE_string("script", None, "a Python file each process runs instead of "
                              "--module")
_PORT = flags.DEFINE_integer("port", 0, "coordinator port on 127.0.0.1 (0: a free one)",
                             lower_bound=0, upper_bound=65535)
_GRACE = flags.DEFINE_float("stop_grace_s", 90.0,
                            "after a process fails, seconds the others get to exit by "
                            "themselves before they are terminated")


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (the coordinator binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_status(returncode: int) -> int:
    """A Popen return code as a shell reports it: killed by signal N -> 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def describe_status(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name} ({exit_status(returncode)})"
    return f"exit status {returncode}"


class LocalCluster:
    """The processes of one local run, their prefixed output and their exit statuses."""

    def __init__(self, command: list[str], num_processes: int, devices_per_process: int,
                 port: int = 0, out=None):
        self.command, self.n = command, num_processes
        self.devices, self.port = devices_per_process, port or free_port()
        self.out = out or sys.stdout
        self.procs: list[subprocess.Popen] = []
        self.stopped: set[int] = set()  # ranks the launcher terminated after another failed
        self._lock = threading.Lock()
        self._pumps: list[threading.Thread] = []

    def env(self, rank: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            dist.ENV_COORDINATOR: f"127.0.0.1:{self.port}",
            dist.ENV_NUM_PROCESSES: str(self.n),
            dist.ENV_PROCESS_ID: str(rank),
            dist.ENV_LAUNCHER: "launch.local_cluster",
            # A lost process's survivors name the command that resumes the whole job: this one.
            lost_process.ENV_RESUME_COMMAND: shlex.join(
                getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv]),
            "JAX_PLATFORMS": "cpu",
            "PYTHONUNBUFFERED": "1",
        })
        if self.devices:
            env[dist.ENV_CPU_DEVICES] = str(self.devices)
        else:
            env.pop(dist.ENV_CPU_DEVICES, None)
        return env

    def say(self, line: str) -> None:
        with self._lock:
            self.out.write(f"[local_cluster] {line}\n")
            self.out.flush()

    def start(self) -> None:
        self.say(f"{self.n} processes x {self.devices or 'default'} CPU devices, coordinator "
                 f"127.0.0.1:{self.port}: {' '.join(self.command)}")
        for rank in range(self.n):
            # A session of its own: a terminal's Ctrl-C reaches the launcher only, which passes
            # it on, and stopping a process can take its whole group (its helper processes).
            proc = subprocess.Popen(self.command, env=self.env(rank), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            self.procs.append(proc)
            pump = threading.Thread(target=self._pump, args=(rank, proc), daemon=True)
            pump.start()
            self._pumps.append(pump)

    def _pump(self, rank: int, proc: subprocess.Popen) -> None:
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            with self._lock:
                self.out.write(f"[{rank}] {line}\n")
                self.out.flush()

    def signal_all(self, sig: int) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass

    def wait(self, grace_s: float, poll_s: float = 0.1) -> int:
        """Waits for every process; returns the worst exit status (see the module doc)."""
        deadline = None
        term_at = None
        reported: set[int] = set()
        while any(p.poll() is None for p in self.procs):
            now = time.monotonic()
            for rank, proc in enumerate(self.procs):
                code = proc.poll()
                if code not in (None, 0) and rank not in reported:
                    reported.add(rank)
                    if deadline is None:
                        deadline = now + grace_s
                        self.say(f"process {rank} failed ({describe_status(code)}); the others "
                                 f"get {grace_s:g} s to stop by themselves")
            if deadline is not None and now >= deadline and term_at is None:
                self.stopped = {r for r, p in enumerate(self.procs) if p.poll() is None}
                self.say(f"stopping process(es) {sorted(self.stopped)} (SIGTERM)")
                self.signal_all(signal.SIGTERM)
                term_at = now
            if term_at is not None and now >= term_at + 5:
                self.say("stopping the remaining processes (SIGKILL)")
                self.signal_all(signal.SIGKILL)
                term_at = float("inf")
            time.sleep(poll_s)
        for pump in self._pumps:
            pump.join(timeout=5)
        codes = [p.returncode for p in self.procs]
        self.say("exit: " + ", ".join(
            f"process {r} {describe_status(c)}{' (stopped here)' if r in self.stopped else ''}"
            for r, c in enumerate(codes)))
        return max(exit_status(c) for r, c in enumerate(codes) if r not in self.stopped)


def main(argv: list[str]) -> int:
    args = argv[1:]
    from hfjax.config import ConfigError
    from launch import cli

    try:  # its flags' rows (hfjax.config.flags), as every entry point's
        cli.check_entry_flags("local_cluster")
    except ConfigError as err:
        raise app.UsageError(str(err)) from None
    if _SCRIPT.value:
        command = [sys.executable, "-u", _SCRIPT.value, *args]
    else:
        command = [sys.executable, "-u", "-m", _MODULE.value, *args]
    cluster = LocalCluster(command, _NUM.value, _DEVICES.value, _PORT.value)

    def forward(signum, frame):
        del frame
        cluster.say(f"{signal.Signals(signum).name}: passing SIGTERM on to every process")
        cluster.signal_all(signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    cluster.start()
    return cluster.wait(_GRACE.value)


if __name__ == "__main__":
    app.run(main)
