"""Which compute precision pays on the hardware at hand.

Master weights and optimizer state stay float32 (`ModelConfig.param_dtype`); the compute dtype
(`ModelConfig.dtype`) is what the matmuls run in. bfloat16 compute pays on GPUs and TPUs, and
on x86 CPUs only where the cores have AMX bfloat16 tile units (Intel Xeon since Sapphire
Rapids, `amx_bf16` in /proc/cpuinfo): there XLA's bfloat16 matmuls run 2-3x faster than its
float32 ones (bench/precision_matmul.py), while elsewhere bfloat16 is emulated and gains
nothing.
"""

from __future__ import annotations

import functools
import os

CPUINFO = "/proc/cpuinfo"


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The feature flags of the first processor in a /proc/cpuinfo text (default: this host's).

    Empty where there is no /proc/cpuinfo (not Linux) or it lists no flags.
    """
    if cpuinfo is None:
        cpuinfo = _host_cpuinfo()
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


@functools.lru_cache(maxsize=1)
def _host_cpuinfo() -> str:
    if not os.path.exists(CPUINFO):
        return ""
    with open(CPUINFO) as f:
        return f.read()


def cpu_has_amx_bf16(cpuinfo: str | None = None) -> bool:
    """True when the CPU has AMX bfloat16 tile multiplies (`amx_bf16` flag)."""
    return "amx_bf16" in cpu_flags(cpuinfo)


def suggested_compute_dtype(platform: str, cpuinfo: str | None = None) -> str:
    """'bfloat16' where bf16 matmuls are native (GPU, TPU, CPU with AMX bf16), else 'float32'.

    `platform` is a JAX platform name, e.g. `jax.devices()[0].platform`.
    """
    if platform in ("gpu", "cuda", "rocm", "tpu"):
        return "bfloat16"
    if platform == "cpu" and cpu_has_amx_bf16(cpuinfo):
        return "bfloat16"
    return "float32"
