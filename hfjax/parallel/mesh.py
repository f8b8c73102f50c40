"""Resource pools and device meshes.

A resource pool is a named, disjoint slice of the devices. A worker group places one model on one
pool by building a `jax.sharding.Mesh` over it from a `MeshSpec` such as ``"fsdp=4,tensor=2"``.
Every mesh carries all of the canonical axes (absent ones have size 1), so sharding rules may name
any axis without checking whether the current mesh uses it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

# Order matters: the last axis varies fastest over the pool's device list, so `tensor` groups are
# consecutive devices (same host, fastest links), and `data` groups are the farthest apart.
MESH_AXES: tuple[str, ...] = ("data", "fsdp", "expert", "sequence", "tensor")
# Axes over which a batch is split: every device along them sees different samples. `expert`
# splits a mixture of experts' experts and, for everything else, the batch
# (`hfjax.models.expert_parallel`).
DP_AXES: tuple[str, ...] = ("data", "fsdp", "expert")

_ITEM = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(-?\d+)\s*$")


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Axis sizes for a mesh, as parsed from a flag string like ``"fsdp=-1,tensor=2"``.

    `sizes` maps each canonical axis to its size; absent axes are 1 and at most one axis may be
    -1, meaning "whatever is left of the pool".
    """

    sizes: tuple[tuple[str, int], ...]
    text: str

    @classmethod
    def parse(cls, text: str | MeshSpec) -> MeshSpec:
        """Parses ``"name=size,..."``; returns a MeshSpec with every canonical axis present."""
        if isinstance(text, MeshSpec):
            return text
        if not isinstance(text, str):
            raise TypeError(f"mesh spec must be a string like 'fsdp=4,tensor=2', got {text!r}")
        if not text.strip():
            raise ValueError("empty mesh spec; write e.g. 'fsdp=-1' or 'data=2,tensor=4'")
        given: dict[str, int] = {}
        for item in text.split(","):
            match = _ITEM.match(item)
            if match is None:
                raise ValueError(
                    f"mesh {text!r}: cannot parse {item.strip()!r}; write comma-separated "
                    "'axis=size' items, e.g. 'fsdp=4,tensor=2'"
                )
            name, size = match.group(1), int(match.group(2))
            if name not in MESH_AXES:
                raise ValueError(
                    f"mesh {text!r}: unknown axis {name!r}; valid axes are {', '.join(MESH_AXES)}"
                )
            if name in given:
                raise ValueError(f"mesh {text!r}: axis {name!r} is given twice; give it once")
            if size == 0 or size < -1:
                raise ValueError(
                    f"mesh {text!r}: axis {name!r} has size {size}; sizes must be positive, "
                    "or -1 for 'the rest of the pool'"
                )
            given[name] = size
        fill = [name for name, size in given.items() if size == -1]
        if len(fill) > 1:
            raise ValueError(
                f"mesh {text!r}: axes {', '.join(fill)} are all -1; at most one axis may be -1, "
                "give the others explicit sizes"
            )
        sizes = tuple((name, given.get(name, 1)) for name in MESH_AXES)
        return cls(sizes=sizes, text=text.replace(" ", ""))

    def resolve(self, n_devices: int, pool: str | None = None) -> dict[str, int]:
        """Returns the size of every canonical axis, filling -1 so the product is `n_devices`."""
        where = f"pool {pool!r}" if pool is not None else "the pool"
        sizes = dict(self.sizes)
        fill = [name for name, size in sizes.items() if size == -1]
        fixed = math.prod(size for size in sizes.values() if size != -1)
        if fill:
            if n_devices % fixed:
                raise ValueError(
                    f"mesh {self.text!r}: the fixed axes need a multiple of {fixed} devices, "
                    f"{where} has {n_devices}; pick sizes whose product divides {n_devices}"
                )
            sizes[fill[0]] = n_devices // fixed
        elif fixed != n_devices:
            raise ValueError(
                f"mesh {self.text!r} needs {fixed} devices, {where} has {n_devices}; make the "
                f"sizes multiply to {n_devices}, or set one axis to -1"
            )
        return sizes

    def build(self, devices: Sequence[Any], pool: str | None = None) -> Mesh:
        """Returns a Mesh over `devices` (in the given order) with every canonical axis, Auto."""
        sizes = self.resolve(len(devices), pool)
        grid = np.asarray(list(devices), dtype=object).reshape(tuple(sizes.values()))
        # Auto axes let jit's partitioner propagate shardings; explicit axes (a possible default
        # in newer JAX) would require every op to state its output sharding.
        return Mesh(grid, tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes))

    def __str__(self) -> str:
        return self.text


def _device_key(device: Any) -> tuple[int, int]:
    return (getattr(device, "process_index", 0), device.id)


def sorted_devices(devices: Sequence[Any] | None = None) -> list[Any]:
    """Returns `devices` (default: all) ordered by (process_index, id), so hosts stay together."""
    devices = jax.devices() if devices is None else devices
    return sorted(devices, key=_device_key)


@dataclasses.dataclass(frozen=True)
class ResourcePool:
    """A named set of devices. Models whose roles share a pool are colocated and time-share it."""

    name: str
    devices: tuple[Any, ...]

    def __post_init__(self) -> None:
        if not self.devices:
            raise ValueError(f"pool {self.name!r} has no devices; give it a positive size")
        ids = [d.id for d in self.devices]
        if len(set(ids)) != len(ids):
            raise ValueError(f"pool {self.name!r} lists a device twice: ids {ids}")

    @property
    def size(self) -> int:
        """Returns the number of devices in the pool."""
        return len(self.devices)

    @property
    def device_ids(self) -> tuple[int, ...]:
        """Returns the ids of the pool's devices, in pool order."""
        return tuple(d.id for d in self.devices)

    def mesh(self, spec: MeshSpec | str) -> Mesh:
        """Returns a Mesh over this pool's devices with the axis sizes of `spec`."""
        return MeshSpec.parse(spec).build(self.devices, pool=self.name)


def carve_pools(
    sizes: Mapping[str, int], devices: Sequence[Any] | None = None
) -> dict[str, ResourcePool]:
    """Carves disjoint consecutive device slices; returns {name: ResourcePool} in `sizes` order.

    Devices are ordered by (process_index, id). Larger pools are carved first: with power-of-two
    pool and host sizes this makes every pool of at least a host's size consist of whole hosts, so
    its collectives stay on fast intra-host links where they can.
    """
    devices = sorted_devices(devices)
    for name, size in sizes.items():
        if not isinstance(size, (int, np.integer)) or size <= 0:
            raise ValueError(f"pool {name!r} has size {size!r}; pool sizes must be positive ints")
    total = sum(sizes.values())
    if total > len(devices):
        listing = ", ".join(f"{name}={size}" for name, size in sizes.items())
        raise ValueError(
            f"pools ({listing}) need {total} devices, only {len(devices)} are available; "
            "shrink the pools or colocate some roles"
        )
    order = sorted(sizes, key=lambda name: -sizes[name])  # stable: ties keep the caller's order
    start = 0
    carved: dict[str, ResourcePool] = {}
    for name in order:
        carved[name] = ResourcePool(name, tuple(devices[start : start + sizes[name]]))
        start += sizes[name]
    return {name: carved[name] for name in sizes}


def dp_axes(mesh: Mesh) -> tuple[str, ...]:
    """Returns the batch-splitting axes (data, fsdp, expert) of `mesh` that have size > 1."""
    return tuple(a for a in DP_AXES if mesh.shape.get(a, 1) > 1)


def dp_size(mesh: Mesh) -> int:
    """Returns how many ways a batch is split on `mesh` (product of its data-parallel axes)."""
    return math.prod(mesh.shape[a] for a in dp_axes(mesh))


def batch_spec(mesh: Mesh) -> P:
    """Returns the PartitionSpec that splits the leading (batch) axis over `dp_axes(mesh)`."""
    axes = dp_axes(mesh)
    if not axes:
        return P()
    return P(axes[0] if len(axes) == 1 else axes)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Returns a NamedSharding splitting the leading axis over the data-parallel axes of `mesh`."""
    return NamedSharding(mesh, batch_spec(mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    """Returns a NamedSharding that places a full copy on every device of `mesh`."""
    return NamedSharding(mesh, P())
