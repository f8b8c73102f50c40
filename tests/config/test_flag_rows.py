"""Every flag of every entry point has a row in the flag checks (`hfjax.config.flag_checks`): a
type, a range or a choice. The walk runs each launch/ module as `python -m` would, in one
subprocess, with absl's `app.run` replaced by a probe that lists the flags defined by then."""

import json
import os
import re
import subprocess
import sys

import pytest
from support import subprocess_env

from hfjax.config import Choice, ConfigError, check_flags, flag_checks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Runs every entry point's module as __main__ with app.run replaced: prints, per entry, each
# flag that a launch/ or hfjax module defined (absl's own and third-party flags left out), its
# kind and, for an enum, its values; then forgets the flags that the module itself defined, so
# that the next module may define the same names (and the two that launch.cli defines per
# entry point).
_PROBE = r"""
import json, runpy, sys
from absl import app, flags

FLAGS = flags.FLAGS
ENTRIES = sys.argv[1:]

class Probed(Exception):
    pass

out = {}

def probe(main, flags_parser=None, **kw):
    found = {}
    for name in list(FLAGS):
        module = FLAGS.find_module_defining_flag(name) or ""
        # absl names a __main__ module by sys.argv[0]: the entry's name here.
        if module == current or module.startswith(("launch.", "hfjax.")):
            flag = FLAGS[name]
            found[name] = {"kind": type(flag).__name__,
                           "enum": list(getattr(flag.parser, "enum_values", None) or [])}
    out[current] = found
    raise Probed

app.run = probe
for current in ENTRIES:
    sys.argv = [current]
    try:
        runpy.run_module("launch." + current, run_name="__main__")
    except Probed:
        pass
    for name in list(FLAGS):
        module = FLAGS.find_module_defining_flag(name) or ""
        if module == current or name in ("compilation_cache_dir", "config"):
            delattr(FLAGS, name)
print(json.dumps(out))
"""

# local_cluster first: its --num_processes is its own, not the process flag of the others.
# Each module is named whole, so that the Bazel build ships it with this test
# (scripts/bazel_build.py makes a launch/ module named in a string a test's data).
ENTRY_MODULES = ("launch.local_cluster", "launch.train", "launch.sft", "launch.train_rm",
                 "launch.train_dpo", "launch.evaluate", "launch.generate", "launch.convert",
                 "launch.export", "launch.prepare_data", "launch.plan")
ENTRIES = tuple(m.removeprefix("launch.") for m in ENTRY_MODULES)


@pytest.fixture(scope="module")
def entry_flags():
    env = subprocess_env()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, "-c", _PROBE, *ENTRIES], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_walk_finds_every_entry_point():
    launch = os.path.join(REPO, "launch")
    with_main = sorted(f[:-3] for f in os.listdir(launch) if f.endswith(".py") and re.search(
        r'^if __name__ == "__main__":', open(os.path.join(launch, f)).read(), re.M))
    assert with_main == sorted(ENTRIES)


def test_every_flag_of_every_entry_point_has_a_row(entry_flags):
    assert set(entry_flags) == set(ENTRIES)
    missing = [f"{entry}: --{name}" for entry, found in entry_flags.items()
               for name in found if name not in flag_checks(entry)]
    assert not missing, f"flags without a row in hfjax/config/flags.py: {missing}"
    # The walk sees what it should: the common flags and each module's own.
    assert {"verbose", "config", "cpu_devices", "dry_run"} <= set(entry_flags["train"])
    assert {"format", "compilation_cache_dir", "ckpt"} <= set(entry_flags["export"])
    assert {"port", "script"} <= set(entry_flags["local_cluster"])


def test_every_flag_with_a_fixed_set_of_values_has_a_choice_row(entry_flags):
    for entry, found in entry_flags.items():
        for name, flag in found.items():
            row = flag_checks(entry)[name]
            if flag["enum"]:
                assert isinstance(row, Choice), (entry, name)
                names = row.names() if callable(row.names) else row.names
                assert sorted(names) == sorted(flag["enum"]), (entry, name)
    assert isinstance(flag_checks("export")["format"], Choice)


@pytest.mark.parametrize("entry,name,bad", [
    ("export", "format", "pfet"), ("convert", "dtype", "float16"),
    ("generate", "dtype", "fp8"), ("plan", "prices", "guessed"),
    ("prepare_data", "task", "nope"), ("local_cluster", "port", 70000),
    ("train", "coordinator_address", "nohost"), ("plan", "memory_fraction", 1.5),
    ("train", "shutdown_timeout_s", 0),  # as hfjax.parallel.distributed refuses it
])
def test_a_bad_value_is_refused_in_one_line_naming_the_choices(entry, name, bad):
    with pytest.raises(ConfigError) as err:
        check_flags(entry, {name: bad})
    msg = str(err.value)
    assert msg.startswith(f"--{name}={bad}: needs") and "\n" not in msg
    row = flag_checks(entry)[name]
    if isinstance(row, Choice):
        names = row.names() if callable(row.names) else row.names
        assert all(n in msg for n in names)


def test_export_refuses_an_unknown_format_before_it_reads_anything(tmp_path):
    (tmp_path / "run").mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "launch.export", f"--ckpt={tmp_path / 'run'}",
         f"--out={tmp_path / 'hf'}", "--format=pfet"],
        cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "--format=pfet: needs one of merged, hf, peft" in lines[0]
    assert not (tmp_path / "hf").exists()
