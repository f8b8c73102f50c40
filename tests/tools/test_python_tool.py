"""The python tool on real subprocesses: output, limits, and what the audit hook (a tripwire)
refuses. The jail itself is attacked in test_python_jail.py."""

import os
import tempfile
import uuid

import pytest

from hfjax.tools import Observation, ToolCall, ToolError, ToolRunner, jail
from hfjax.tools.python import Python, network_namespace_available

try:  # these cases test the tool and its audit hook, in the jail where the machine has one
    jail.probe()
    ISOLATION = "jail"
except jail.JailUnavailable:
    ISOLATION = "none"


@pytest.fixture(scope="module")
def py():
    return Python(wall_s=2.0, memory_mb=256, max_output_bytes=20_000, max_output_chars=2000,
                  isolation=ISOLATION)


def test_prints_and_shows_the_last_expression(py):
    assert py.call({"code": "x = 1234 * 5678\nprint('product', x)\nx + 1"}) == (
        "product 7006652\n7006653\n")
    assert py.call({"code": "None"}) == ""


def test_numeric_libraries_import_within_the_limits():
    tool = Python(wall_s=30.0, isolation=ISOLATION)
    assert tool.call({"code": "import numpy as np\nint(np.arange(10).sum())"}) == "45\n"
    pytest.importorskip("sympy")
    # sympy imports ctypes (allowed; using it to reach native code is not).
    assert tool.call({"code": "import sympy\nsympy.factorint(1234567)"}) == "{127: 1, 9721: 1}\n"


def test_exception_is_reported_with_its_traceback_tail(py):
    with pytest.raises(ToolError, match=r"(?s)the code failed:.*ZeroDivisionError") as err:
        py.call({"code": "print('before')\n1 / 0"})
    assert "<snippet>" in str(err.value) and "before" in str(err.value)
    assert 'File "<string>"' not in str(err.value)  # the bootstrap's frames are left out


def test_syntax_error_is_reported_plainly(py):
    with pytest.raises(ToolError, match=r"(?s)failed:.*SyntaxError: '\(' was never") as err:
        py.call({"code": "x = (1,\nprint(x)"})
    assert "Traceback" not in str(err.value)


def test_hang_is_killed_within_the_wall_clock(py):
    # Printed without a flush: the child is unbuffered, so the line survives the kill.
    marker = f"hfjax-hang-{uuid.uuid4().hex}"
    # The hook is switched off (this runs in the jail) to exec a loop with the marker on its
    # command line.
    loop = f"print({marker!r})\nwhile True: pass"
    code = ("import os, sys\nsys.modules['__main__']._BLOCKED = ()\n"
            f"os.execv(sys.executable, [sys.executable, '-uc', {loop!r}, {marker!r}])")
    with pytest.raises(ToolError, match="ran longer than 2 s") as err:
        py.call({"code": code})
    assert marker in str(err.value)
    # Killed and reaped: no process of the call remains.
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert marker.encode() not in f.read()
        except OSError:
            pass


def test_cpu_limit():
    tool = Python(wall_s=60.0, cpu_s=1, isolation=ISOLATION)
    with pytest.raises(ToolError, match="more than 1 s of CPU"):
        tool.call({"code": "while True:\n    pass"})


def test_memory_bomb_fails_cleanly(py):
    with pytest.raises(ToolError, match="MemoryError"):
        py.call({"code": "b = bytearray(2 * 1024 ** 3)"})
    with pytest.raises(ToolError, match="MemoryError"):
        py.call({"code": "x = [0] * (10 ** 9)"})
    assert py.call({"code": "print('still fine')"}) == "still fine\n"


def test_huge_output_is_stopped_and_cut(py):
    with pytest.raises(ToolError, match="File too large") as err:
        py.call({"code": "while True:\n    print('x' * 1000)"})
    assert len(str(err.value)) < 5000
    # Output under the byte cap but over the character cap is cut, not refused.
    out = py.call({"code": "print('y' * 10000)"})
    # The mark says how much was cut: 10,001 bytes printed (the newline too), 2,000 kept.
    assert out == "y" * 2000 + "\n[output truncated: 8001 more bytes]"


@pytest.mark.parametrize("isolation", ["none", ISOLATION])  # the audit hook alone; as run
def test_socket_is_refused(isolation):
    py = Python(wall_s=5.0, isolation=isolation, network_namespace=False)
    for code in ("import socket\nsocket.socket()",
                 "import socket\nsocket.create_connection(('127.0.0.1', 9))",
                 "import _socket\n_socket.socket()",
                 "import socket\nsocket.getaddrinfo('example.com', 80)"):
        with pytest.raises(ToolError, match="sandbox: socket"):
            py.call({"code": code})


@pytest.mark.skipif(not network_namespace_available(), reason="unshare --user --net not allowed")
def test_network_namespace_has_only_loopback(py):
    assert py.network_namespace
    out = py.call({"code": "print(open('/proc/net/dev').read())"})
    interfaces = {line.split(":")[0].strip() for line in out.splitlines()[2:] if ":" in line}
    assert interfaces == {"lo"}


def test_nothing_is_written_outside_the_temporary_directory(py):
    target = os.path.join(tempfile.gettempdir(), f"hfjax_tool_escape_{os.getpid()}")
    attempts = [
        f"open({target!r}, 'w').write('x')",
        f"open({target!r}, 'a')",
        f"import os\nos.open({target!r}, os.O_WRONLY | os.O_CREAT)",
        f"import pathlib\npathlib.Path({target!r}).write_text('x')",
        "import os\nos.symlink('/etc/passwd', 'link')\nopen('link', 'w')",
        f"import os\nos.mkdir({target!r})",
        f"import shutil\nshutil.copy('/etc/hostname', {target!r})",
        "open('../escape', 'w')",
        "import os\nos.chdir('/')\nopen('escape', 'w')",
    ]
    for code in attempts:
        with pytest.raises(ToolError, match="sandbox"):
            py.call({"code": code})
        assert not os.path.exists(target), code
    # Inside its own directory the snippet may write; the directory is gone afterwards.
    out = py.call({"code": "import os\nopen('notes.txt', 'w').write('hi')\n"
                           "print(os.getcwd())\nprint(open('notes.txt').read())"})
    cwd, text = out.split()
    assert text == "hi" and (cwd == jail.MOUNT if ISOLATION == "jail"
                             else not os.path.exists(cwd))


def test_processes_signals_renames_and_native_calls_are_refused(py):
    victim = tempfile.NamedTemporaryFile(delete=False)
    victim.close()
    try:
        for code, why in [("import os\nos.system('true')", "os.system"),
                          ("import subprocess\nsubprocess.run(['true'])", "subprocess.Popen"),
                          ("import os\nos.fork()", "os.fork"),
                          (f"import os\nos.remove({victim.name!r})", "os.remove"),
                          (f"import os\nos.replace({victim.name!r}, 'x')", "os.rename"),
                          ("import os\nos.kill(1, 0)", "os.kill"),
                          ("import socket\nsocket.gethostbyname('localhost')",
                           "socket.gethostbyname"),
                          ("import multiprocessing\nmultiprocessing.Process(target=print)"
                           ".start()", "os.fork"),
                          ("import ctypes\nctypes.CDLL('libc.so.6')", "ctypes.dlopen"),
                          ("import ctypes\nctypes.CDLL(None).getpid()", "ctypes.dlsym"),
                          ("import ctypes\nctypes.c_int.from_address(id(1))", "ctypes.cdata")]:
            with pytest.raises(ToolError, match=f"sandbox: .*{why}"):
                py.call({"code": code})
        assert os.path.exists(victim.name)
    finally:
        os.unlink(victim.name)


def test_crash_and_exit_status(py):
    with pytest.raises(ToolError, match="killed by SIGABRT"):
        py.call({"code": "import os\nos.abort()"})
    with pytest.raises(ToolError, match="killed by SIGSEGV"):
        py.call({"code": "import faulthandler\nfaulthandler.disable()\nfaulthandler._sigsegv()"})
    with pytest.raises(ToolError, match="exit status 3"):
        py.call({"code": "raise SystemExit(3)"})
    with pytest.raises(ToolError, match="EOFError"):
        py.call({"code": "input()"})


def test_through_the_runner_a_failure_is_an_observation_and_the_run_goes_on(py):
    with ToolRunner({"python": py}) as runner:
        hang, ok, bad = runner.run([ToolCall("python", {"code": "while True: pass"}),
                                    ToolCall("python", {"code": "print(6 * 7)"}),
                                    ToolCall("python", {"code": 42})])
    assert hang.error and "ran longer than" in hang.text
    assert ok == Observation("42\n", False)
    assert bad.error and "must be of type string" in bad.text


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="memory_mb=10 >= 64"):
        Python(memory_mb=10)
