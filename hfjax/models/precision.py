"""Which compute precision pays on the hardware at hand.

Master weights and optimizer state stay float32 (`ModelConfig.param_dtype`); the compute dtype
(`ModelConfig.dtype`) is what the matmuls run in. bfloat16 compute pays on GPUs and TPUs, and
on x86 CPUs whose cores multiply bfloat16 natively: AMX tile units (Intel Xeon since Sapphire
Rapids, `amx_bf16` in /proc/cpuinfo) or AVX-512 bfloat16 dot products (AMD EPYC since Zen 4,
Intel since Cooper Lake, `avx512_bf16`). There XLA's bfloat16 matmuls with float32
accumulation run 1.7-3.5x faster than its float32 ones at the model's sizes
(bench/precision_matmul.py: 2.4-3.5x on a Xeon with AMX, 1.8-2.2x on a Zen 5 EPYC); elsewhere
bfloat16 is emulated and gains nothing.
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


# The /proc/cpuinfo flags of native bfloat16 multiplies: AMX tiles, AVX-512 dot products.
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def native_bf16_flags(cpuinfo: str | None = None) -> tuple[str, ...]:
    """Which of NATIVE_BF16_FLAGS the CPU reports (empty: bfloat16 is emulated)."""
    flags = cpu_flags(cpuinfo)
    return tuple(f for f in NATIVE_BF16_FLAGS if f in flags)


COMPUTE_DTYPES = ("float32", "bfloat16", "auto")


# The smallest hidden size at which `auto` picks bfloat16 on a CPU with native bfloat16
# multiplies. Measured on an Intel Xeon with amx_bf16 (docs/benchmarks.md, "Mixed precision
# in the trainer" and "Training stages in the GRPO recipe"): bfloat16 compute made
# SmolLM2-135M (hidden 576) decode 1.47x and its gsm_symbolic GRPO step 1.41x faster, and the
# default task's model (hidden 128) 0.94x as fast, its matmuls too small to repay the casts.
BF16_MIN_HIDDEN = 512
