"""3D-HybridEngine: the actor trains in one layout and decodes in another, on the same devices.

The training layout is the actor's own (a mesh plus logical-axis rules, e.g. `fsdp=4,tensor=2`
with NESTED_TRAIN_RULES, or Megatron-style `data=2,tensor=4` with params replicated over
`data`). The decoding layout is `data=d_g,tensor=t_g` with DECODE_RULES (tensor parallel only).

**Device order.** The training rules split the dimensions that decoding splits (vocab, heads,
kv_heads, mlp) over ordered tuples of mesh axes; A is the widest of them
(`hfjax.engine.nesting.plan_nesting`), N ways; call a device's position along A its *split
index* s. The decode mesh puts the device with split index s in decode tensor group
j = s // (N/t_g), so decode tensor groups take split indices at stride N/t_g and the devices
that share a decode shard (a *micro-DP group*) hold consecutive split indices. Every device's
training shard then lies inside its decoding shard. Axes that split other dimensions (e.g.
`fsdp` over `embed` under TRAIN_RULES, which decoding keeps whole) join the micro-DP group;
axes that split nothing (`data` in a Megatron-style layout) index replicas. A parameter may
also split a tensor-parallel dimension over the leading axes of A that make up t_g, and another
dimension over the rest (28 heads over `tensor`, embed over `fsdp`, A = tensor x fsdp): the
same boxes.

**Transitions.** Both directions run one small program per parameter, so at most one tensor is
in flight and the peak is the decode shard plus one tensor's shard:
- `to_decode` all-gathers each tensor inside its micro-DP groups and frees the training
  buffers, by one of three methods: an explicit `shard_map` all-gather, a jitted reshard, or
  device-to-device copies of the peers' shards plus a local concat (all three measured; the
  all-gather is the default). None goes through the host, as a plain `jax.device_put` would
  for shards that no source device holds whole.
- `to_train` slices each device's training box out of its decode shard (no communication) and
  frees the decode buffers.
The programs work on a *transition mesh* with axes (rep, gather, micro, tensor_g) over the same
devices in decode order; training and decode shards are re-labelled onto it without copies.

**Accounting.** `bytes_to_decode()` counts what each device receives (hfjax.parallel.reshard),
which equals the lower bound (decode shard minus local training shard); `bytes_to_train()` is 0.
Baselines for comparison: `naive_bytes()` (gather everything, then slice) and
`hybridflow_v_bytes()` (decode groups of consecutive ranks, no reordering); the naive
transition itself and the paper's Table 2 volume are analysis code in bench/hybrid_baselines.py.

A parameter whose training boxes do not fit that order (e.g. attention split over `tensor=2`
only, under NESTED_TRAIN_RULES, because fsdp does not divide its 28 heads, while decoding splits
heads 4 ways) moves by a plain on-device transfer both ways, and the engine logs which and how
many bytes. A decode layout in which no parameter nests (e.g. `tensor_g` above a Megatron-style
training `tensor`) is an error naming the constraint; with `allow_fallback=True` the engine
instead reshards both ways with plain on-device transfers and logs the extra bytes.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hfjax.engine import nesting
from hfjax.parallel import reshard
from hfjax.parallel import sharding as shd
from hfjax.parallel.mesh import MESH_AXES, MeshSpec
from hfjax.parallel.transfer import transfer

METHODS = ("all_gather", "reshard", "copies")


# On 8 simulated CPU devices the three methods tie within noise (docs/benchmarks.md); the
# explicit all-gather is the paper's design, one collective per tensor in each micro-DP group.
DEFAULT_METHOD = "all_gather"


class LayoutError(ValueError):
    """A decode layout that cannot hold the model or cannot nest the training shards."""


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """How one parameter moves between layouts.

    `train`/`decode` live on the actor's training mesh and on the decode mesh; `train_t` and
    `decode_t` have the same boxes on the transition mesh. `gathered` lists (dim, transition
    axes) that the way to decoding all-gathers and the way back slices.
    """

    name: str
    shape: tuple[int, ...]
    dtype: Any
    train: NamedSharding
    decode: NamedSharding
    train_t: NamedSharding | None
    decode_t: NamedSharding | None
    gathered: tuple[tuple[int, tuple[str, ...]], ...]
    direct: bool = False  # moves by a plain on-device transfer both ways (does not nest)


@dataclasses.dataclass
class TransitionStats:
    """What one transition did: seconds, bytes each device received, peak live param bytes."""

    direction: str
    method: str
    seconds: float
    bytes_received: dict[int, int]
    peak_bytes: dict[int, int]


class HybridEngine:
    """Moves an actor's params between its training layout and a decode layout, same devices.

    Args:
      train_layout: the actor's Layout (training mesh + rules).
      decode_spec: the decode mesh, e.g. "data=4,tensor=2" (only `data` and `tensor` may be > 1).
      state: the params state (real or abstract) whose structure and `logical_axes` the engine
        plans for.
      decode_rules: logical rules of the decode layout (DECODE_RULES by default).
      method: "all_gather" (explicit shard_map), "reshard" (jitted identity with a new output
        sharding) or "copies" (device-to-device copies of peer shards, then a local concat);
        None: DEFAULT_METHOD.
      allow_fallback: when the layouts cannot nest, log the extra bytes and reshard with plain
        on-device transfers instead of raising LayoutError.
    """

    def __init__(
        self,
        train_layout: shd.Layout,
        decode_spec: str | MeshSpec,
        state: Any,
        *,
        decode_rules: str | Mapping[str, shd.Rule] = "decode",
        method: str | None = None,
        allow_fallback: bool = False,
    ):
        method = DEFAULT_METHOD if method is None else method
        if method not in METHODS:
            raise ValueError(f"unknown hybrid engine method {method!r}; choose one of {METHODS}")
        self.method = method
        self.train_layout = train_layout
        self.train_mesh = train_layout.mesh
        self.decode_spec = MeshSpec.parse(decode_spec)
        self.decode_rules = decode_rules
        leaves, self._treedef = shd.flatten_state(state)
        self._names = [
            shd._path_name(p)
            for p, _ in jax.tree_util.tree_flatten_with_path(state, is_leaf=shd.is_variable)[0]
        ]
        self._axes = [
            leaf.get_metadata().get("logical_axes") if shd.is_variable(leaf) else None
            for leaf in leaves
        ]
        values = [shd.leaf_value(v) for v in leaves]
        self._avals = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in values]
        self._decode_sizes = self._check_decode_spec()
        self.v_mesh = self.decode_spec.build(list(self.train_mesh.devices.flat), "decode")
        # Decode specs depend on axis sizes only; computing them first reports a decode layout
        # that cannot hold the model (e.g. tensor_g not dividing the heads) before anything else.
        decode_specs = self._decode_specs()
        self.fallback_reason: str | None = None
        try:
            self._plan_nested(decode_specs)
        except LayoutError as err:
            if not allow_fallback:
                raise
            self.fallback_reason = str(err)
            self._plan_fallback(decode_specs)
        self.last: TransitionStats | None = None
        self._programs: dict[tuple[str, int], Callable] = {}
        logging.info(
            "hybrid engine: train %s -> decode %s, method=%s, bytes/device to decode %d "
            "(lower bound %d, naive %d), back %d%s",
            dict(self.train_mesh.shape),
            self.decode_spec.text,
            self.method,
            reshard.max_bytes(self.bytes_to_decode()),
            reshard.max_bytes(self.lower_bound()),
            reshard.max_bytes(self.naive_bytes()),
            reshard.max_bytes(self.bytes_to_train()),
            " (fallback)" if self.fallback else "",
        )
        if self.fallback:
            extra = (
                reshard.max_bytes(self.bytes_to_decode())
                - reshard.max_bytes(self.lower_bound())
                + reshard.max_bytes(self.bytes_to_train())
            )
            logging.warning(
                "hybrid engine: %s; falling back to plain on-device resharding, which moves %d "
                "extra bytes per device per round trip (%d to decode, %d back; lower bound %d)",
                self.fallback_reason,
                extra,
                reshard.max_bytes(self.bytes_to_decode()),
                reshard.max_bytes(self.bytes_to_train()),
                reshard.max_bytes(self.lower_bound()),
            )

    # -- planning ------------------------------------------------------------------------------

    def _check_decode_spec(self) -> dict[str, int]:
        n = self.train_mesh.devices.size
        sizes = self.decode_spec.resolve(n, "decode")
        extra = [a for a, s in sizes.items() if s > 1 and a not in ("data", "tensor")]
        if extra:
            raise LayoutError(
                f"decode mesh {self.decode_spec.text!r} uses {', '.join(extra)}; a decode mesh "
                "has only 'data' (batch) and 'tensor' axes, e.g. 'data=4,tensor=2'"
            )
        return sizes

    def _decode_specs(self) -> list[list[tuple[str, ...]]]:
        lay = shd.layout(self.v_mesh, self.decode_rules)
        out = []
        for name, axes, aval in zip(self._names, self._axes, self._avals):
            if axes is None:
                out.append([()] * len(aval.shape))
                continue
            try:
                spec = lay.spec(axes, aval.shape, name)
            except ValueError as err:
                raise LayoutError(
                    f"decode mesh {self.decode_spec.text!r} cannot hold the model: {err}"
                ) from err
            out.append(nesting.spec_entries(spec, len(aval.shape)))
        return out

    def _train_specs(self) -> list[list[tuple[str, ...]]]:
        out = []
        for name, axes, aval in zip(self._names, self._axes, self._avals):
            spec = P() if axes is None else self.train_layout.spec(axes, aval.shape, name)
            out.append(nesting.spec_entries(spec, len(aval.shape)))
        return out

    def _plan_nested(self, decode_specs: list[list[tuple[str, ...]]]) -> None:
        mesh = self.train_mesh
        train_specs = self._train_specs()
        # Logical axes the decode rules split; plan_nesting finds the axes A that order the
        # decode groups and which leaves nest under that order.
        rules = (
            shd.RULE_SETS[self.decode_rules]
            if isinstance(self.decode_rules, str)
            else self.decode_rules
        )
        split_logical = {k for k, v in rules.items() if v}
        plan = nesting.plan_nesting(self._axes, train_specs, decode_specs, dict(mesh.shape),
                            self._decode_sizes["tensor"], split_logical)
        A, B, n_a, lo, t_g = plan.A, plan.B, plan.n_a, plan.lo, plan.t_g
        n_b = math.prod(mesh.shape[a] for a in B)
        if not plan.ok:
            raise LayoutError(self._no_nest_reason(A, B, n_a, t_g))
        rep_axes = [a for a in mesh.axis_names if mesh.shape[a] > 1 and a not in A + B]
        n_rep = math.prod(mesh.shape[a] for a in rep_axes)
        grid = np.empty((n_rep, n_b, lo, t_g), dtype=object)
        names = mesh.axis_names
        for coords in np.ndindex(mesh.devices.shape):
            at = dict(zip(names, coords))
            s = nesting.mixed_radix([at[a] for a in A], [mesh.shape[a] for a in A])
            b = nesting.mixed_radix([at[a] for a in B], [mesh.shape[a] for a in B])
            r = nesting.mixed_radix([at[a] for a in rep_axes], [mesh.shape[a] for a in rep_axes])
            grid[r, b, s % lo, s // lo] = mesh.devices[coords]
        auto = (AxisType.Auto,)
        self.transition_mesh = Mesh(grid, nesting.TRANSITION_AXES, axis_types=auto * 4)
        sizes = {**dict.fromkeys(MESH_AXES, 1), "data": n_rep * n_b * lo, "tensor": t_g}
        self.decode_mesh = Mesh(
            grid.reshape(tuple(sizes.values())), MESH_AXES, axis_types=auto * len(MESH_AXES)
        )
        self.micro_dp = n_b * lo
        self.split_axes, self.split_ways = A, n_a
        self.leaves = []
        replicated_kv: set[str] = set()
        moved: list[str] = []
        for i, aval in enumerate(self._avals):
            tr, (tr_t, dc) = train_specs[i], plan.leaves[i]
            leaf = None if tr_t is None else self._nested_leaf(i, tr, dc, tr_t)
            if leaf is not None:
                replicated_kv.update(f"{self._names[i]} dim {d}" for d, (a, b) in
                                     enumerate(zip(decode_specs[i], dc)) if a != b)
            else:
                leaf = LeafPlan(
                    name=self._names[i], shape=tuple(aval.shape), dtype=aval.dtype,
                    train=NamedSharding(mesh, nesting.to_spec(tr)),
                    decode=NamedSharding(self.decode_mesh, nesting.to_spec(decode_specs[i])),
                    train_t=None, decode_t=None, gathered=(), direct=True,
                )
                moved.append(leaf.name)
            self.leaves.append(leaf)
        if moved and not any(lf.gathered for lf in self.leaves):
            raise LayoutError(self._no_nest_reason(A, B, n_a, t_g))
        if replicated_kv:
            logging.info(
                "hybrid engine: decoding keeps whole what training keeps whole: %s",
                ", ".join(sorted(replicated_kv)),
            )
        self.direct = moved
        if moved:
            extra = [lf for lf in self.leaves if lf.direct]
            logging.warning(
                "hybrid engine: %d of %d parameters (%s) do not nest between training layout %s "
                "and decode mesh %r (training splits their tensor-parallel dimensions over other "
                "axes than %s); they move by plain on-device transfers, %d bytes per device to "
                "decode and %d back",
                len(moved), len(self.leaves), ", ".join(moved[:4]) + (", ..." if len(moved) > 4
                                                                      else ""),
                dict(mesh.shape), self.decode_spec.text, A,
                reshard.max_bytes(reshard.tree_transfer_bytes(
                    [lf.train for lf in extra], [lf.decode for lf in extra],
                    [self._avals[self.leaves.index(lf)] for lf in extra])),
                reshard.max_bytes(reshard.tree_transfer_bytes(
                    [lf.decode for lf in extra], [lf.train for lf in extra],
                    [self._avals[self.leaves.index(lf)] for lf in extra])),
            )
        self.fallback = False

    def _nested_leaf(self, i: int, tr, dc, tr_t) -> LeafPlan | None:
        """Leaf i's nested plan, or None when its training boxes do not re-label onto the
        transition mesh or do not lie inside its decode boxes."""
        aval = self._avals[i]
        dc_t = [(nesting.TENSOR_G,) if e else () for e in dc]
        gathered = []
        for dim, (a, b) in enumerate(zip(tr_t, dc_t)):
            if a[: len(b)] != b:
                return None
            if len(a) > len(b):
                gathered.append((dim, a[len(b) :]))
        leaf = LeafPlan(
            name=self._names[i],
            shape=tuple(aval.shape),
            dtype=aval.dtype,
            train=NamedSharding(self.train_mesh, nesting.to_spec(tr)),
            decode=NamedSharding(self.decode_mesh, nesting.to_spec(dc)),
            train_t=NamedSharding(self.transition_mesh, nesting.to_spec(tr_t)),
            decode_t=NamedSharding(self.transition_mesh, nesting.to_spec(dc_t)),
            gathered=tuple(gathered),
        )
        same = reshard.boxes(leaf.train, leaf.shape) == reshard.boxes(
            leaf.train_t, leaf.shape
        ) and reshard.boxes(leaf.decode, leaf.shape) == reshard.boxes(leaf.decode_t, leaf.shape)
        if not same or not reshard.nests(leaf.train, leaf.decode, leaf.shape):
            return None
        return leaf

    def _no_nest_reason(self, A: tuple[str, ...], B: tuple[str, ...], n_a: int, t_g: int) -> str:
        mesh = self.train_mesh
        head = (
            f"decode tensor={t_g} cannot hold the training shards of layout "
            f"{dict((a, n) for a, n in mesh.shape.items() if n > 1)}: "
        )
        if not A and B:
            return head + (
                f"training splits only dimensions that decoding keeps whole (over "
                f"{'x'.join(B)}) and keeps whole the vocab/heads/mlp dimensions that decoding "
                "splits, so no decode shard contains a training shard; use NESTED_TRAIN_RULES "
                "(fsdp splits the same dimensions as tensor)"
            )
        if A == ("tensor",) or not A:
            return head + (
                f"with params replicated over data (Megatron-style), decode tensor must divide "
                f"the training tensor={n_a}; a larger one would make each decode shard smaller "
                "than the training shard, so the way back would need communication"
            )
        return head + (
            f"decode tensor must divide the {n_a} ways the training layout splits the "
            f"tensor-parallel dimensions (over {'x'.join(A)})"
        )

    def _plan_fallback(self, decode_specs: list[list[tuple[str, ...]]]) -> None:
        self.transition_mesh = None
        self.direct = []
        self.decode_mesh = self.v_mesh
        self.micro_dp = 0
        self.split_axes, self.split_ways = (), 1
        self.leaves = []
        for name, aval, tr, dc in zip(self._names, self._avals, self._train_specs(), decode_specs):
            self.leaves.append(
                LeafPlan(
                    name=name,
                    shape=tuple(aval.shape),
                    dtype=aval.dtype,
                    train=NamedSharding(self.train_mesh, nesting.to_spec(tr)),
                    decode=NamedSharding(self.decode_mesh, nesting.to_spec(dc)),
                    train_t=None,
                    decode_t=None,
                    gathered=(),
                )
            )
        self.fallback = True

    # -- shardings and accounting ----------------------------------------------------------------

    def train_shardings(self) -> list[NamedSharding]:
        """Returns the training sharding of each parameter (flattened state order)."""
        return [leaf.train for leaf in self.leaves]

    def decode_shardings(self) -> list[NamedSharding]:
        """Returns the decode sharding of each parameter (flattened state order)."""
        return [leaf.decode for leaf in self.leaves]

    def bytes_to_decode(self) -> dict[int, int]:
        """Returns {device id: bytes received} going to the decode layout."""
        return reshard.tree_transfer_bytes(
            self.train_shardings(), self.decode_shardings(), self._avals
        )

    def bytes_to_train(self) -> dict[int, int]:
        """Returns {device id: bytes received} coming back (0 everywhere when shards nest)."""
        return reshard.tree_transfer_bytes(
            self.decode_shardings(), self.train_shardings(), self._avals
        )

    def lower_bound(self) -> dict[int, int]:
        """Returns {device id: decode shard bytes - local training shard bytes}."""
        return reshard.tree_lower_bound_bytes(
            self.train_shardings(), self.decode_shardings(), self._avals
        )

    def decode_bytes(self) -> dict[int, int]:
        """Returns {device id: bytes of its decode shard of the whole model}."""
        return reshard.tree_shard_bytes(self.decode_shardings(), self._avals)

    def train_bytes(self) -> dict[int, int]:
        """Returns {device id: bytes of its training shard of the whole model}."""
        return reshard.tree_shard_bytes(self.train_shardings(), self._avals)

    def naive_bytes(self) -> dict[int, int]:
        """Returns {device id: bytes received} to gather every parameter whole, then slice."""
        full = NamedSharding(self.train_mesh, P())
        return reshard.tree_transfer_bytes(
            self.train_shardings(), [full] * len(self.leaves), self._avals
        )

    def hybridflow_v_bytes(self) -> dict[int, int]:
        """Returns {device id: bytes received} with the same decode specs on a decode mesh of
        consecutive ranks (HybridFlow-V: no reordering)."""
        v = [NamedSharding(self.v_mesh, leaf.decode.spec) for leaf in self.leaves]
        return reshard.tree_transfer_bytes(self.train_shardings(), v, self._avals)

    def split_bytes(self) -> int:
        """Returns the bytes of the parameters the training layout splits over its split axes:
        the M of Table 2 (replicated tensors such as norms move nothing either way)."""
        return sum(
            math.prod(a.shape) * np.dtype(a.dtype).itemsize
            for a, leaf in zip(self._avals, self.leaves)
            if leaf.gathered
        )

    def largest_shard_bytes(self) -> dict[int, int]:
        """Returns {device id: bytes of its largest single decode shard}."""
        out: dict[int, int] = {}
        for leaf in self.leaves:
            for dev, b in reshard.shard_bytes(leaf.decode, leaf.shape, leaf.dtype).items():
                out[dev] = max(out.get(dev, 0), b)
        return out

    # -- programs --------------------------------------------------------------------------------

    def _program(self, kind: str, i: int) -> Callable:
        """Returns leaf i's jitted program: "all_gather" or "reshard" (to decode), "slice"
        (back)."""
        key = (kind, i)
        if key not in self._programs:
            leaf, mesh = self.leaves[i], self.transition_mesh
            if kind == "reshard":
                program = reshard.reshard_program(leaf.decode)
            elif kind == "all_gather":
                program = reshard.gather_program(
                    mesh, leaf.train_t.spec, leaf.decode_t.spec, leaf.gathered, leaf.decode
                )
            else:
                program = reshard.slice_program(
                    mesh, leaf.decode_t.spec, leaf.train_t.spec, leaf.gathered, leaf.train_t
                )
            self._programs[key] = program
        return self._programs[key]

    def abstract_decode(self, params: Any) -> Any:
        """`params` (in the training layout; arrays or ShapeDtypeStructs) as ShapeDtypeStructs
        in the decode layout: what the sampler's programs receive after `to_decode`."""
        leaves, treedef = shd.flatten_state(params)
        return jax.tree.unflatten(treedef, [
            shd.with_value(v, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.decode))
            for v, leaf in zip(leaves, self.leaves)])

    def transition_programs(self, direction: str) -> list[tuple[LeafPlan, Callable, Any]]:
        """(leaf, jitted program, abstract input) for each parameter that `direction`
        ("to_decode" or "to_train") moves with a program, in the order the transition runs
        them: what a dry run compiles. Empty for the fallback, which moves by plain
        transfers, and for parameters that are re-labelled without a copy."""
        if self.fallback:
            return []
        to_decode = direction == "to_decode"
        kind = self.method if to_decode else "slice"
        if kind == "copies":
            return []  # device-to-device copies and a local concat: no single program
        out = []
        for i, leaf in enumerate(self.leaves):
            if not leaf.gathered:
                continue
            sharding = leaf.train_t if to_decode else leaf.decode_t
            out.append((leaf, self._program(kind, i),
                        jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)))
        return out

    # -- transitions -----------------------------------------------------------------------------

    def to_decode(self, params: Any) -> Any:
        """Returns `params` in the decode layout; the training buffers are freed (consumed).

        `params` must be in the training layout (the structure the engine was built for). The
        stats of the move are in `self.last`.
        """
        return self._run(params, "to_decode")

    def to_train(self, params: Any) -> Any:
        """Returns decode-layout `params` back in the training layout; the decode buffers are
        freed. With nested shards this is a local slice: no bytes move between devices."""
        return self._run(params, "to_train")

    def _run(self, params: Any, direction: str) -> Any:
        leaves, treedef = shd.flatten_state(params)
        if treedef != self._treedef:
            raise ValueError("params do not have the structure the hybrid engine was built for")
        to_decode = direction == "to_decode"
        values = [shd.leaf_value(v) for v in leaves]
        for x, leaf in zip(values, self.leaves):
            want = leaf.train if to_decode else leaf.decode
            if not isinstance(x, jax.Array) or x.sharding != want:
                raise ValueError(
                    f"{direction}: {leaf.name} has sharding "
                    f"{getattr(x, 'sharding', type(x).__name__)}, expected {want}"
                )
        t0 = time.perf_counter()
        live = reshard.array_bytes(values)
        peak = dict(live)
        out = []
        for i, (x, leaf) in enumerate(zip(values, self.leaves)):
            y, staged, copied = self._move(x, leaf, i, to_decode)
            fresh = reshard.array_bytes([y]) if copied else {}
            # The moment both copies (and any staged pieces) exist is this tensor's peak.
            now = reshard.add(reshard.add(live, fresh), staged)
            peak = {d: max(peak.get(d, 0), b) for d, b in now.items()}
            if copied and reshard.shares_buffers(x, y):
                # A transfer may hand back some of its input's buffers (a shard already in
                # place): freeing the input would free those too, so keep it.
                copied = False
                fresh = {}
            if copied:
                gone = reshard.array_bytes([x])
                x.delete()
                live = reshard.add(reshard.add(live, fresh), {d: -b for d, b in gone.items()})
            out.append(y)
        jax.block_until_ready(out)
        counted = self.bytes_to_decode() if to_decode else self.bytes_to_train()
        self.last = TransitionStats(
            direction,
            "fallback" if self.fallback else self.method,
            time.perf_counter() - t0,
            counted,
            peak,
        )
        return jax.tree.unflatten(treedef, [shd.with_value(v, y) for v, y in zip(leaves, out)])

    def _move(
        self, x: jax.Array, leaf: LeafPlan, i: int, to_decode: bool
    ) -> tuple[jax.Array, dict[int, int], bool]:
        """Returns (the moved array, {device: bytes of pieces staged along the way}, whether it
        is a new copy, so that `x` must be freed)."""
        dst = leaf.decode if to_decode else leaf.train
        if self.fallback or leaf.direct:
            return transfer(x, dst), {}, True
        if not leaf.gathered:
            # Same boxes in both layouts: a re-label, no program and no copy.
            return reshard.relabel(x, dst), {}, False
        if not to_decode:
            y_t = self._program("slice", i)(reshard.relabel(x, leaf.decode_t))
            return reshard.relabel(y_t, leaf.train), {}, True
        x_t = reshard.relabel(x, leaf.train_t)
        if self.method == "copies":
            y, staged = reshard.gather_by_copies(x_t, leaf.decode, [d for d, _ in leaf.gathered])
            return y, staged, True
        return self._program(self.method, i)(x_t), {}, True


def engine_for(train_layout: shd.Layout, decode_mesh: str, state: Any) -> HybridEngine | None:
    """Returns the actor's hybrid engine for `decode_mesh` (`RolloutSpec.decode_mesh`), or
    None when it is empty: the actor then decodes in its training layout."""
    if not decode_mesh:
        return None
    return HybridEngine(train_layout, decode_mesh, state,
                        allow_fallback=splits_rows(train_layout.mesh))


def splits_rows(mesh) -> bool:
    """Whether a training mesh splits rows over `sequence` (sequence parallelism). Its
    parameters are sharded over fsdp x sequence (FSDP spans the `sequence` axis), a split that
    rarely nests in a decode layout's; the engine then reshards them with plain on-device
    transfers (logged with the extra bytes) rather than refusing the decode layout."""
    return mesh.shape.get("sequence", 1) > 1
