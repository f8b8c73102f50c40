"""Simulated CPU devices and their collectives: XLA:CPU settings that must be made before JAX's
CPU backend starts (the environment's XLA_FLAGS and PJRT_NPROC)."""

from __future__ import annotations

import os
import re
from collections.abc import MutableMapping

_CPU_COLLECTIVE_FLAG = "--xla_cpu_collective_call_terminate_timeout_seconds"
CPU_COLLECTIVE_TIMEOUT_S = 600
_CPU_DEVICE_FLAG = re.compile(r"--xla_force_host_platform_device_count=(\d+)")
# XLA:CPU sizes the thread pool that runs every device's program from this variable.
_CPU_POOL_ENV = "PJRT_NPROC"


def safe_cpu_collectives(environ: MutableMapping[str, str] | None = None,
                         devices: int | None = None) -> None:
    """Prepares XLA:CPU's in-process collectives for simulated devices on few cores. Only read
    when JAX's CPU backend starts, so call it before that; settings the user made win.

    - Patience: collectives wait `CPU_COLLECTIVE_TIMEOUT_S` for every device before they abort
      the program. Simulated devices share the machine's cores, so on a loaded laptop or CI box
      one device's thread can reach an all-reduce tens of seconds after the others; XLA's
      shorter default ends such a run with a C++ abort.
    - Threads: every device's program runs on one shared pool, `max(cores, devices)` threads
      by default, and a collective holds its thread until all devices reach it. A program
      with two independent collectives (an all-gather inside a loop, an all-reduce beside it)
      can have 7 devices blocked in one and the 8th in the other: all 8 threads wait, and the
      8th device's all-reduce, queued behind them, never runs. With `devices` > 1 the pool gets
      4 threads per device (PJRT_NPROC), enough for 4 collectives in flight per device, at
      most 256 unless there are more cores or devices (a dry run of a large mesh compiles, it
      does not run). `devices` defaults to XLA_FLAGS's --xla_force_host_platform_device_count.
    """
    environ = os.environ if environ is None else environ
    flags_ = environ.get("XLA_FLAGS", "")
    if _CPU_COLLECTIVE_FLAG not in flags_:
        environ["XLA_FLAGS"] = f"{flags_} {_CPU_COLLECTIVE_FLAG}={CPU_COLLECTIVE_TIMEOUT_S}".strip()
    if not devices:
        found = _CPU_DEVICE_FLAG.findall(flags_)
        devices = int(found[-1]) if found else 1
    if devices > 1 and not environ.get(_CPU_POOL_ENV):
        environ[_CPU_POOL_ENV] = str(max(os.cpu_count() or 1, devices, min(4 * devices, 256)))


def simulate_cpu_devices(count: int, *, keep_given: bool = True,
                         environ: MutableMapping[str, str] | None = None) -> int:
    """Asks XLA:CPU for `count` simulated devices (XLA_FLAGS), unless `keep_given` and XLA_FLAGS
    already names a count, then prepares their collectives (`safe_cpu_collectives`). For
    scripts and tests that set devices before importing JAX; returns the count in effect."""
    environ = os.environ if environ is None else environ
    given = _CPU_DEVICE_FLAG.findall(environ.get("XLA_FLAGS", ""))
    if given and keep_given:
        count = int(given[-1])
    else:
        flag = f"--xla_force_host_platform_device_count={int(count)}"
        environ["XLA_FLAGS"] = f"{environ.get('XLA_FLAGS', '')} {flag}".strip()
    safe_cpu_collectives(environ, devices=count)
    return count
