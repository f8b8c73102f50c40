"""`python`: runs a snippet in a separate Python process, within limits.

What holds (Linux; docs/agents.md says the same):
- **Wall clock.** The process runs in its own session; past `wall_s` the whole process group is
  killed (SIGKILL), and the policy is told it timed out.
- **Memory.** RLIMIT_AS caps the address space at `memory_mb`; an allocation past it raises
  MemoryError in the snippet (or kills it), reported as an error.
- **CPU and files.** RLIMIT_CPU caps CPU seconds; RLIMIT_FSIZE caps any file the process writes,
  its captured stdout and stderr included, at `max_output_bytes`.
- **Output.** stdout and stderr go to files of bounded size (above), and the text returned is cut
  to `max_output_chars`.
- **Network.** When `unshare --user --net` works on this machine (checked once), the process runs
  in a new network namespace with no interfaces but loopback: nothing outside is reachable,
  whatever the code does. Where it does not work, only the audit hook below stands in the way.
- **Files, processes, sockets: an audit hook** (PEP 578), installed before the snippet runs,
  refuses: opening a file for writing outside the temporary directory, deleting, renaming or
  creating anything outside it, creating a socket or resolving a name, starting a process
  (fork, exec, subprocess, os.system), sending signals, and using ctypes to reach native code
  (loading a library by name, looking up a symbol, a foreign call, reading memory at an
  address; importing ctypes is allowed, as sympy does it). The snippet runs with `python -I`
  (no user site, no PYTHON* variables), in a fresh temporary directory that is deleted
  afterwards, with a minimal environment.

What does not hold: the audit hook is a tripwire for honest mistakes and naive attempts, not a
security boundary. Reading files is not restricted beyond the OS's permissions, and code that
escapes the interpreter's checks (ctypes' ready-made memmove and memset, a C extension already
installed) is not contained. Run untrusted policies' code in a container or VM as well.

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

from hfjax.tools.base import Tool, ToolError
from hfjax.tools.registry import register_tool

# The child's bootstrap: argv = [work_dir, snippet_path, memory_bytes, file_bytes, cpu_s].
# It sets the limits, installs the audit hook, then runs the snippet; the last expression
# statement's value is printed as in a REPL. The child runs unbuffered (-u), so a snippet
# killed at the wall clock still shows what it printed.
_BOOTSTRAP = r'''
import ast, os, resource, sys
work, snippet_path, mem, fsize, cpu = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
src = open(snippet_path, encoding="utf-8").read()
for lim, soft, hard in ((resource.RLIMIT_AS, mem, mem), (resource.RLIMIT_FSIZE, fsize, fsize),
                        (resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_CORE, 0, 0)):
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
del ast, resource, src, tree, snippet_path
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


def _head(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    text = data[:limit].decode("utf-8", errors="replace")
    return text + ("\n[output truncated]" if len(data) > limit else "")


def _error_tail(path: str, limit: int) -> str:
    """The end of stderr (where a traceback's error is), without the bootstrap's frames."""
    with open(path, "rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith('File "<string>"')]
    text = "\n".join(lines)
    return text if len(text) <= limit else "[...]\n" + text[-limit:]


@register_tool
class Python(Tool):
    """Runs a Python snippet in a separate, limited process (see the module docstring)."""

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
                 max_code_chars: int = 20_000, network_namespace: bool | None = None):
        if wall_s <= 0 or memory_mb < 64 or cpu_s < 1 or max_output_bytes < 1:
            raise ValueError(
                f"python tool: wall_s={wall_s} must be > 0, memory_mb={memory_mb} >= 64 (the "
                f"interpreter needs about that), cpu_s={cpu_s} >= 1 and max_output_bytes="
                f"{max_output_bytes} >= 1")
        self.wall_s = wall_s
        self.memory_mb = memory_mb
        self.cpu_s = cpu_s
        self.max_output_bytes = max_output_bytes
        self.max_output_chars = max_output_chars
        self.max_code_chars = max_code_chars
        self.network_namespace = (network_namespace_available() if network_namespace is None
                                  else network_namespace)
        # The runner's bound: the snippet's wall clock plus time to start and clean up.
        self.timeout_s = wall_s + 10.0

    def call(self, arguments: dict) -> str:
        code = arguments["code"]
        if not isinstance(code, str):
            raise ToolError("code must be a string")
        if len(code) > self.max_code_chars:
            raise ToolError(f"the code is longer than {self.max_code_chars} characters")
        root = tempfile.mkdtemp(prefix="hfjax_python_tool_")
        try:
            return self._run(code, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def _run(self, code: str, root: str) -> str:
        work = os.path.join(root, "work")
        os.mkdir(work)
        snippet = os.path.join(root, "snippet.py")
        with open(snippet, "w", encoding="utf-8") as f:
            f.write(code)
        argv = [sys.executable, "-I", "-u", "-c", _BOOTSTRAP, work, snippet,
                str(self.memory_mb * 1024 * 1024), str(self.max_output_bytes), str(self.cpu_s)]
        if self.network_namespace:
            argv = [shutil.which("unshare") or "unshare", "--user", "--net", "--"] + argv
        # One thread per numeric library (their pools reserve address space per thread, which
        # RLIMIT_AS counts), and no accelerator for a snippet that imports an ML framework.
        env = {"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8",
               "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
               "JAX_PLATFORMS": "cpu"}
        out_path, err_path = os.path.join(root, "stdout"), os.path.join(root, "stderr")
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    cwd=work, env=env, start_new_session=True)
            try:
                rc = proc.wait(timeout=self.wall_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                # The whole group: the snippet cannot start processes, but kill them anyway.
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                rc = proc.wait()
        stdout = _head(out_path, self.max_output_chars)
        stderr = _error_tail(err_path, self.max_output_chars)
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
