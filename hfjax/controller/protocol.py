"""Transfer protocols: how a worker-group method's inputs reach it and its outputs come back.

A protocol owns both directions of a call. `dispatch` turns the caller's batch into the
method's inputs, placed where the method computes; `collect` turns the method's output back
into what the caller sees, on the caller's mesh (the `home` mesh the dataflow names):

- `DP_COMPUTE`: the batch axis is split over the group's data-parallel axes. The batch is padded
  to a multiple of the data-parallel size on dispatch; the padding is dropped on collect.
- `ON_HOST`: the method computes on the host (rule rewards, generation from host prompts).
  Inputs are fetched to the host, whole even when they span processes; outputs are placed on
  the caller's mesh.

Outputs that are Batches come back split over the home mesh's batch axes, device to device
(`hfjax.parallel.transfer`), or uploaded once for host outputs; anything else (metrics) is
returned as is. A driver therefore never places data itself.

Methods are tagged with `@method(PROTOCOL, reads=...)`: `reads` names the arrays the method
needs, so only those travel to its mesh.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import jax
from jax.sharding import Mesh, NamedSharding, Sharding

from hfjax.controller.batch import Batch
from hfjax.parallel.mesh import batch_sharding, dp_size, replicated
from hfjax.parallel.transfer import to_host

PROTOCOL_ATTR = "__hfjax_protocol__"

F = TypeVar("F", bound=Callable[..., Any])


class TransferProtocol(abc.ABC):
    """Base protocol: subclasses define where inputs go and the padding rule."""

    name: str = "protocol"

    @abc.abstractmethod
    def in_sharding(self, mesh: Mesh) -> Sharding | None:
        """Returns the sharding every input array gets on `mesh` (None: the host)."""

    def pad_multiple(self, mesh: Mesh) -> int:
        """Returns the row count the batch must be a multiple of on `mesh`."""
        return 1

    def dispatch(self, batch: Any, mesh: Mesh | None) -> tuple[Any, int]:
        """Returns (inputs placed on `mesh`, rows of padding added).

        `batch` is a Batch, or any pytree of arrays sharing a leading batch axis (a dict of
        arrays, a single array); the result has the same structure.
        """
        as_batch, rebuild = _to_batch(batch)
        padded, pad = as_batch.pad_to_multiple(self.pad_multiple(mesh))
        return rebuild(padded.to(self.in_sharding(mesh))), pad

    def collect(self, out: Any, pad: int, home: Mesh | None = None) -> Any:
        """Returns `out` without the `pad` padding rows that dispatch added, split over the
        batch axes of `home` when one is given."""
        if pad == 0 and home is None:
            return out
        as_batch, rebuild = _to_batch(out)
        if pad:
            as_batch = as_batch.unpad(pad)
        if home is not None:
            rows = batch_sharding(home)
            if len(as_batch) % dp_size(home):
                rows = replicated(home)  # e.g. a validation set that doesn't split evenly
            with jax.transfer_guard("allow"):  # host outputs: the method's deliberate upload
                as_batch = as_batch.to(rows)
        return rebuild(as_batch)

    def __repr__(self) -> str:
        return self.name


class DPCompute(TransferProtocol):
    """Splits the batch axis over the mesh's data-parallel axes, padding to a multiple first."""

    name = "DP_COMPUTE"

    def in_sharding(self, mesh: Mesh) -> NamedSharding:
        """Returns the sharding splitting the leading axis over `dp_axes(mesh)`."""
        return batch_sharding(mesh)

    def pad_multiple(self, mesh: Mesh) -> int:
        """Returns `dp_size(mesh)`: each data-parallel rank gets the same number of rows."""
        return dp_size(mesh)


class OnHost(TransferProtocol):
    """Fetches inputs to the host (whole, across processes); outputs go to the caller's mesh."""

    name = "ON_HOST"

    def in_sharding(self, mesh: Mesh | None) -> None:
        """Returns None: inputs live on the host."""
        return None

    def dispatch(self, batch: Any, mesh: Mesh | None) -> tuple[Any, int]:
        """Returns (batch with host copies of its arrays, 0): the method's deliberate fetch."""
        as_batch, rebuild = _to_batch(batch)
        host = {k: to_host(v) for k, v in as_batch.arrays.items()}
        return rebuild(Batch(host, as_batch.meta, as_batch.info)), 0


DP_COMPUTE = DPCompute()
ON_HOST = OnHost()
PROTOCOLS: dict[str, TransferProtocol] = {p.name: p for p in (DP_COMPUTE, ON_HOST)}


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


def method(
    protocol: TransferProtocol | str,
    *,
    reads: Sequence[str] | None = None,
    may_read: Sequence[str] = (),
) -> Callable[[F], F]:
    """Decorator for a worker-group method `fn(self, batch, ...)`: its batch is dispatched by
    `protocol` onto `self.mesh` and a Batch it returns is collected onto `self.home` (the mesh
    the dataflow keeps its batch on; None leaves outputs where the method put them).

    `reads` names the arrays the method needs (a missing one is an error naming it) and
    `may_read` the ones it uses when present; with neither, every array travels. Meta (host
    data) always comes along.
    """
    if callable(protocol) and not isinstance(protocol, TransferProtocol):
        raise TypeError("method needs a protocol: write @method(DP_COMPUTE), not @method")
    proto = get_protocol(protocol)

    def deco(fn: F) -> F:
        @functools.wraps(fn)
        def wrapped(self, batch: Batch, *args, **kwargs):
            if reads is not None:
                batch = _select(batch, reads, may_read, f"{type(self).__name__}.{fn.__name__}")
            placed, pad = proto.dispatch(batch, self.mesh)
            out = fn(self, placed, *args, **kwargs)
            if not isinstance(out, Batch):
                return out
            # A method that returns k rows per input row (n samples per prompt) drops k * pad.
            rows = pad * (len(out) // len(placed)) if pad else 0
            return proto.collect(out, rows, getattr(self, "home", None))

        setattr(wrapped, PROTOCOL_ATTR, proto)
        return wrapped  # type: ignore[return-value]

    return deco


def protocol_of(fn: Callable[..., Any]) -> TransferProtocol | None:
    """Returns the protocol a method was declared with, or None if it wasn't."""
    # Bound methods forward attribute lookups to their function, so this works on both.
    return getattr(fn, PROTOCOL_ATTR, None)


def _select(batch: Batch, reads: Sequence[str], may_read: Sequence[str], who: str) -> Batch:
    missing = [k for k in reads if k not in batch.arrays]
    if missing:
        raise KeyError(f"{who} needs batch arrays {missing}; the batch has {sorted(batch.arrays)}")
    keys = list(reads) + [k for k in may_read if k in batch.arrays and k not in reads]
    return batch.select(keys)


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
