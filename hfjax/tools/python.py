"""`python`: runs a snippet in a separate Python process, in a jail, within limits.

With `isolation="jail"` (the default, `rollout.multi_turn.python_isolation`) every call runs in
the OS-level jail of `hfjax.tools.jail` (bubblewrap namespaces, an unprivileged user, a seccomp
filter). What holds, on Linux, checked by tests/tools/test_python_jail.py:
- **Processes.** Its own PID namespace: the snippet sees and can signal only its own processes;
  every process it starts (a `setsid` or daemonized one too) is killed when the call ends, at
  its wall clock or when the controller kills it. RLIMIT_NPROC caps its processes and threads
  at `max_processes`, under a uid of the call's own when run as root (`jail.claim_id`).
- **Files.** The controller's files are not in its view: it sees a read-only system (/usr, the
  libraries, the Python installation, world-readable /etc files) and writes only to /scratch, a
  private tmpfs of `disk_mb`, gone with the call. RLIMIT_FSIZE caps any one file, stdout and
  stderr included, at `max_output_bytes`.
- **Network.** Its own network namespace: loopback only, nothing outside is reachable.
- **Kernel.** A seccomp filter refuses ptrace, pidfds, mounts, namespaces, keyrings, BPF, perf,
  modules, io_uring, open_by_handle_at, userfaultfd and more (`hfjax.tools.jail.DENIED`).
- **Time and memory.** Past `wall_s` the call is killed (SIGKILL to bwrap, whose namespace dies
  with it); RLIMIT_CPU caps CPU seconds, RLIMIT_AS each process's address space at
  `memory_mb`, RLIMIT_NOFILE its descriptors at `max_files`. Where the machine gives a cgroup
  per call (`hfjax.tools.cgroup`), the call's whole memory, kernel memory and its tmpfs
  included, stops at `call_memory_mb` and its processes at `max_processes` + 2; elsewhere the
  bound is the sum docs/agents.md states (address spaces, tmpfs, and one buffer per
  descriptor, the seccomp filter keeping each at its default size).
- **Output.** The text returned is cut to `max_output_chars`.

Where the jail cannot be built the tool refuses to start (ValueError naming what is missing and
the setting that accepts the risk); it never falls back silently. `isolation="none"` runs the
snippet as a plain child process (in a network namespace when `unshare --user --net` works),
in a host temporary directory: only the limits above and the audit hook stand in the way.

An audit hook (PEP 578) is installed before the snippet runs, in both modes. It is a tripwire
for honest mistakes (writing outside the working directory, starting processes, sockets,
ctypes' native calls), not a boundary: one line switches it off. In the jail nothing rests on it.

The limits are applied by the child itself, before the snippet runs, rather than in a
`preexec_fn`: the parent is a multi-threaded JAX process, where `preexec_fn` can deadlock.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile

from absl import logging

from hfjax.tools import cgroup, jail
from hfjax.tools.base import Tool, ToolError
from hfjax.tools.jail import NOBODY
from hfjax.tools.registry import register_tool

# The child's bootstrap: argv = [work_dir, memory_bytes, file_bytes, cpu_s, max_processes,
# max_files], the snippet on stdin (then stdin is /dev/null).
# It sets the limits, installs the audit hook, then runs the snippet; the last expression
# statement's value is printed as in a REPL. The child runs unbuffered (-u), so a snippet
# killed at the wall clock still shows what it printed.
_BOOTSTRAP = r'''
import ast, os, resource, sys
work, mem, fsize, cpu, nproc, nofile = sys.argv[1], *map(int, sys.argv[2:7])
src = sys.stdin.buffer.read().decode("utf-8", errors="replace")
_null = os.open(os.devnull, os.O_RDONLY)
os.dup2(_null, 0)
os.close(_null)
for lim, soft, hard in ((resource.RLIMIT_AS, mem, mem), (resource.RLIMIT_FSIZE, fsize, fsize),
                        (resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_CORE, 0, 0),
                        (resource.RLIMIT_NPROC, nproc, nproc),
                        (resource.RLIMIT_NOFILE, nofile, nofile),
                        (resource.RLIMIT_MSGQUEUE, 0, 0), (resource.RLIMIT_SIGPENDING, 64, 64)):
    # CPU: SIGXCPU at the soft limit (a clear message), SIGKILL a second later regardless.
    resource.setrlimit(lim, (soft, hard))
os.chdir(work)
_real = os.path.realpath
_inside = work + os.sep
def _ok(path):
    if isinstance(path, int):
        return True
    try:
        p = _real(os.fsdecode(path))
    except Exception:
        return False
    return p == work or p.startswith(_inside) or p == "/dev/null"
_PATH_EVENTS = {"os.remove": 1, "os.rmdir": 1, "os.mkdir": 1, "os.rename": 2, "os.link": 2,
                "os.symlink": 2, "os.truncate": 1, "os.chmod": 1, "os.chown": 1, "os.utime": 1,
                "shutil.rmtree": 1, "shutil.move": 2, "shutil.copyfile": 2}
# ctypes may be imported (sympy does), but not used to reach native code: no library loaded
# by name, no symbol looked up, no foreign call, no raw memory read or written.
_BLOCKED = ("socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo",
            "socket.gethostbyname", "socket.gethostbyaddr",
            "os.system", "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn",
            "subprocess.Popen", "os.kill", "os.killpg", "ctypes.dlsym", "ctypes.dlsym/handle",
            "ctypes.call_function", "ctypes.cdata", "ctypes.cdata/buffer", "ctypes.string_at",
            "ctypes.wstring_at")
def _hook(event, args):
    if event == "open":
        path, mode, flags = args
        writes = (mode is not None and any(c in mode for c in "wax+")) or (
            mode is None and isinstance(flags, int)
            and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND))
        if writes and not _ok(path):
            raise PermissionError(f"sandbox: writing {path!r} outside the working directory "
                                  "is not allowed")
    elif event in _PATH_EVENTS:
        for path in args[:_PATH_EVENTS[event]]:
            if not _ok(path):
                raise PermissionError(f"sandbox: {event} on {path!r} outside the working "
                                      "directory is not allowed")
    elif event in _BLOCKED or (event == "ctypes.dlopen" and args[0] is not None):
        raise PermissionError(f"sandbox: {event} is not allowed")
sys.addaudithook(_hook)
try:
    tree = ast.parse(src, "<snippet>", "exec")
except (SyntaxError, ValueError) as err:
    import traceback
    sys.stderr.write("".join(traceback.format_exception_only(err)))
    sys.exit(1)
if tree.body and isinstance(tree.body[-1], ast.Expr):
    last = ast.Expression(tree.body.pop().value)
    code, tail = compile(tree, "<snippet>", "exec"), compile(last, "<snippet>", "eval")
else:
    code, tail = compile(tree, "<snippet>", "exec"), None
env = {"__name__": "__main__", "__builtins__": __builtins__}
del ast, resource, src, tree
exec(code, env)
if tail is not None:
    _value = eval(tail, env)
    if _value is not None:
        print(repr(_value))
'''


_SIGNALS = {int(s) for s in signal.Signals}


@functools.cache
def network_namespace_available() -> bool:
    """Whether `unshare --user --net` can run a process here (checked once per process)."""
    exe = shutil.which("unshare")
    if exe is None:
        return False
    try:
        done = subprocess.run([exe, "--user", "--net", "--", "true"], capture_output=True,
                              timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


ISOLATIONS = ("jail", "none")
ISOLATION_KEY = "rollout.multi_turn.python_isolation"


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _head(f, limit: int) -> str:
    """The first `limit` bytes of `f` as text, with a note of how many more there were."""
    size = f.seek(0, os.SEEK_END)
    f.seek(0)
    text = f.read(limit).decode("utf-8", errors="replace")
    return text + (f"\n[output truncated: {size - limit} more bytes]" if size > limit else "")


def _error_tail(f, limit: int) -> str:
    """The end of stderr (where a traceback's error is), without the bootstrap's frames."""
    f.seek(0)
    text = f.read().decode("utf-8", errors="replace")
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith('File "<string>"')]
    text = "\n".join(lines)
    return text if len(text) <= limit else "[...]\n" + text[-limit:]


@register_tool
class Python(Tool):
    """Runs a Python snippet in a separate, jailed and limited process (see the module
    docstring)."""

    name = "python"
    description = ("Run a Python 3 snippet in a fresh process and return what it prints "
                   "(the value of a final expression is printed too). No network; files only "
                   "in the working directory, deleted afterwards.")
    parameters = {
        "type": "object",
        "properties": {
            "code": {"type": "string", "description": "the Python source to run"},
        },
        "required": ["code"],
    }

    def __init__(self, wall_s: float = 5.0, memory_mb: int = 512, cpu_s: int = 10,
                 max_output_bytes: int = 64 * 1024, max_output_chars: int = 4000,
                 max_code_chars: int = 20_000, isolation: str = "jail",
                 max_processes: int = 16, disk_mb: int = 64, max_files: int = 64,
                 call_memory_mb: int = 1024, network_namespace: bool | None = None):
        if wall_s <= 0 or memory_mb < 64 or cpu_s < 1 or max_output_bytes < 1:
            raise ValueError(
                f"python tool: wall_s={wall_s} must be > 0, memory_mb={memory_mb} >= 64 (the "
                f"interpreter needs about that), cpu_s={cpu_s} >= 1 and max_output_bytes="
                f"{max_output_bytes} >= 1")
        if isolation not in ISOLATIONS:
            raise ValueError(f"python tool: isolation={isolation!r}; use one of "
                             f"{', '.join(ISOLATIONS)} (--config.{ISOLATION_KEY})")
        if max_processes < 2 or disk_mb < 1:
            raise ValueError(f"python tool: max_processes={max_processes} must be >= 2 (the "
                             f"jail's init and the interpreter) and disk_mb={disk_mb} >= 1")
        if max_files < 16 or call_memory_mb < 64:
            raise ValueError(f"python tool: max_files={max_files} must be >= 16 (the "
                             f"interpreter's own descriptors) and call_memory_mb={call_memory_mb} "
                             ">= 64 (one interpreter)")
        if isolation == "jail":
            try:
                jail.probe()
            except jail.JailUnavailable as err:
                raise ValueError(
                    f"python tool: the jail cannot start on this machine: {err}; to run the "
                    f"policy's code without it, accepting the risk, set "
                    f"--config.{ISOLATION_KEY}=none") from None
        self.isolation = isolation
        self.wall_s = wall_s
        self.memory_mb = memory_mb
        self.cpu_s = cpu_s
        self.max_output_bytes = max_output_bytes
        self.max_output_chars = max_output_chars
        self.max_code_chars = max_code_chars
        self.max_processes = max_processes
        self.disk_mb = disk_mb
        self.max_files = max_files
        self.call_memory_mb = call_memory_mb
        self.network_namespace = isolation == "jail" or (
            network_namespace_available() if network_namespace is None else network_namespace)
        # The runner's bound: the snippet's wall clock plus time to start and clean up.
        self.timeout_s = wall_s + 10.0

    def call(self, arguments: dict) -> str:
        code = arguments["code"]
        if not isinstance(code, str):
            raise ToolError("code must be a string")
        if len(code) > self.max_code_chars:
            raise ToolError(f"the code is longer than {self.max_code_chars} characters")
        uid, lock = NOBODY, None
        group = None
        try:
            if self.isolation == "jail":
                try:
                    uid, lock = jail.claim_id(timeout_s=self.wall_s)
                except jail.JailBusy as err:
                    raise ToolError(f"{err}; try again later") from None
            parents = cgroup.find()
            if parents is not None:
                try:
                    # The jail's bwrap and namespace init besides the uid's max_processes.
                    group = cgroup.CallGroup(parents, self.call_memory_mb << 20,
                                             self.max_processes + 2)
                except OSError as err:
                    raise ToolError(f"the call's cgroup could not be made ({err})") from None
            rc, timed_out, stdout, stderr = self._run(code, uid, group)
            oom = group is not None and group.oom_killed()
        finally:
            if group is not None:
                group.close()
            if lock is not None:
                os.close(lock)  # the namespace is gone: the uid is free for another call
        if oom and not timed_out:
            raise ToolError(f"the code's processes used more than {self.call_memory_mb} MB of "
                            "memory in all (kernel memory included) and were killed"
                            + (f"; output so far:\n{stdout}" if stdout else ""))
        return self._report(rc, timed_out, stdout, stderr)

    def _run(self, code: str, uid: int, group) -> tuple[int, bool, str, str]:
        """(exit status, timed out, stdout, stderr) of the snippet, run as `uid` in the jail
        (or plainly), inside `group` when given."""
        wrap = group.wrap if group is not None else list
        with tempfile.TemporaryFile() as src, tempfile.TemporaryFile() as out, \
                tempfile.TemporaryFile() as err:
            src.write(code.encode("utf-8", errors="replace"))
            src.seek(0)
            if self.isolation == "jail":
                info_r, info_w = os.pipe()
                try:
                    with jail.seccomp_file() as filt:
                        argv = jail.command(self._argv(jail.MOUNT), seccomp_fd=filt.fileno(),
                                            disk_bytes=self.disk_mb << 20, info_fd=info_w,
                                            uid=uid)
                        rc, timed_out = self._wait(wrap(argv), src, out, err, "/",
                                                   (filt.fileno(), info_w), info_w)
                    # Nothing the call started outlives it.
                    if not jail.wait_namespace_gone(info_r):
                        logging.warning("python tool: the jail's namespace was still "
                                        "ending 5 s after the call")
                finally:
                    os.close(info_r)
                # bwrap reports a child killed by signal N as exit status 128 + N.
                if rc > 128 and rc - 128 in _SIGNALS:
                    rc = 128 - rc
            else:
                root = tempfile.mkdtemp(prefix="hfjax_python_tool_")
                try:
                    work = os.path.join(root, "work")
                    os.mkdir(work)
                    argv = self._argv(work)
                    if self.network_namespace:
                        argv = [shutil.which("unshare") or "unshare", "--user", "--net",
                                "--"] + argv
                    rc, timed_out = self._wait(wrap(argv), src, out, err, work, ())
                finally:
                    shutil.rmtree(root, ignore_errors=True)
            return (rc, timed_out, _head(out, self.max_output_chars),
                    _error_tail(err, self.max_output_chars))

    def _argv(self, work: str) -> list[str]:
        return [sys.executable, "-I", "-u", "-c", _BOOTSTRAP, work,
                str(self.memory_mb * 1024 * 1024), str(self.max_output_bytes), str(self.cpu_s),
                str(self.max_processes), str(self.max_files)]

    def _wait(self, argv, src, out, err, cwd, fds, info_w=None) -> tuple[int, bool]:
        work = cwd if self.isolation == "none" else jail.MOUNT
        # One thread per numeric library (their pools reserve address space per thread, which
        # RLIMIT_AS counts), and no accelerator for a snippet that imports an ML framework.
        env = {"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8",
               "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
               "JAX_PLATFORMS": "cpu"}
        # In the jail bwrap stays in the caller's process group, so a runner that kills its
        # worker's group takes bwrap, and with it the namespace, along; outside the jail the
        # snippet gets a session of its own, killed whole below.
        jailed = self.isolation == "jail"
        try:
            proc = subprocess.Popen(argv, stdin=src, stdout=out, stderr=err, cwd=cwd, env=env,
                                    start_new_session=not jailed, pass_fds=fds)
        finally:
            if info_w is not None:
                os.close(info_w)  # bwrap holds the write end: EOF once it has exited
        try:
            proc.wait(timeout=self.wall_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            if jailed:
                # SIGKILL to the namespace's init (bwrap's child) first: the kernel kills
                # every process of the namespace, and bwrap exits only once they are gone, so
                # nothing of the call outlives it. Killing bwrap alone would leave that to
                # its child's parent-death signal, after this call returned.
                for pid in _children(proc.pid):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            try:
                if jailed:
                    proc.kill()
                else:
                    os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            rc = proc.wait()
        return rc, timed_out

    def _report(self, rc: int, timed_out: bool, stdout: str, stderr: str) -> str:
        if timed_out:
            logging.info("python tool: snippet killed after %s s", self.wall_s)
            raise ToolError(f"the code ran longer than {self.wall_s:g} s and was stopped"
                            + (f"; output so far:\n{stdout}" if stdout else ""))
        if rc == -signal.SIGXFSZ:
            raise ToolError(f"the output (or a file written) exceeded {self.max_output_bytes} "
                            f"bytes and the code was stopped; output so far:\n{stdout}")
        if rc == -signal.SIGXCPU:
            raise ToolError(f"the code used more than {self.cpu_s} s of CPU and was stopped")
        if rc == -signal.SIGKILL:
            raise ToolError(f"the code was killed (SIGKILL: past its {self.cpu_s} s of CPU, or "
                            "the machine ran out of memory)")
        if rc != 0:
            how = (f"killed by {signal.Signals(-rc).name}" if rc < 0 and -rc in _SIGNALS
                   else f"exit status {rc}")
            detail = stderr.strip() or how
            raise ToolError(f"the code failed:\n{detail}"
                            + (f"\noutput before the failure:\n{stdout}" if stdout else ""))
        return stdout if not stderr else f"{stdout}\n[stderr]\n{stderr}"
