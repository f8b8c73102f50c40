"""Transfer protocols: how a worker-group method's inputs reach its mesh and outputs come back.

A protocol turns the controller's batch into arguments placed on the group's mesh (`dispatch`)
and turns the method's outputs back into what the controller sees (`collect`):

- `ONE_TO_ALL`: every device gets the whole input (replicated); outputs pass through.
- `DP_COMPUTE`: the batch axis is split over the mesh's data-parallel axes. The batch is padded
  to a multiple of the data-parallel size on dispatch and the padding is dropped on collect.
- `ALL_TO_ALL`: inputs and outputs pass through untouched; the method places them itself.

Worker methods are tagged with `@register(DP_COMPUTE)` so a worker group can look the protocol up.
Placement uses `hfjax.controller.batch.transfer`, so inputs already on devices move device to
device, never through the host.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import jax
from jax.sharding import Mesh, NamedSharding, Sharding

from hfjax.controller.batch import Batch
from hfjax.parallel.mesh import batch_sharding, dp_size, replicated

PROTOCOL_ATTR = "__hfjax_protocol__"

F = TypeVar("F", bound=Callable[..., Any])


class TransferProtocol(abc.ABC):
    """Base protocol: subclasses define the input sharding and the padding rule."""

    name: str = "protocol"

    @abc.abstractmethod
    def in_sharding(self, mesh: Mesh, batch: Batch | None = None) -> Sharding | None:
        """Returns the sharding every input array gets on `mesh`, or None to leave them as is."""

    def out_sharding(self, mesh: Mesh) -> Sharding | None:
        """Returns the sharding outputs are expected in (for jit out_shardings), or None."""
        return self.in_sharding(mesh)

    def pad_multiple(self, mesh: Mesh) -> int:
        """Returns the row count the batch must be a multiple of on `mesh`."""
        return 1

    def dispatch(self, batch: Any, mesh: Mesh) -> tuple[Any, int]:
        """Returns (inputs placed on `mesh`, rows of padding added).

        `batch` is a Batch, or any pytree of arrays sharing a leading batch axis (a dict of
        arrays, a single array); the result has the same structure.
        """
        as_batch, rebuild = _to_batch(batch)
        padded, pad = as_batch.pad_to_multiple(self.pad_multiple(mesh))
        sharding = self.in_sharding(mesh, padded)
        placed = padded if sharding is None else padded.to(sharding)
        return rebuild(placed), pad

    def collect(self, out: Any, pad: int) -> Any:
        """Returns `out` without the `pad` padding rows that dispatch added."""
        if pad == 0:
            return out
        as_batch, rebuild = _to_batch(out)
        return rebuild(as_batch.unpad(pad))

    def __repr__(self) -> str:
        return self.name


class OneToAll(TransferProtocol):
    """Replicates inputs onto every device of the mesh; outputs pass through."""

    name = "ONE_TO_ALL"

    def in_sharding(self, mesh: Mesh, batch: Batch | None = None) -> NamedSharding:
        """Returns the replicated sharding of `mesh`."""
        return replicated(mesh)


class DPCompute(TransferProtocol):
    """Splits the batch axis over the mesh's data-parallel axes, padding to a multiple first."""

    name = "DP_COMPUTE"

    def in_sharding(self, mesh: Mesh, batch: Batch | None = None) -> NamedSharding:
        """Returns the sharding splitting the leading axis over `dp_axes(mesh)`."""
        return batch_sharding(mesh)

    def pad_multiple(self, mesh: Mesh) -> int:
        """Returns `dp_size(mesh)`: each data-parallel rank gets the same number of rows."""
        return dp_size(mesh)


class AllToAll(TransferProtocol):
    """Passes inputs and outputs through unchanged; the method handles placement itself."""

    name = "ALL_TO_ALL"

    def in_sharding(self, mesh: Mesh, batch: Batch | None = None) -> None:
        """Returns None: inputs keep whatever sharding they have."""
        return None

    def dispatch(self, batch: Any, mesh: Mesh) -> tuple[Any, int]:
        """Returns (batch, 0) untouched."""
        return batch, 0


ONE_TO_ALL = OneToAll()
DP_COMPUTE = DPCompute()
ALL_TO_ALL = AllToAll()
PROTOCOLS: dict[str, TransferProtocol] = {p.name: p for p in (ONE_TO_ALL, DP_COMPUTE, ALL_TO_ALL)}


def get_protocol(name: str | TransferProtocol) -> TransferProtocol:
    """Returns the protocol object for a name such as "DP_COMPUTE" (case-insensitive)."""
    if isinstance(name, TransferProtocol):
        return name
    try:
        return PROTOCOLS[name.upper()]
    except (KeyError, AttributeError):
        raise ValueError(
            f"unknown transfer protocol {name!r}; use one of {', '.join(PROTOCOLS)}"
        ) from None


def register(protocol: TransferProtocol | str) -> Callable[[F], F]:
    """Returns a decorator that tags a worker method with `protocol` (see `protocol_of`)."""
    if callable(protocol) and not isinstance(protocol, TransferProtocol):
        raise TypeError("register needs a protocol: write @register(DP_COMPUTE), not @register")
    proto = get_protocol(protocol)

    def tag(fn: F) -> F:
        setattr(fn, PROTOCOL_ATTR, proto)
        return fn

    return tag


def protocol_of(fn: Callable[..., Any]) -> TransferProtocol | None:
    """Returns the protocol a method was registered with, or None if it wasn't."""
    # Bound methods forward attribute lookups to their function, so this works on both.
    return getattr(fn, PROTOCOL_ATTR, None)


def _to_batch(value: Any) -> tuple[Batch, Callable[[Batch], Any]]:
    """Returns (value as a Batch, function turning a Batch back into value's structure)."""
    if isinstance(value, Batch):
        return value, lambda b: b
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        keys = list(value)
        return Batch(dict(value)), lambda b: type(value)({k: b.arrays[k] for k in keys})
    leaves, treedef = jax.tree.flatten(value)
    names = [f"leaf{i}" for i in range(len(leaves))]
    return Batch(dict(zip(names, leaves))), lambda b: jax.tree.unflatten(
        treedef, [b.arrays[n] for n in names]
    )
