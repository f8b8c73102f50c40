"""Every test runs with 8 simulated CPU devices, set before JAX is imported.

XLA:CPU compiles the suite's programs with LLVM unoptimised and with its classic fusion
emitters (`FAST_COMPILE`): the tests' models are tiny, so compiling, not running, is most of
their time (85% of tests/engine/test_packing.py's), and with these flags an update program of
it compiles in 4-6 s instead of 19-20 s. They change how fast a program runs, not what it
computes; the real-weights tests run somewhat slower. XLA stops at a flag it
does not know, so a probe process checks them once per session against the installed jaxlib;
commands the tests start get them too (`support.subprocess_env`).

Programs are kept in JAX's persistent compilation cache for the session, in a fresh directory
(nothing carries over between sessions) with no size limit: many tests build the same small
models and meshes, and a program one test compiled is read back by the next instead of
compiled again.
"""

import atexit
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from hfjax.parallel.distributed import simulate_cpu_devices

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def _compile_flags() -> str:
    """FAST_COMPILE where this jaxlib accepts it, else nothing; decided by the session's first
    process and passed to pytest-xdist's workers (and the tests' commands) in the environment."""
    if "HFJAX_TEST_XLA_FLAGS" not in os.environ:
        probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"],
                               env={**os.environ, "XLA_FLAGS": FAST_COMPILE,
                                    "JAX_PLATFORMS": "cpu"}, capture_output=True, timeout=120)
        os.environ["HFJAX_TEST_XLA_FLAGS"] = FAST_COMPILE if probe.returncode == 0 else ""
    return os.environ["HFJAX_TEST_XLA_FLAGS"]


os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_compile_flags()}".strip()
# 8 devices whatever XLA_FLAGS says; patient collectives, a thread pool none of them starves.
simulate_cpu_devices(8, keep_given=False)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
from support import NO_CACHE_LIMIT  # noqa: E402

from launch import compile_cache  # noqa: E402

# The first process of a session creates the directory (and removes it at exit); pytest-xdist's
# workers, started after it, inherit it through the environment and share it.
_CACHE = os.environ.get("HFJAX_TEST_XLA_CACHE")
if not _CACHE:
    _CACHE = os.environ["HFJAX_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="hfjax-tests-xla-")
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
# No size limit (support.NO_CACHE_LIMIT says why), here and in every process the tests start.
os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = NO_CACHE_LIMIT
compile_cache.enable(_CACHE)
jax.config.update("jax_compilation_cache_max_size", int(NO_CACHE_LIMIT))

jax.config.update("jax_enable_x64", False)
# The 8 simulated devices share the machine's cores: with async dispatch, programs with
# collectives that overlap in flight (worker groups on disjoint pools) can starve each other's
# participants and hang in an XLA CPU all-gather. launch/train.py does the same on CPU.
jax.config.update("jax_cpu_enable_async_dispatch", False)
assert jax.device_count() == 8, jax.devices()


# -- worker processes ---------------------------------------------------------------------------


@pytest.fixture(autouse=True, scope="module")
def _workers_closed(request):
    """After each test module: the shared reward pools are closed (their scorers are a
    per-process cache that would otherwise live until the pytest worker exits), dropped agent
    loops' tool runners are collected (hfjax.agents.loop closes them), and any tool worker or
    scorer still running is reported as a warning naming the module: a test that starts one
    closes it (`with ToolRunner(...)`, `Trainer.close()`, `RewardPool.close()`)."""
    yield
    import gc
    import time
    import warnings

    from support import hfjax_children

    from hfjax.rewards.pool import close_shared_pools

    gc.collect()
    close_shared_pools()
    deadline = time.monotonic() + 10.0  # a closed runner's threads end their workers
    while (left := hfjax_children()) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left:
        warnings.warn(f"{request.module.__name__} left {len(left)} tool worker or reward "
                      f"scorer processes running: {left[:4]}", stacklevel=1)



# -- order --------------------------------------------------------------------------------------


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's hook reads the groups
def pytest_collection_modifyitems(config, items):
    """The longest work first (support.longest_first: the longest modules and smoke-tier
    parts), and each module one unit of pytest-xdist's `--dist=loadgroup` (scripts/test.sh): a
    test without an `xdist_group` mark joins its module's group, so the module's fixtures are
    built once, while each smoke-tier part is a group of its own."""
    from support import longest_first

    root = str(config.rootpath)
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(os.path.relpath(str(item.path), root)))
    items[:] = longest_first(items, root)
