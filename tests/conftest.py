"""Every test runs with 8 simulated CPU devices, set before JAX is imported.

Programs are kept in JAX's persistent compilation cache for the session, in a fresh directory
(nothing carries over between sessions): many tests build the same small models and meshes,
and a program one test compiled is read back by the next instead of compiled again.
"""

import atexit
import os
import shutil
import tempfile

from hfjax.parallel.distributed import simulate_cpu_devices

# 8 devices whatever XLA_FLAGS says; patient collectives, a thread pool none of them starves.
simulate_cpu_devices(8, keep_given=False)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from launch import compile_cache  # noqa: E402

# The first process of a session creates the directory (and removes it at exit); pytest-xdist's
# workers, started after it, inherit it through the environment and share it.
_CACHE = os.environ.get("HFJAX_TEST_XLA_CACHE")
if not _CACHE:
    _CACHE = os.environ["HFJAX_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="hfjax-tests-xla-")
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
compile_cache.enable(_CACHE)

jax.config.update("jax_enable_x64", False)
# The 8 simulated devices share the machine's cores: with async dispatch, programs with
# collectives that overlap in flight (worker groups on disjoint pools) can starve each other's
# participants and hang in an XLA CPU all-gather. launch/train.py does the same on CPU.
jax.config.update("jax_cpu_enable_async_dispatch", False)
assert jax.device_count() == 8, jax.devices()
