"""JAX's persistent compilation cache for the entry points, on by default.

Compiled XLA programs are written to a directory and read back by any later process that
compiles the same program on the same kind of devices: a run resumed after preemption, or a
second `launch.generate`, skips compiling what an earlier process compiled.

Every entry point that compiles uses it, through this one helper: launch.train, evaluate, sft,
train_rm and train_dpo take the setting from `--config.trainer.compilation_cache_dir`
(`cli.start_run`), launch.generate, convert and export from `--compilation_cache_dir`
(`cli.run`). The setting is
- `auto` (the default): `$JAX_COMPILATION_CACHE_DIR` when set, else `~/.cache/hfjax/xla` (under
  `$XDG_CACHE_HOME` when set); `HFJAX_COMPILATION_CACHE=off` in the environment turns `auto`
  off for every entry point at once;
- `off`: no persistent cache;
- any other value: that directory (created when missing).
"""

from __future__ import annotations

import os

# Programs that compile faster than this are not written. JAX's default (1 s) leaves out most of
# a small model's programs, which each compile in well under a second but together take most of
# a short run's start-up; reading one back costs milliseconds, so every program is kept.
MIN_COMPILE_S = 0.0
# JAX evicts the least recently used entries beyond this size.
MAX_BYTES = 4 << 30


# `HFJAX_COMPILATION_CACHE=off` turns the `auto` setting off.
OFF_ENV = "HFJAX_COMPILATION_CACHE"


def default_dir() -> str:
    """The `auto` directory: $JAX_COMPILATION_CACHE_DIR, else ~/.cache/hfjax/xla."""
    env = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hfjax", "xla")


def enable(setting: str, name: str = "compilation_cache_dir") -> str | None:
    """Applies a cache setting (see the module docstring) before anything compiles; returns
    the directory in use, or None when the cache is off. ValueError, naming the setting
    `name`, when the directory cannot be used."""
    import jax

    if setting == "auto" and os.environ.get(OFF_ENV, "").strip().lower() == "off":
        setting = "off"
    if setting == "off":
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    directory = os.path.abspath(os.path.expanduser(default_dir() if setting == "auto"
                                                   else setting))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as err:
        raise ValueError(f"{name}={setting}: cannot use {directory} as the compilation cache "
                         f"({err.strerror}); give another directory, or 'off'") from None
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", directory)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_S)
    if "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ:
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return directory
