"""Accelerators a run can be planned for: memory, peak bf16 compute and bandwidths per device.

The dry run compares each program's per-device bytes with `memory_bytes`, and a planner can
turn FLOPs and bytes into time with the peaks. Figures are the vendors' published ones, per
device (one GPU, one TPU chip):

- memory in the vendor's decimal gigabytes (1 GB = 1e9 bytes), which is at or below the
  physical capacity; the runtime keeps some of it for itself, so a plan should leave headroom;
- bf16 compute is dense: NVIDIA's headline Hopper/Ampere Tensor Core figures assume 2:4
  structured sparsity and are halved here;
- interconnect bandwidth is the device's total over all its links in both directions, on the
  link named in `interconnect`: NVLink between GPUs of one node (between nodes, InfiniBand or
  Ethernet is slower), ICI between TPU chips of one slice.
"""

from __future__ import annotations

import dataclasses

GB = 10**9
TB = 10**12


@dataclasses.dataclass(frozen=True)
class Target:
    """One device model's published figures."""

    name: str
    description: str
    memory_bytes: int
    bf16_flops: float  # peak dense bf16 matmul FLOP/s
    memory_bandwidth: float  # HBM bytes/s
    interconnect_bandwidth: float  # bytes/s per device, both directions, over `interconnect`
    interconnect: str
    source: str  # the public specification the figures come from
    platform: str = "gpu"  # the JAX platform of the device: "gpu", "tpu" or "cpu"

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / 2**30


TARGETS: dict[str, Target] = {
    # NVIDIA H100 Tensor Core GPU datasheet, SXM5 column: 80 GB HBM3, 3.35 TB/s,
    # BF16 Tensor Core 1,979 TFLOPS with sparsity, NVLink 900 GB/s.
    "h100": Target(
        "h100", "NVIDIA H100 SXM5 80 GB", 80 * GB, 989.5e12, 3.35 * TB, 900 * GB,
        "NVLink 4 (18 links)", "NVIDIA H100 Tensor Core GPU datasheet (SXM5)"),
    # NVIDIA H200 Tensor Core GPU datasheet, SXM column: 141 GB HBM3e, 4.8 TB/s, BF16 Tensor
    # Core 1,979 TFLOPS with sparsity (the H100's compute), NVLink 900 GB/s.
    "h200": Target(
        "h200", "NVIDIA H200 SXM 141 GB", 141 * GB, 989.5e12, 4.8 * TB, 900 * GB,
        "NVLink 4 (18 links)", "NVIDIA H200 Tensor Core GPU datasheet (SXM)"),
    # NVIDIA A100 Tensor Core GPU datasheet, SXM columns: BF16 Tensor Core 312 TFLOPS dense
    # (624 with sparsity), NVLink 600 GB/s; 40 GB HBM2 at 1,555 GB/s, 80 GB HBM2e at
    # 2,039 GB/s.
    "a100-40gb": Target(
        "a100-40gb", "NVIDIA A100 SXM4 40 GB", 40 * GB, 312e12, 1555 * GB, 600 * GB,
        "NVLink 3 (12 links)", "NVIDIA A100 Tensor Core GPU datasheet (SXM 40GB)"),
    "a100-80gb": Target(
        "a100-80gb", "NVIDIA A100 SXM4 80 GB", 80 * GB, 312e12, 2039 * GB, 600 * GB,
        "NVLink 3 (12 links)", "NVIDIA A100 Tensor Core GPU datasheet (SXM 80GB)"),
    # Google Cloud TPU documentation, "TPU v5e" system architecture: 197 TFLOPs bf16 per
    # chip, 16 GB HBM2 at 819 GBps, 400 GBps bidirectional ICI per chip.
    "v5e": Target(
        "v5e", "Google Cloud TPU v5e chip", 16 * GB, 197e12, 819 * GB, 400 * GB,
        "ICI (4 ports, 2D torus)", "Cloud TPU documentation: TPU v5e", "tpu"),
    # Google Cloud TPU documentation, "TPU v5p": 459 TFLOPs bf16 per chip, 95 GB HBM2e at
    # 2765 GBps, 1200 GBps bidirectional ICI per chip.
    "v5p": Target(
        "v5p", "Google Cloud TPU v5p chip", 95 * GB, 459e12, 2765 * GB, 1200 * GB,
        "ICI (3D torus)", "Cloud TPU documentation: TPU v5p", "tpu"),
    # Google Cloud TPU documentation, "TPU v6e" (Trillium): 918 TFLOPs bf16 per chip, 32 GB
    # HBM at 1638 GBps, 800 GBps bidirectional ICI per chip.
    "v6e": Target(
        "v6e", "Google Cloud TPU v6e (Trillium) chip", 32 * GB, 918e12, 1638 * GB, 800 * GB,
        "ICI (4 ports, 2D torus)", "Cloud TPU documentation: TPU v6e", "tpu"),
}

# Other spellings people use on the command line.
ALIASES = {
    "h100-80gb": "h100", "h100-sxm": "h100", "h200-141gb": "h200", "h200-sxm": "h200",
    "a100-40g": "a100-40gb", "a100-80g": "a100-80gb",
    "tpu-v5e": "v5e", "v5litepod": "v5e", "tpu-v5p": "v5p", "tpu-v6e": "v6e",
    "trillium": "v6e",
}


def get_target(name: str) -> Target:
    """The Target named `name` (case-insensitive, common aliases accepted).

    Raises ValueError listing the known targets.
    """
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in TARGETS:
        raise ValueError(f"unknown target {name!r}; known targets: {', '.join(TARGETS)} "
                         "(figures per device: one GPU or one TPU chip)")
    return TARGETS[key]


# Peak dense bf16 FLOP/s per device, by the `device_kind` JAX reports, most specific first.
# TPU v4: Cloud TPU documentation, "TPU v4" (275 TFLOPs bf16 per chip); the others are the
# targets' figures above. CPUs have none here: their peak depends on the part and its vector
# units, so no MFU is reported on CPU.
_PEAK_BY_KIND = (
    ("h200", TARGETS["h200"].bf16_flops), ("h100", TARGETS["h100"].bf16_flops),
    ("a100", TARGETS["a100-80gb"].bf16_flops), ("v6 lite", TARGETS["v6e"].bf16_flops),
    ("v6e", TARGETS["v6e"].bf16_flops), ("v5 lite", TARGETS["v5e"].bf16_flops),
    ("v5e", TARGETS["v5e"].bf16_flops), ("v5p", TARGETS["v5p"].bf16_flops),
    ("v5", TARGETS["v5p"].bf16_flops), ("v4", 275e12),
)


def peak_flops(device_kind: str) -> float | None:
    """Peak dense bf16 FLOP/s of one device of `device_kind` (e.g. "NVIDIA H200", "TPU v5
    lite"); None when unknown (CPUs, other accelerators)."""
    kind = device_kind.lower()
    for key, flops in _PEAK_BY_KIND:
        if key in kind:
            return flops
    return None
