"""Red team for the python tool's jail: every attack goes through the public tool API (`.call`
or a ToolRunner), and every check is on the host: the process that must survive, the file that
must not change, the listener that must receive nothing, the process that must be gone.

Most attacks first switch the audit hook off (`OFF`), as the issue showed one line does: what
holds must hold without it.
"""

import errno
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from hfjax.tools import ToolCall, ToolError, ToolRunner, jail
from hfjax.tools.python import Python

try:
    jail.probe()
    _WHY_NOT = ""
except jail.JailUnavailable as _err:
    _WHY_NOT = str(_err)
needs_jail = pytest.mark.skipif(bool(_WHY_NOT), reason=f"no jail on this machine: {_WHY_NOT}")

# One line switches the audit hook off (the bootstrap's globals live in __main__).
OFF = ("import sys\nsys.modules['__main__']._BLOCKED = ()\n"
       "sys.modules['__main__']._PATH_EVENTS = {}\n"
       "sys.modules['__main__']._ok = lambda path: True\n")
DISK_MB = 4
MAX_PROCS = 12


@pytest.fixture(scope="module")
def py():
    if _WHY_NOT:
        pytest.skip(f"no jail on this machine: {_WHY_NOT}")
    # A generous wall clock: the attacks must end by themselves on a loaded machine.
    return Python(wall_s=15.0, memory_mb=256, max_output_bytes=256 * 1024,
                  max_output_chars=20_000, max_processes=MAX_PROCS, disk_mb=DISK_MB)


def run(py, code: str) -> str:
    """The snippet's output, or the error text the tool reports."""
    if code.startswith(OFF):
        code = OFF + textwrap.dedent(code[len(OFF):])
    try:
        return py.call({"code": textwrap.dedent(code)})
    except ToolError as err:
        return f"ToolError: {err}"


def host_pids_with(marker: str) -> list[int]:
    """Host processes whose command line contains `marker`."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(pid))
            except OSError:
                pass
    return found


@needs_jail
def test_signals_reach_no_process_outside(py):
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        code = OFF + f"""
        import ctypes, os, signal
        libc = ctypes.CDLL(None, use_errno=True)
        outside = [{victim.pid}, {os.getpid()}, os.getppid(), 1]
        for pid in outside:
            for attempt in (lambda: os.kill(pid, 9), lambda: os.killpg(pid, 9),
                            lambda: signal.pidfd_send_signal(os.pidfd_open(pid), 9),
                            lambda: libc.syscall(62, pid, 9),       # kill
                            lambda: libc.syscall(234, pid, pid, 9),  # tgkill
                            lambda: libc.syscall(200, pid, 9)):      # tkill
                try:
                    attempt()
                except Exception:
                    pass
        for attempt in (lambda: os.kill(-1, 9), lambda: libc.syscall(62, -1, 9)):
            try:
                attempt()
            except Exception:
                pass
        print("tried")
        """
        out = run(py, code)
        assert victim.poll() is None, out  # the sacrificial process lives
        os.kill(os.getpid(), 0)  # and so does this one (it is running this line)
        # kill(-1) took the snippet itself down, or it printed: either way it ran.
        assert "tried" in out or "SIGKILL" in out, out
    finally:
        victim.kill()
        victim.wait()


@needs_jail
def test_processes_do_not_outlive_the_call(py):
    """setsid, double fork, os.system, subprocess and _posixsubprocess.fork_exec (no audit
    event even with the hook on): every process started is gone once the call returns."""
    marker = f"hfjax-jail-{uuid.uuid4().hex}"
    sleeper = [sys.executable, "-c", "print('alive', flush=True); import time; time.sleep(300)",
               marker]
    # args, executable_list, close_fds, pass_fds, cwd, env, 6 std pipe ends, errpipe r/w,
    # restore_signals, call_setsid, pgid_to_set, gid, extra_groups, uid, umask, preexec_fn,
    # allow_vfork (the signature of CPython 3.11.7 to 3.13)
    fork_exec_args = [sleeper, [sleeper[0].encode()], True, (), None, None, -1, -1, -1, -1,
                      -1, -1, -1, -1, False, True, -1, None, None, None, -1, None, False]
    with_hook = f"""
    import _posixsubprocess, os, time
    args = {fork_exec_args!r}
    args[12], args[13] = os.pipe()
    _posixsubprocess.fork_exec(*args)
    time.sleep(1)
    """
    without_hook = OFF + f"""
    import os, shlex, subprocess, time
    subprocess.Popen({sleeper!r}, start_new_session=True)
    os.system(shlex.join({sleeper!r}) + " &")
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv({sleeper[0]!r}, {sleeper!r})
        os._exit(0)
    time.sleep(1)
    """
    for code in (with_hook, without_hook):
        out = run(py, code)
        assert "alive" in out, out  # the processes did start, and printed
        assert host_pids_with(marker) == [], out


@needs_jail
def test_writes_deletes_renames_outside_the_work_dir_change_nothing(py, tmp_path):
    # Outside the jail's view: a directory of this test. Inside it but read-only: the Python
    # installation (a victim file there only where this user can create one).
    hidden = tmp_path / "victim.txt"
    hidden.write_text("original")
    targets = [str(hidden)]
    visible = os.path.join(sys.prefix, f".hfjax_jail_victim_{uuid.uuid4().hex}")
    if os.access(sys.prefix, os.W_OK):
        with open(visible, "w") as f:
            f.write("original")
        os.chmod(visible, 0o644)
        targets.append(visible)
    try:
        before = [(open(t).read(), os.stat(t).st_mode) for t in targets]
        listing = sorted(os.listdir(tmp_path))
        code = OFF + f"""
        import ctypes, os, shutil, sqlite3
        libc = ctypes.CDLL(None, use_errno=True)
        done = []
        def attempt(name, fn):
            try:
                fn()
                done.append(name)
            except Exception:
                pass
        for t in {targets!r}:
            d, base = os.path.split(t)
            attempt("open", lambda: open(t, "w").write("pwned"))
            attempt("dir_fd", lambda: os.write(os.open(base, os.O_WRONLY | os.O_TRUNC,
                                                       dir_fd=os.open(d, os.O_RDONLY)), b"x"))
            attempt("create", lambda: os.open("new", os.O_CREAT | os.O_WRONLY,
                                              dir_fd=os.open(d, os.O_RDONLY)))
            attempt("fchmod", lambda: os.chmod(os.open(t, os.O_RDONLY), 0o777))
            attempt("sqlite", lambda: sqlite3.connect(os.path.join(d, "db.sqlite"))
                    .execute("create table t(x)"))
            attempt("mkfifo", lambda: os.mkfifo(os.path.join(d, "fifo")))
            attempt("rename", lambda: os.rename(t, t + ".moved"))
            attempt("libc", lambda: libc.rename(t.encode(), (t + ".c").encode()) or
                    libc.unlink(t.encode()) or libc.chmod(t.encode(), 0o777))
            attempt("unlink_dir_fd", lambda: os.unlink(base, dir_fd=os.open(d, os.O_RDONLY)))
            attempt("system", lambda: os.system(f"rm -rf {{d}}; echo x > {{t}}"))
            attempt("rmtree", lambda: shutil.rmtree(d))
        print("done:", done)
        """
        out = run(py, code)
        assert "done:" in out, out
        assert [(open(t).read(), os.stat(t).st_mode) for t in targets] == before, out
        assert sorted(os.listdir(tmp_path)) == listing, out
        for extra in ("new", "db.sqlite", "fifo"):
            assert not os.path.exists(os.path.join(sys.prefix, extra)), out
    finally:
        if os.path.exists(visible):
            os.unlink(visible)


@needs_jail
def test_network_reaches_no_listener_on_the_host(py):
    tcp = socket.socket()
    tcp.bind(("0.0.0.0", 0))
    tcp.listen(8)
    tcp.setblocking(False)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("0.0.0.0", 0))
    udp.setblocking(False)
    abstract = f"\0hfjax-jail-{uuid.uuid4().hex}"
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(abstract)
    unix.listen(8)
    unix.setblocking(False)
    try:
        host_ips = {"127.0.0.1"}
        try:  # this machine's address on its default route, when it has one
            probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            probe.connect(("10.255.255.255", 1))
            host_ips.add(probe.getsockname()[0])
            probe.close()
        except OSError:
            pass
        code = OFF + f"""
        import socket
        for ip in {sorted(host_ips)!r}:
            for fn in (lambda: socket.create_connection((ip, {tcp.getsockname()[1]}), 1),
                       lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                       .sendto(b"x", (ip, {udp.getsockname()[1]}))):
                try:
                    fn()
                except OSError:
                    pass
        try:
            socket.socket(socket.AF_UNIX).connect({abstract!r})
        except OSError:
            pass
        print("tried")
        """
        out = run(py, code)
        assert "tried" in out, out
        for sock in (tcp, unix):
            with pytest.raises(BlockingIOError):
                sock.accept()
        with pytest.raises(BlockingIOError):
            udp.recvfrom(16)
    finally:
        for sock in (tcp, udp, unix):
            sock.close()


@needs_jail
def test_the_controllers_environment_and_files_are_out_of_reach(tmp_path):
    """A controller process (a child of this test) with a secret in its environment and a
    secret file in its working directory runs the snippet through a ToolRunner; the snippet
    searches /proc, the file system and its own environment for them."""
    env_secret, file_secret = f"envsecret{uuid.uuid4().hex}", f"filesecret{uuid.uuid4().hex}"
    (tmp_path / "secret.txt").write_text(file_secret)
    snippet = OFF + textwrap.dedent(f"""
        import os
        found, scanned = [], 0
        def look(where, data):
            global scanned
            scanned += 1
            for s in ({env_secret!r}, {file_secret!r}):
                if s.encode() in data:
                    found.append(where)
        look("environ", repr(dict(os.environ)).encode())
        for pid in [p for p in os.listdir("/proc") if p.isdigit()] + ["self"]:
            for part in ("environ", "cmdline", "cwd/secret.txt", "root{tmp_path}/secret.txt"):
                try:
                    look(pid + "/" + part, open(f"/proc/{{pid}}/{{part}}", "rb").read())
                except OSError:
                    pass
        for top in ("/", "/proc/1/root"):
            for d, dirs, files in os.walk(top):
                dirs[:] = [x for x in dirs if os.path.join(d, x) not in ("/proc", "/usr")]
                for name in files:
                    if "secret" in name:
                        try:
                            look(os.path.join(d, name), open(os.path.join(d, name), "rb").read())
                        except OSError:
                            pass
        for path in ("../secret.txt", {str(tmp_path / "secret.txt")!r}):
            try:
                look(path, open(path, "rb").read())
            except OSError:
                pass
        print("scanned", scanned, "found", found)
    """)
    controller = textwrap.dedent(f"""
        import json, sys
        from hfjax.tools import ToolCall, ToolRunner
        from hfjax.tools.python import Python
        with ToolRunner({{"python": Python(wall_s=10.0)}}) as runner:
            [obs] = runner.run([ToolCall("python", {{"code": {snippet!r}}})])
        print(json.dumps(obs.text))
    """)
    import hfjax  # this checkout, whatever the working directory
    env = dict(os.environ, HFJAX_TEST_SECRET=env_secret,
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(hfjax.__file__))))
    done = subprocess.run([sys.executable, "-c", controller], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert "scanned" in out and "found []" in out, out
    assert env_secret not in out and file_secret not in out


@needs_jail
def test_process_limit_and_fork_bomb(py):
    counted = run(py, OFF + """
        import os, time
        n = 0
        try:
            while n < 1000:
                if os.fork() == 0:
                    time.sleep(10)
                    os._exit(0)
                n += 1
        except OSError as err:
            print("stopped at", n, err.errno)
        """)
    n, why = map(int, counted.split()[-2:])
    assert n < MAX_PROCS and why == errno.EAGAIN, counted
    marker = f"hfjax-bomb-{uuid.uuid4().hex}"
    bomb = ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
            "        pass\n")
    quick = Python(wall_s=2.0, memory_mb=256, max_processes=MAX_PROCS)
    start = time.monotonic()
    out = run(quick, OFF + f"import os, sys\nos.execv(sys.executable, "
                        f"[sys.executable, '-c', {bomb!r}, {marker!r}])")
    assert time.monotonic() - start < quick.wall_s + 5, out
    assert "ran longer than" in out, out
    assert host_pids_with(marker) == []


@needs_jail
def test_filling_the_disk_stops_at_the_work_dirs_size(py):
    out = run(py, OFF + """
        import os
        total = 0
        for d in ("/scratch", "/dev/shm", "/tmp", "/", "/dev", "/usr"):
            for i in range(10_000):
                try:
                    with open(f"{d}/fill{i}", "wb") as f:
                        f.write(b"x" * 65536)
                    total += 65536
                except OSError:
                    break
        print("wrote", total)
        """)
    written = int(out.split()[-1])
    assert 0 < written <= DISK_MB << 20, out


@needs_jail
def test_seccomp_refuses_what_the_namespaces_do_not_cover(py):
    # x86_64 numbers; elsewhere the names differ and this case says so.
    if os.uname().machine != "x86_64":
        pytest.skip("syscall numbers below are x86_64's")
    calls = {"ptrace": (101, 0, 0, 0, 0), "unshare": (272, 0x10000000), "mount": (165, 0, 0, 0),
             "setns": (308, 0, 0), "keyctl": (250, 0, 0), "bpf": (321, 0, 0, 0),
             "perf_event_open": (298, 0, 0, 0, 0, 0), "userfaultfd": (323, 0),
             "pidfd_open": (434, 1, 0), "io_uring_setup": (425, 1, 0),
             "open_by_handle_at": (304, 0, 0, 0), "process_vm_readv": (310, 1, 0, 0, 0, 0, 0),
             "kexec_load": (246, 0, 0, 0, 0), "init_module": (175, 0, 0, 0),
             "clone_newuser": (56, 0x10000000 | signal.SIGCHLD, 0, 0, 0, 0),
             "clone3": (435, 0, 0)}
    code = OFF + f"""
        import ctypes, json
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        out = {{}}
        for name, args in {calls!r}.items():
            ctypes.set_errno(0)
            rc = libc.syscall(*[ctypes.c_long(a) for a in args])
            out[name] = (rc, ctypes.get_errno())
        print(json.dumps(out))
        """
    got = json.loads(run(py, code))
    expect = {name: [-1, errno.ENOSYS if name == "clone3" else errno.EPERM] for name in calls}
    assert got == expect


@needs_jail
def test_through_a_tool_runner_a_hostile_call_is_one_observation(py):
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with ToolRunner({"python": py}) as runner:
            bad, ok = runner.run([
                ToolCall("python", {"code": OFF + f"import os\nos.kill({victim.pid}, 9)\n"
                                                  f"os.kill({os.getpid()}, 9)"}),
                ToolCall("python", {"code": "print(6 * 7)"})])
        assert bad.error and ok.text == "42\n"
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_without_a_jail_a_run_is_refused_before_anything_runs(monkeypatch):
    from configs import ppo_arith
    from hfjax.config import ConfigError, check_config

    def missing():
        raise jail.JailUnavailable("user namespaces are disabled")
    monkeypatch.setattr(jail, "probe", missing)
    cfg = ppo_arith.get_config()
    cfg.rollout.multi_turn.enable = True
    cfg.rollout.multi_turn.tools = "calculator,python"
    with pytest.raises(ConfigError) as err:
        check_config(cfg)
    assert "\n" not in str(err.value)
    assert re.search(r"rollout.multi_turn.tools='calculator,python': tool 'python': .*user "
                     r"namespaces are disabled.*--config.rollout.multi_turn.python_isolation="
                     r"none", str(err.value)), str(err.value)
    cfg.rollout.multi_turn.python_isolation = "none"  # the risk, accepted explicitly
    check_config(cfg)


def test_without_a_jail_the_tool_refuses_to_start(monkeypatch):
    def missing():
        raise jail.JailUnavailable("user namespaces are disabled")
    monkeypatch.setattr(jail, "probe", missing)
    with pytest.raises(ValueError) as err:
        Python()
    text = str(err.value)
    assert "\n" not in text and "user namespaces are disabled" in text
    assert "rollout.multi_turn.python_isolation=none" in text
    assert Python(isolation="none").isolation == "none"  # the risk, accepted explicitly
    with pytest.raises(ValueError, match="isolation='sandbox'"):
        Python(isolation="sandbox")


@needs_jail
def test_the_jail_has_no_write_access_to_a_hosts_file_mode(py):
    """The sandbox user is not the files' owner: chmod on the interpreter's own binary fails
    (read-only mount or ownership), and the binary's mode is unchanged."""
    exe = os.path.realpath(sys.executable)
    mode = stat.S_IMODE(os.stat(exe).st_mode)
    out = run(py, OFF + f"import os\ntry:\n    os.chmod({exe!r}, {mode:#o})\n    print('chmod')\n"
                        "except OSError as e:\n    print('refused', e.errno)")
    assert out.startswith("refused"), out
    assert stat.S_IMODE(os.stat(exe).st_mode) == mode


@needs_jail
def test_the_snippet_runs_unprivileged_with_no_capabilities_and_no_new_privs(py):
    """What the kernel says of the snippet's own process, read inside the jail: every uid and
    gid the jail's unprivileged one (never 0), no capability in any set, and no_new_privs (no
    setuid binary can give any back)."""
    out = run(py, """
        import json
        fields = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
        print(json.dumps({k: fields[k].split() for k in ("Uid", "Gid", "CapInh", "CapPrm",
                                                          "CapEff", "CapBnd", "CapAmb",
                                                          "NoNewPrivs")}))
        """)
    got = json.loads(out)
    uids, gids = {int(u) for u in got["Uid"]}, {int(g) for g in got["Gid"]}
    assert len(uids) == 1 and 0 not in uids and uids == gids, got
    # One of the call's own ids: none the host gives an account (nobody's 65534 at least).
    assert uids <= set(jail.JAIL_IDS) and min(uids) >= jail.NOBODY, got
    for caps in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(got[caps][0], 16) == 0, (caps, got)
    assert got["NoNewPrivs"] == ["1"], got
