"""Batch: the unit of data that flows between models in the RLHF dataflow.

A Batch holds named arrays sharing one leading (batch) axis, host-side per-sample metadata
(ground truths, data sources, ...) in `meta`, and non-batched values in `info`. Array operations
on `jax.Array`s stay on device: slicing, concatenation, repetition and gathers run as XLA programs
and never fetch values to the host. Only `fetch` copies to the host, and only `take` (its index
vector) and `to` (host-side numpy arrays) copy from it, each explicitly.

`to` places every array with `hfjax.parallel.transfer.transfer`, the edge between two models:
device arrays move device to device, never through the host.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, Sharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from hfjax.parallel.mesh import batch_spec
from hfjax.parallel.reshard import ordered_devices
from hfjax.parallel.transfer import transfer

Array = jax.Array | np.ndarray
ShardingTarget = Sharding | Mesh | Mapping[str, Sharding] | Callable[[str, Array], Sharding]


class Batch:
    """Named arrays with a shared leading batch axis, plus host metadata and non-batched info.

    Every operation returns a new Batch; arrays are shared, never copied, where possible.
    """

    __slots__ = ("arrays", "meta", "info")

    def __init__(
        self,
        arrays: Mapping[str, Array] | None = None,
        meta: Mapping[str, Sequence[Any] | np.ndarray] | None = None,
        info: Mapping[str, Any] | None = None,
    ) -> None:
        self.arrays: dict[str, Array] = dict(arrays or {})
        self.meta: dict[str, np.ndarray] = {k: _as_meta(k, v) for k, v in (meta or {}).items()}
        self.info: dict[str, Any] = dict(info or {})
        self._validate()

    def _validate(self) -> None:
        both = sorted(set(self.arrays) & set(self.meta))
        if both:
            raise ValueError(
                f"batch keys {both} are both arrays and meta; a key names one or the other"
            )
        first: tuple[str, int] | None = None
        for kind, entries in (("array", self.arrays), ("meta", self.meta)):
            for key, value in entries.items():
                if kind == "array" and not isinstance(value, (jax.Array, np.ndarray)):
                    raise TypeError(
                        f"batch key {key!r} is a {type(value).__name__}; arrays must be "
                        "jax.Array or numpy arrays (put per-sample Python objects in meta)"
                    )
                if np.ndim(value) == 0:
                    raise ValueError(
                        f"batch {kind} {key!r} is a scalar; batched entries need a leading "
                        "batch axis (put non-batched values in info)"
                    )
                rows = int(value.shape[0])
                if first is None:
                    first = (key, rows)
                elif rows != first[1]:
                    raise ValueError(
                        f"batch {kind} {key!r} has {rows} rows but {first[0]!r} has {first[1]}; "
                        "every array and meta entry must share the leading batch axis"
                    )

    # ----------------------------------------------------------------------------------- access

    def __len__(self) -> int:
        for entries in (self.arrays, self.meta):
            for value in entries.values():
                return int(value.shape[0])
        return 0

    def __contains__(self, key: object) -> bool:
        return key in self.arrays or key in self.meta

    def __getitem__(self, key: str | slice | Sequence[int] | np.ndarray) -> Any:
        """Returns the array or meta entry named `key`, or for an index, `self.index(key)`."""
        if isinstance(key, str):
            if key in self.arrays:
                return self.arrays[key]
            if key in self.meta:
                return self.meta[key]
            raise KeyError(
                f"batch has no key {key!r}; arrays: {sorted(self.arrays)}, meta: "
                f"{sorted(self.meta)}"
            )
        return self.index(key)

    def keys(self) -> list[str]:
        """Returns the array keys, then the meta keys."""
        return [*self.arrays, *self.meta]

    def __repr__(self) -> str:
        arrays = ", ".join(f"{k}: {v.dtype}{list(v.shape)}" for k, v in self.arrays.items())
        return (
            f"Batch(len={len(self)}, arrays={{{arrays}}}, meta={sorted(self.meta)}, "
            f"info={sorted(self.info)})"
        )

    def fetch(self, keys: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """Returns host (numpy) copies of the named arrays (default all): a deliberate fetch."""
        keys = list(self.arrays) if keys is None else list(keys)
        missing = [k for k in keys if k not in self.arrays]
        if missing:
            raise KeyError(f"fetch: no arrays {missing}; arrays are {sorted(self.arrays)}")
        return {
            k: np.asarray(v) for k, v in jax.device_get({k: self.arrays[k] for k in keys}).items()
        }

    # ---------------------------------------------------------------------------- composition

    def select(
        self, keys: Iterable[str] | None = None, meta_keys: Iterable[str] | None = None
    ) -> Batch:
        """Returns a Batch with only `keys` (default all arrays) and `meta_keys` (default all)."""
        keys = list(self.arrays) if keys is None else list(keys)
        meta_keys = list(self.meta) if meta_keys is None else list(meta_keys)
        missing = [k for k in keys if k not in self.arrays]
        missing += [k for k in meta_keys if k not in self.meta]
        if missing:
            raise KeyError(
                f"select: no keys {missing}; arrays: {sorted(self.arrays)}, meta: "
                f"{sorted(self.meta)}"
            )
        return Batch(
            {k: self.arrays[k] for k in keys}, {k: self.meta[k] for k in meta_keys}, self.info
        )

    def union(self, other: Batch) -> Batch:
        """Returns a Batch with the entries of both; a key in both must hold the same object."""
        if self.arrays or self.meta:
            if (other.arrays or other.meta) and len(other) != len(self):
                raise ValueError(
                    f"union: batches have {len(self)} and {len(other)} rows; they must match"
                )
        arrays, meta = dict(self.arrays), dict(self.meta)
        for mine, theirs, kind in ((arrays, other.arrays, "array"), (meta, other.meta, "meta")):
            for key, value in theirs.items():
                if key in mine and mine[key] is not value:
                    raise ValueError(
                        f"union: {kind} {key!r} is in both batches with different values; "
                        "drop it from one side with select() first"
                    )
                mine[key] = value
        return Batch(arrays, meta, _merge_info(self.info, other.info, "union"))

    def split(self, size: int) -> list[Batch]:
        """Returns consecutive Batches of `size` rows; the last one holds the remainder."""
        if size <= 0:
            raise ValueError(f"split size must be positive, got {size}")
        return [self.index(slice(start, start + size)) for start in range(0, len(self), size)]

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Returns the Batches stacked along the batch axis; they must have the same keys."""
        batches = list(batches)
        if not batches:
            raise ValueError("concat needs at least one batch")
        first = batches[0]
        for i, b in enumerate(batches[1:], start=1):
            if set(b.arrays) != set(first.arrays) or set(b.meta) != set(first.meta):
                raise ValueError(
                    f"concat: batch {i} has keys {sorted(b.keys())}, batch 0 has "
                    f"{sorted(first.keys())}; select the same keys before concatenating"
                )
        info: dict[str, Any] = {}
        for b in batches:
            info = _merge_info(info, b.info, "concat")
        arrays = {k: _concat_rows([b.arrays[k] for b in batches]) for k in first.arrays}
        meta = {k: np.concatenate([b.meta[k] for b in batches]) for k in first.meta}
        return Batch(arrays, meta, info)

    # ------------------------------------------------------------------------------- indexing

    def index(self, idx: slice | Sequence[int] | np.ndarray) -> Batch:
        """Returns the rows picked by a slice, an integer index vector or a boolean mask."""
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step == 1:
                stop = max(start, stop)
                return self._map(lambda x: _slice_rows(x, start, stop), lambda m: m[start:stop])
            return self.take(np.arange(start, stop, step))
        if isinstance(idx, (int, np.integer)):
            raise TypeError(
                f"index({idx}) would drop the batch axis; use index(slice({idx}, {idx} + 1))"
            )
        return self.take(idx)

    def take(self, indices: Sequence[int] | np.ndarray) -> Batch:
        """Returns the rows at host-side `indices` (ints, negatives allowed, or a boolean mask).

        The index vector is copied to the arrays' devices explicitly; the gather runs there.
        """
        n = len(self)
        idx = np.asarray(indices)
        if idx.dtype == bool:
            if idx.shape != (n,):
                raise ValueError(f"boolean mask has shape {idx.shape}, batch has {n} rows")
            idx = np.flatnonzero(idx)
        if idx.ndim != 1 or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
            raise ValueError(f"take needs a 1-D integer index vector, got {idx.dtype}{idx.shape}")
        idx = idx.astype(np.int32)
        if idx.size and (idx.min() < -n or idx.max() >= n):
            raise IndexError(
                f"take: indices must lie in [-{n}, {n}), got [{idx.min()}, {idx.max()}]"
            )
        idx = np.where(idx < 0, idx + n, idx)
        return self._map(lambda x: _take_rows(x, idx), lambda m: m[idx])

    def repeat(self, n: int, interleave: bool = True) -> Batch:
        """Returns every row `n` times: consecutively (interleave, as GRPO groups) or tiled."""
        if n <= 0:
            raise ValueError(f"repeat count must be positive, got {n}")
        if interleave:
            meta_fn = lambda m: np.repeat(m, n, axis=0)
        else:
            meta_fn = lambda m: np.tile(m, (n,) + (1,) * (m.ndim - 1))
        return self._map(lambda x: _repeat_rows(x, n, interleave), meta_fn)

    def pad_to_multiple(self, k: int) -> tuple[Batch, int]:
        """Returns (batch padded to a multiple of `k` rows, pad count).

        Padding repeats rows from the start of the batch, so padded rows are real samples and
        never produce NaNs; `unpad(pad)` drops them again.
        """
        if k <= 0:
            raise ValueError(f"pad multiple must be positive, got {k}")
        n = len(self)
        pad = -n % k
        if pad == 0:
            return self, 0
        if n == 0:
            raise ValueError("cannot pad an empty batch: there are no rows to repeat")
        return self._map(lambda x: _pad_rows(x, pad), lambda m: _pad_rows(m, pad)), pad

    def unpad(self, pad: int) -> Batch:
        """Returns the batch without its last `pad` rows (the inverse of `pad_to_multiple`)."""
        if pad < 0 or pad > len(self):
            raise ValueError(f"unpad({pad}) on a batch of {len(self)} rows")
        return self if pad == 0 else self.index(slice(0, len(self) - pad))

    # ------------------------------------------------------------------------------ placement

    def to(self, target: ShardingTarget, batch_axes: str | Sequence[str] | None = None) -> Batch:
        """Returns the batch with every array placed by `transfer` onto `target`.

        `target` is a Sharding for all arrays; a Mesh, which splits the batch axis over
        `batch_axes` (default: the mesh's data-parallel axes; `()` replicates); a mapping
        {key: Sharding} (keys not in it stay put); or a function (key, array) -> Sharding.
        Meta and info stay on the host.
        """
        if isinstance(target, Mesh):
            spec = batch_spec(target) if batch_axes is None else _spec_for(batch_axes)
            sharding = NamedSharding(target, spec)
            pick: Callable[[str, Array], Sharding | None] = lambda k, x: sharding
        elif batch_axes is not None:
            raise TypeError("batch_axes is only meaningful when target is a Mesh")
        elif isinstance(target, Sharding):
            pick = lambda k, x: target
        elif isinstance(target, Mapping):
            pick = lambda k, x: target.get(k)
        elif callable(target):
            pick = target
        else:
            raise TypeError(f"cannot place a batch onto {target!r}; give a Sharding or Mesh")
        arrays = {}
        for key, x in self.arrays.items():
            sharding = pick(key, x)
            if sharding is None:
                arrays[key] = x
                continue
            try:
                sharding.shard_shape(x.shape)
            except ValueError as err:
                raise ValueError(
                    f"batch array {key!r} with shape {tuple(x.shape)} cannot be placed on "
                    f"{sharding}: {err}. Pad the batch first (pad_to_multiple)"
                ) from None
            arrays[key] = transfer(x, sharding)
        return Batch(arrays, self.meta, self.info)

    # -------------------------------------------------------------------------------- helpers

    def _map(
        self, array_fn: Callable[[Array], Array], meta_fn: Callable[[np.ndarray], Any]
    ) -> Batch:
        return Batch(
            {k: array_fn(v) for k, v in self.arrays.items()},
            {k: meta_fn(v) for k, v in self.meta.items()},
            self.info,
        )


def _spec_for(batch_axes: str | Sequence[str]) -> P:
    axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
    if not axes:
        return P()
    return P(axes[0] if len(axes) == 1 else axes)


# -------------------------------------------------------------------------------- row helpers


def _slice_rows(x: Array, start: int, stop: int) -> Array:
    if isinstance(x, jax.Array):
        # Static bounds: no index scalars are uploaded, unlike x[start:stop].
        return lax.slice_in_dim(x, start, stop, axis=0)
    return x[start:stop]


def _concat_rows(xs: Sequence[Array]) -> Array:
    if all(isinstance(x, np.ndarray) for x in xs):
        return np.concatenate(xs, axis=0)
    return jnp.concatenate(xs, axis=0)


@functools.partial(jax.jit, static_argnames=("n", "interleave"))
def _repeat_rows_jax(x: jax.Array, n: int, interleave: bool) -> jax.Array:
    if interleave:
        return jnp.repeat(x, n, axis=0, total_repeat_length=x.shape[0] * n)
    return jnp.tile(x, (n,) + (1,) * (x.ndim - 1))


def _repeat_rows(x: Array, n: int, interleave: bool) -> Array:
    if isinstance(x, jax.Array):
        return _repeat_rows_jax(x, n, interleave)
    if interleave:
        return np.repeat(x, n, axis=0)
    return np.tile(x, (n,) + (1,) * (x.ndim - 1))


@jax.jit
def _take_rows_jax(x: jax.Array, idx: jax.Array) -> jax.Array:
    return jnp.take(x, idx, axis=0)


def _take_rows(x: Array, idx: np.ndarray) -> Array:
    if not isinstance(x, jax.Array):
        return x[idx]
    src = x.sharding
    if isinstance(src, NamedSharding):
        where: Sharding = NamedSharding(src.mesh, P())
    else:
        devices = ordered_devices(src)
        if devices is None or len(devices) != 1:
            return jnp.take(x, jnp.asarray(idx), axis=0)
        where = SingleDeviceSharding(devices[0])
    # The one deliberate upload: a small index vector, replicated next to the data. It is
    # allowed even under a transfer guard that bans host copies to catch accidental ones.
    with jax.transfer_guard("allow"):
        placed = jax.device_put(idx, where)
    return _take_rows_jax(x, placed)


def _pad_rows(x: Array, pad: int) -> Array:
    n = int(x.shape[0])
    pieces = [x]
    while pad > 0:
        k = min(n, pad)
        pieces.append(_slice_rows(x, 0, k))
        pad -= k
    return _concat_rows(pieces)


# ------------------------------------------------------------------------------- meta and info


def _as_meta(key: str, value: Sequence[Any] | np.ndarray) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, jax.Array):
        raise TypeError(f"meta {key!r} is a jax.Array; device arrays belong in arrays, not meta")
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"meta {key!r} must be a per-sample list or numpy array, got {value!r}")
    # Element by element, so a list of lists stays a 1-D array of lists.
    out = np.empty(len(value), dtype=object)
    for i, item in enumerate(value):
        out[i] = item
    return out


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except (ValueError, TypeError):
        return False


def _merge_info(a: Mapping[str, Any], b: Mapping[str, Any], op: str) -> dict[str, Any]:
    out = dict(a)
    for key, value in b.items():
        if key in out and not _same(out[key], value):
            raise ValueError(
                f"{op}: info {key!r} differs between batches ({out[key]!r} vs {value!r}); "
                "make them agree or drop one"
            )
        out[key] = value
    return out
