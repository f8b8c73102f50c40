"""One memory and pids cgroup per python-tool call, where this machine lets this process make
them: the bound on a call's *total* memory (its processes' pages, its tmpfs, and the kernel
memory charged to it: socket buffers, pipes, page tables, kernel stacks) and on its processes.

How one is found (`find()`, once per process):
- **cgroup v2**: the directory `HFJAX_JAIL_CGROUP` names, else this process's own cgroup (the
  `0::` line of /proc/self/cgroup under the cgroup2 mount of /proc/self/mountinfo). It is used
  when it is writable and its `cgroup.subtree_control` enables `memory` and `pids`: a delegated
  subtree (systemd's `Delegate=yes`, a container's own root). A v2 cgroup holding processes
  cannot enable controllers for its children, so a delegated one is named with the variable.
- **cgroup v1**: the `memory` and `pids` hierarchies' directories of this process, when both are
  mounted and writable (root in a VM or a privileged container).
- Else none, and `why_not()` says why: a call is then bounded by its rlimits and the jail's
  seccomp filter alone (docs/agents.md states both bounds).

Each call's group is a child named `hfjax-call-<pid>-<n>` with `memory.max` (v1:
`memory.limit_in_bytes`), no swap, and `pids.max`; the jail's first process joins it before it
starts anything (`CallGroup.wrap`), so everything the call starts is inside.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import time

ENV = "HFJAX_JAIL_CGROUP"
PREFIX = "hfjax-call-"
_COUNTER = itertools.count()


@dataclasses.dataclass(frozen=True)
class Parents:
    """Where call groups are made: `memory` and `pids` parent directories (one on v2)."""

    version: int
    memory: str
    pids: str


def _own_paths() -> dict[str, str]:
    """controller (or "" for v2) -> this process's cgroup path, from /proc/self/cgroup."""
    paths = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                paths[c] = path
    return paths


def _mounts() -> dict[str, str]:
    """"cgroup2" -> its mount point, and each v1 controller -> its hierarchy's mount point."""
    found: dict[str, str] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fstype, _, options = (right.split() + ["", "", ""])[:3]
            point = left.split()[4]
            if fstype == "cgroup2":
                found.setdefault("cgroup2", point)
            elif fstype == "cgroup":
                for opt in options.split(","):
                    found.setdefault(opt, point)
    return found


def _usable_v2(path: str) -> bool:
    try:
        with open(os.path.join(path, "cgroup.subtree_control")) as f:
            enabled = f.read().split()
    except OSError:
        return False
    return {"memory", "pids"} <= set(enabled) and os.access(path, os.W_OK)


@functools.cache
def _find() -> tuple[Parents | None, str]:
    if not os.path.exists("/proc/self/cgroup"):
        return None, "no /proc/self/cgroup (not Linux)"
    named = os.environ.get(ENV)
    if named:
        if _usable_v2(named):
            return Parents(2, named, named), ""
        return None, (f"{ENV}={named} is not a writable cgroup v2 directory whose "
                      "cgroup.subtree_control enables memory and pids")
    try:
        paths, mounts = _own_paths(), _mounts()
    except OSError as err:
        return None, f"cannot read this process's cgroups: {err}"
    if "cgroup2" in mounts and "" in paths:
        own = os.path.join(mounts["cgroup2"], paths[""].lstrip("/"))
        if _usable_v2(own):
            return Parents(2, own, own), ""
    if "memory" in mounts and "pids" in mounts and "memory" in paths and "pids" in paths:
        memory = os.path.join(mounts["memory"], paths["memory"].lstrip("/"))
        pids = os.path.join(mounts["pids"], paths["pids"].lstrip("/"))
        if all(os.access(d, os.W_OK) for d in (memory, pids)):
            return Parents(1, memory, pids), ""
        return None, f"cgroup v1 memory and pids directories ({memory}, {pids}) are not writable"
    return None, ("no delegated cgroup v2 subtree with memory and pids (set " + ENV +
                  " to one) and no writable cgroup v1 memory and pids hierarchies")


def find() -> Parents | None:
    """Where this process makes call groups, or None (see the module docstring)."""
    parents = _find()[0]
    if parents is not None:
        _sweep(parents)
    return parents


def why_not() -> str:
    """Why `find()` is None ("" when it is not)."""
    return _find()[1]


@functools.cache
def _sweep(parents: Parents) -> None:
    """Removes call groups left by processes that died mid-call (empty ones only: rmdir
    refuses a group with processes)."""
    for parent in {parents.memory, parents.pids}:
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for name in names:
            if not name.startswith(PREFIX):
                continue
            try:
                pid = int(name[len(PREFIX):].split("-")[0])
                os.kill(pid, 0)
                continue  # its process lives: its group may be in use
            except (ValueError, ProcessLookupError):
                pass
            except PermissionError:
                continue
            try:
                os.rmdir(os.path.join(parent, name))
            except OSError:
                pass


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read_key(path: str, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                k, _, v = line.partition(" ")
                if k == key:
                    return int(v)
    except (OSError, ValueError):
        pass
    return 0


class CallGroup:
    """One call's memory and pids group: made by the constructor (OSError when the kernel
    refuses), joined by the command `wrap` returns, removed by `close()` once the call's
    processes are gone."""

    def __init__(self, parents: Parents, memory_bytes: int, max_pids: int):
        self.parents = parents
        name = f"{PREFIX}{os.getpid()}-{next(_COUNTER)}"
        self.dirs = [os.path.join(parents.memory, name)]
        if parents.pids != parents.memory:
            self.dirs.append(os.path.join(parents.pids, name))
        made = []
        try:
            for d in self.dirs:
                os.mkdir(d, 0o700)
                made.append(d)
            mem, pids = self.dirs[0], self.dirs[-1]
            if parents.version == 2:
                _write(f"{mem}/memory.max", str(memory_bytes))
                if os.path.exists(f"{mem}/memory.swap.max"):
                    _write(f"{mem}/memory.swap.max", "0")
            else:
                _write(f"{mem}/memory.limit_in_bytes", str(memory_bytes))
                if os.path.exists(f"{mem}/memory.memsw.limit_in_bytes"):
                    _write(f"{mem}/memory.memsw.limit_in_bytes", str(memory_bytes))
                if os.path.exists(f"{mem}/memory.kmem.tcp.limit_in_bytes"):
                    # v1 charges TCP buffers only once this limit is set
                    _write(f"{mem}/memory.kmem.tcp.limit_in_bytes", str(memory_bytes))
            _write(f"{pids}/pids.max", str(max_pids))
        except OSError:
            for d in reversed(made):
                try:
                    os.rmdir(d)
                except OSError:
                    pass
            raise
        self.memory_bytes = memory_bytes

    def wrap(self, argv: list[str]) -> list[str]:
        """`argv`, started by a shell that first moves itself into the group (so whatever it
        execs and starts is inside from its first instruction)."""
        joins = " && ".join(f'echo $$ > "${i + 1}"' for i in range(len(self.dirs)))
        procs = [os.path.join(d, "cgroup.procs") for d in self.dirs]
        return (["/bin/sh", "-c", f'{joins} && shift {len(procs)} && exec "$@"', "sh"]
                + procs + list(argv))

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the group for its memory limit."""
        mem = self.dirs[0]
        name = "memory.events" if self.parents.version == 2 else "memory.oom_control"
        return _read_key(os.path.join(mem, name), "oom_kill") > 0

    def peak(self) -> int:
        """The group's largest memory use so far, in bytes (0 where the kernel keeps none)."""
        name = "memory.peak" if self.parents.version == 2 else "memory.max_usage_in_bytes"
        try:
            with open(os.path.join(self.dirs[0], name)) as f:
                return int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            return 0

    def close(self, timeout_s: float = 5.0) -> None:
        """Removes the group, waiting up to `timeout_s` for its last processes to be reaped."""
        deadline = time.monotonic() + timeout_s
        for d in self.dirs:
            while True:
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        break  # left for `_sweep` of a later process
                    time.sleep(0.01)
