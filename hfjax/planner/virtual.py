"""Layouts over virtual devices: what each device of a mesh larger than this machine holds, and
what the 3D-HybridEngine's transition moves there.

The planner prices meshes of hundreds of devices on a machine that has a handful. A JAX
`NamedSharding` needs real devices, so this module rebuilds the boxes that matter itself:

- `leaf_specs` applies the runs' own layout rules (`hfjax.parallel.sharding.Layout.spec` on a
  `jax.sharding.AbstractMesh`), so an indivisible dimension fails here exactly as it would in a
  run, and KV heads that a tensor size does not divide are replicated here as they are there;
- `VirtualSharding` turns per-leaf mesh-axis tuples on a mesh of virtual device ids into the
  `devices_indices_map` that `hfjax.parallel.reshard` reads;
- `transition_bytes` lays the decode boxes out in the engine's device order (the decode tensor
  group of a device follows from its split index, see `hfjax.engine.hybrid`) and counts what
  each device receives with `reshard.tree_transfer_bytes`, the function the engine itself uses.

Meshes follow `hfjax.parallel.mesh`: axes (data, fsdp, expert, sequence, tensor), the last varying
fastest over the device ids.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh

from hfjax.engine import nesting
from hfjax.parallel import reshard
from hfjax.parallel import sharding as shd
from hfjax.parallel.mesh import MESH_AXES

Entry = tuple[str, ...]  # the mesh axes that split one dimension, outer first


class NoNesting(ValueError):
    """The training layout's shards cannot lie inside the decode layout's (the engine's
    LayoutError, found without building the engine)."""


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One parameter: name, shape, dtype and logical axes (None: replicated everywhere)."""

    name: str
    shape: tuple[int, ...]
    dtype: Any
    axes: tuple[str | None, ...] | None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def leaves_of(state: Any) -> tuple[Leaf, ...]:
    """The Leafs of an nnx State of Params (abstract or real), in flattened order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(state, is_leaf=shd.is_variable)
    out = []
    for path, var in flat:
        value = shd.leaf_value(var)
        axes = var.get_metadata().get("logical_axes") if shd.is_variable(var) else None
        out.append(Leaf(shd._path_name(path), tuple(value.shape), value.dtype,
                        None if axes is None else tuple(axes)))
    return tuple(out)


def mesh_sizes(data: int = 1, fsdp: int = 1, tensor: int = 1, sequence: int = 1,
               expert: int = 1) -> dict[str, int]:
    """{axis: size} for every canonical mesh axis."""
    return {"data": data, "fsdp": fsdp, "expert": expert, "sequence": sequence,
            "tensor": tensor}


def _entries(spec, ndim: int) -> list[Entry]:
    out = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]
    return out + [()] * (ndim - len(out))


def leaf_specs(leaves: Sequence[Leaf], rules: str | Mapping[str, Any],
               sizes: Mapping[str, int]) -> list[list[Entry]]:
    """Per leaf, per dimension, the mesh axes that split it under `rules` on a mesh of `sizes`.

    Raises ValueError (from `Layout.spec`) naming the tensor when a mesh axis does not divide a
    dimension that may not be replicated.
    """
    mesh = AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES)
    lay = shd.layout(mesh, rules)
    return [
        [()] * len(leaf.shape) if leaf.axes is None
        else _entries(lay.spec(leaf.axes, leaf.shape, leaf.name), len(leaf.shape))
        for leaf in leaves
    ]


def shard_elements(leaf: Leaf, entries: Sequence[Entry], sizes: Mapping[str, int]) -> int:
    """Elements of `leaf` on one device when dimension i is split over `entries[i]` (every
    device holds the same amount: the rules only split dimensions the axes divide)."""
    return math.prod(dim // math.prod(sizes[a] for a in e) for dim, e in zip(leaf.shape, entries))


def shard_bytes(leaves: Sequence[Leaf], specs: Sequence[Sequence[Entry]],
                sizes: Mapping[str, int]) -> int:
    """Bytes one device holds of all `leaves` laid out by `specs` on a mesh of `sizes`."""
    return sum(shard_elements(leaf, e, sizes) * np.dtype(leaf.dtype).itemsize
               for leaf, e in zip(leaves, specs))


@dataclasses.dataclass(frozen=True)
class VirtualDevice:
    """A device that exists only as an id (what `reshard.boxes` reads of a device)."""

    id: int


def _block(coords: Mapping[str, int], sizes: Mapping[str, int], axes: Entry) -> int:
    index = 0
    for a in axes:
        index = index * sizes[a] + coords[a]
    return index


class VirtualSharding:
    """A sharding over virtual devices 0..n-1 of a mesh of `sizes` (row-major over MESH_AXES):
    dimension i of an array is split over the mesh axes `entries[i]`, outer first. With
    `decode_group`, the dimensions in `grouped` are instead split `groups` ways, device d
    taking block `decode_group[d]` (the engine's decode order)."""

    def __init__(self, sizes: Mapping[str, int], entries: Sequence[Entry],
                 grouped: Sequence[int] = (), groups: int = 1,
                 decode_group: Sequence[int] | None = None,
                 devices: Sequence[int] | None = None):
        self.sizes = dict(sizes)
        self.entries = [tuple(e) for e in entries]
        self.grouped = tuple(grouped)
        self.groups = groups
        self.decode_group = decode_group
        n = math.prod(self.sizes[a] for a in MESH_AXES)
        self.devices = tuple(range(n)) if devices is None else tuple(devices)

    def devices_indices_map(self, shape: Sequence[int]) -> dict[VirtualDevice, tuple]:
        """{device: index} for the sharding's devices (all of the mesh's, or the sample it was
        built with)."""
        grid = tuple(self.sizes[a] for a in MESH_AXES)
        out = {}
        for dev in self.devices:
            coords = dict(zip(MESH_AXES, np.unravel_index(dev, grid)))
            index = []
            for i, dim in enumerate(shape):
                if i in self.grouped:
                    ways, block = self.groups, self.decode_group[dev]
                else:
                    e = self.entries[i]
                    ways = math.prod(self.sizes[a] for a in e)
                    block = _block(coords, self.sizes, e)
                step = dim // ways
                index.append(slice(block * step, (block + 1) * step))
            out[VirtualDevice(dev)] = tuple(index)
        return out


def decode_sizes(n_devices: int, tensor_g: int) -> dict[str, int]:
    """Axis sizes of the decode mesh data=n/t_g, tensor=t_g over `n_devices`."""
    if tensor_g <= 0 or n_devices % tensor_g:
        raise NoNesting(f"decode tensor={tensor_g} does not divide the {n_devices} devices")
    return mesh_sizes(data=n_devices // tensor_g, tensor=tensor_g)


def sample_devices(n: int, k: int = 16) -> tuple[int, ...]:
    """Up to k device ids spread evenly over 0..n-1, the first and last included."""
    if n <= k:
        return tuple(range(n))
    return tuple(sorted({round(i * (n - 1) / (k - 1)) for i in range(k)}))


@functools.lru_cache(maxsize=4096)
def _transition(leaves: tuple[Leaf, ...], rules: str, fsdp: int, tensor: int,
                tensor_g: int, sequence: int = 1) -> tuple[int, int]:
    sizes = mesh_sizes(fsdp=fsdp, tensor=tensor, sequence=sequence)
    n = fsdp * sequence * tensor
    train = leaf_specs(leaves, rules, sizes)
    dsizes = decode_sizes(n, tensor_g)
    try:
        decode = leaf_specs(leaves, "decode", dsizes)
    except ValueError as err:
        raise NoNesting(f"decode mesh data={n // tensor_g},tensor={tensor_g} cannot hold the "
                        f"model: {err}") from None
    split_logical = {k for k, v in shd.DECODE_RULES.items() if v}
    plan = nesting.plan_nesting([leaf.axes for leaf in leaves], train, decode, sizes, tensor_g,
                                split_logical)
    a = plan.A
    if not plan.ok:
        raise NoNesting(f"decode tensor={tensor_g} must divide the {plan.n_a} ways training "
                        f"splits the tensor-parallel dimensions (over {'x'.join(a) or 'nothing'})")
    lo = plan.lo
    grid = tuple(sizes[x] for x in MESH_AXES)
    groups = []
    for dev in range(n):
        coords = dict(zip(MESH_AXES, np.unravel_index(dev, grid)))
        groups.append(_block(coords, sizes, a) // lo)
    # Every device of these layouts receives the same volume (its decode box less its training
    # box, each the same size on every device), so a sample spread over the mesh is counted.
    sample = sample_devices(n)
    src, dst, avals = [], [], []
    held = 0
    gathers = direct = False
    for leaf, tr, dc, (tr_t, nested_dc) in zip(leaves, train, decode, plan.leaves):
        # As in the engine: a leaf that nests keeps whole for decoding what training does not
        # split over the decode tensor axis; one that does not moves to its own decode spec.
        use = nested_dc if tr_t is not None else dc
        direct |= tr_t is None
        gathers |= tr_t is not None and any(len(t) > bool(d) for t, d in zip(tr_t, nested_dc))
        grouped = [i for i, d_e in enumerate(use) if d_e]
        src.append(VirtualSharding(sizes, tr, devices=sample))
        # Every other dimension is whole in the decode layout (gathered by the transition).
        dst.append(VirtualSharding(sizes, [()] * len(tr), grouped, tensor_g, groups,
                                   devices=sample))
        avals.append(jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
        held += math.prod(d // tensor_g if i in grouped else d
                          for i, d in enumerate(leaf.shape)) * np.dtype(leaf.dtype).itemsize
    if direct and not gathers:
        raise NoNesting(f"no parameter's training shard lies inside its decode shard on decode "
                        f"tensor={tensor_g}")
    received = reshard.max_bytes(reshard.tree_transfer_bytes(src, dst, avals))
    return received, held


def transition_bytes(leaves: Sequence[Leaf], rules: str, sizes: Mapping[str, int],
                     tensor_g: int) -> tuple[int, int]:
    """(bytes a device receives going to the decode layout data=n/t_g,tensor=t_g, bytes of its
    decode shard) for a model trained in `rules` on a mesh of `sizes`.

    Counted by `reshard.tree_transfer_bytes` over the engine's decode order. Replicas along
    `data` move the same bytes independently, so one replica is counted. Raises NoNesting when
    the engine would refuse the pair.
    """
    seq = sizes.get("sequence", 1)  # sequence parallelism: FSDP spans it (sharding.layout)
    if sizes["data"] * sizes["fsdp"] * seq * sizes["tensor"] % tensor_g:
        raise NoNesting(f"decode tensor={tensor_g} does not divide the mesh")
    if sizes["fsdp"] * seq * sizes["tensor"] % tensor_g:
        # The engine's decode groups never span data replicas (their split index is local).
        raise NoNesting(f"decode tensor={tensor_g} must divide fsdp x sequence x tensor")
    return _transition(tuple(leaves), rules, sizes["fsdp"], sizes["tensor"], tensor_g, seq)
