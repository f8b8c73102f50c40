"""What the entry points share."""

import os


def setup_devices(n: int) -> None:
    """Simulates `n` CPU devices (0: leaves XLA_FLAGS alone); call before importing jax."""
    if n and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
        )
