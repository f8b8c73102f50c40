"""A python-tool call's memory and processes, attacked through the tool and its runner: what
one call can hold in kernel buffers stays under the bound docs/agents.md states (descriptors x
one buffer each), the call's total memory under `call_memory_mb` where a cgroup is made per
call, and one call's fork bomb leaves seven concurrent calls their own process budget."""

import json
import textwrap

import pytest

from hfjax.tools import ToolCall, ToolError, ToolRunner, cgroup, jail
from hfjax.tools.python import Python

try:
    jail.probe()
    _WHY_NOT = ""
except jail.JailUnavailable as _err:
    _WHY_NOT = str(_err)
needs_jail = pytest.mark.skipif(bool(_WHY_NOT), reason=f"no jail on this machine: {_WHY_NOT}")
needs_cgroup = pytest.mark.skipif(cgroup.find() is None,
                                  reason=f"no per-call cgroup here: {cgroup.why_not()}")

OFF = ("import sys\nsys.modules['__main__']._BLOCKED = ()\n"
       "sys.modules['__main__']._PATH_EVENTS = {}\n"
       "sys.modules['__main__']._ok = lambda path: True\n")
MAX_FILES = 64
# docs/agents.md: one open or in-flight descriptor holds at most one socket's buffer (the
# default send buffer, 208 KiB, plus a message) or one pipe's (64 KiB).
PER_DESCRIPTOR = 256 << 10

# Fills socket pairs (both ways) and pipes until the kernel refuses, passing descriptors in
# flight (SCM_RIGHTS) to make room, and tries to raise the buffers; at most 4x MAX_FILES pairs,
# so that the unbounded old behaviour shows without taking the host's memory.
HOLD = f"""
import array, fcntl, json, os, socket, threading, time
def fill(sock):
    n = 0
    sock.setblocking(False)
    for size in (65536, 512):
        try:
            while True:
                n += sock.send(b"x" * size)
        except OSError:
            pass
    return n
held = {{"sock": 0, "pipe": 0, "inflight": 0, "open": 0, "raised": 0, "threads": 0}}
keep = [socket.socketpair()]
carrier = keep[0][0]
for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):  # raised on one socket, never filled
    try:
        keep[0][1].setsockopt(socket.SOL_SOCKET, opt, 1 << 22)
        held["raised"] += 1
    except OSError:
        pass
try:
    for _ in range(4 * {MAX_FILES}):
        a, b = socket.socketpair()
        keep.append((a, b))
        held["sock"] += fill(a) + fill(b)
except OSError:
    pass
try:
    for a, b in keep[1:]:
        fds = array.array("i", [a.fileno(), b.fileno()])
        carrier.sendmsg([b"f"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        a.detach(), b.detach()
        os.close(fds[0]), os.close(fds[1])
        held["inflight"] += 2
except OSError:
    pass
try:
    for _ in range(4 * {MAX_FILES}):
        r, w = os.pipe()
        keep.append((r, w))
        os.set_blocking(w, False)
        try:
            while True:
                held["pipe"] += os.write(w, b"x" * 4096)
        except BlockingIOError:
            pass
except OSError:
    pass
try:
    fcntl.fcntl(os.pipe()[1], 1031, 1 << 20)  # F_SETPIPE_SZ, on a pipe never filled
    held["raised"] += 1
except OSError:
    pass
for fd in range(4 * {MAX_FILES} * 4):
    try:
        os.fstat(fd)
        held["open"] += 1
    except OSError:
        pass
stop = threading.Event()
try:
    for _ in range(200):
        threading.Thread(target=stop.wait).start()
        held["threads"] += 1
except RuntimeError:
    pass
stop.set()
print(json.dumps(held))
"""


@pytest.fixture(scope="module")
def py():
    if _WHY_NOT:
        pytest.skip(f"no jail on this machine: {_WHY_NOT}")
    return Python(wall_s=20.0, memory_mb=256, max_processes=8, max_files=MAX_FILES,
                  disk_mb=256, call_memory_mb=96)


def run(py, code: str) -> str:
    try:
        return py.call({"code": OFF + textwrap.dedent(code)})
    except ToolError as err:
        return f"ToolError: {err}"


@needs_jail
def test_kernel_buffers_of_one_process_stay_under_the_stated_bound(py):
    """The red team held 768 MiB in 3,454 socket pairs with memory_mb=64: descriptors were
    only capped at the inherited 20,000, and buffers could be raised to wmem_max. Now: at most
    max_files descriptors open and max_files in flight, none of them raised, so the process's
    buffers hold at most 2 x max_files x PER_DESCRIPTOR, and threads stop at max_processes."""
    out = run(py, HOLD)
    held = json.loads(out.splitlines()[-1])
    assert held["open"] <= MAX_FILES and held["inflight"] <= MAX_FILES, held
    assert held["raised"] == 0, held
    assert held["sock"] + held["pipe"] <= 2 * MAX_FILES * PER_DESCRIPTOR, held
    assert held["sock"] > 10 * PER_DESCRIPTOR, held  # it did hold buffers: the attack ran
    assert held["threads"] < py.max_processes, held


@needs_jail
@needs_cgroup
def test_a_calls_total_memory_kernel_included_stops_at_call_memory_mb(py):
    """Processes each under memory_mb, together over call_memory_mb (96 MB): user pages in
    forked children, tmpfs pages in /scratch (disk_mb=256 would allow them) and socket
    buffers. The call's cgroup stops it: the call is killed and says why, or the kernel refuses
    the allocation; what the snippet holds never passes the limit."""
    out = run(py, """
        import os, time
        got = 0
        try:
            for i in range(200 * 16):  # files of 64 KiB (RLIMIT_FSIZE caps each)
                with open(f"/scratch/fill{i}", "wb") as f:
                    f.write(b"x" * (64 << 10))
                got += 1
        except OSError as err:
            print("tmpfs stopped at", got // 16, "MiB:", err.errno, flush=True)
        else:
            print("tmpfs held", got // 16, "MiB", flush=True)
        for _ in range(3):
            if os.fork() == 0:
                block = bytearray(60 << 20)
                for i in range(0, len(block), 4096):
                    block[i] = 1
                time.sleep(5)
                os._exit(0)
        time.sleep(5)
        """)
    assert "more than 96 MB of memory in all" in out, out
    for what in ("tmpfs stopped at", "tmpfs held"):
        if what in out:
            assert int(out.split(what)[1].split()[0]) < 96, out


@needs_jail
def test_one_calls_fork_bomb_leaves_seven_concurrent_calls_their_processes(py):
    """Eight calls at once on one runner: one forks until the kernel refuses and holds its
    processes; the other seven, started meanwhile, each start max_processes - 2 processes of
    their own. All calls ran under one uid and one RLIMIT_NPROC budget before, so the bomb made
    the others' forks fail."""
    bomb = """
        import os, time
        n = 0
        try:
            while n < 100:
                if os.fork() == 0:
                    time.sleep(8)
                    os._exit(0)
                n += 1
        except OSError:
            pass
        print("bomb held", n, flush=True)
        time.sleep(6)
        """
    others = f"""
        import os, time
        time.sleep(2.5)  # the bomb holds its processes by now (for 6 s)
        kids = []
        for _ in range({py.max_processes - 2}):
            pid = os.fork()
            if pid == 0:
                time.sleep(1)
                os._exit(0)
            kids.append(pid)
        print("started", len(kids), all(os.waitpid(p, 0)[1] == 0 for p in kids))
        """
    with ToolRunner({"python": py}, max_workers=8) as runner:
        obs = runner.run([ToolCall("python", {"code": OFF + textwrap.dedent(bomb)})] +
                         [ToolCall("python", {"code": OFF + textwrap.dedent(others)})] * 7)
    assert "bomb held" in obs[0].text, obs[0]
    for o in obs[1:]:
        assert not o.error and o.text == f"started {py.max_processes - 2} True\n", o
