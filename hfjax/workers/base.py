"""The worker-group base class: one model bound to one resource pool's mesh.

A worker group owns the model's graphdef, its parameters (a pytree of `jax.Array`s placed by
the group's layout), its optimizer state, and the jitted programs that run on them. Its public
methods are declared with a transfer protocol (`@method(DP_COMPUTE, reads=...)`, from
`hfjax.controller.protocol`): the batch arrives on the group's mesh, padded to its
data-parallel size, and a Batch it returns goes back to `home`, the mesh the dataflow keeps its
batch on.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from flax import nnx
from jax.sharding import Mesh

from hfjax.controller.batch import Batch
from hfjax.engine import grouping, update
from hfjax.engine.packing import PackShape, TokenBudget
from hfjax.models import lora
from hfjax.models import sequence_parallel as sp
from hfjax.parallel import sharding as shd
from hfjax.parallel.mesh import MeshSpec, ResourcePool, batch_sharding, dp_size
from hfjax.parallel.transfer import transfer
from hfjax.workers import vision

# The arrays every scoring pass reads: the sequences and which of their tokens are responses.
SEQUENCES = ("input_ids", "attention_mask", "responses")


def _owned_transfer(x: jax.Array, sharding) -> jax.Array:
    out = transfer(x, sharding)
    return jnp.copy(out) if out is x else out


def _place(x, sharding):
    if isinstance(x, jax.ShapeDtypeStruct):
        # An abstract model (the dry run): shapes and shardings only, nothing allocated.
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return _owned_transfer(x, sharding)


def is_abstract(tree) -> bool:
    """True when `tree`'s leaves are ShapeDtypeStructs (a worker group built for a dry run)."""
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


@dataclasses.dataclass(frozen=True)
class StepShape:
    """The widest batch a run's step hands its worker groups, for listing their programs at
    abstract shapes (`WorkerGroup.programs`): `sequences` rows (prompts x samples),
    `prompt_len` + `response_len` columns (the config's caps), and whether the step scores its
    samples under the pre-update policy (`hfjax.algorithms.dataflow.needs_old_log_prob`)."""

    sequences: int
    prompt_len: int
    response_len: int
    old_log_probs: bool = True

    @property
    def width(self) -> int:
        return self.prompt_len + self.response_len


@dataclasses.dataclass(frozen=True)
class Program:
    """One compilable program of a worker group: `fn` (jitted) lowers with `args` (abstract
    arrays with their shardings, and the static values it takes). `name` is "<group>.<what>";
    `replaces`: the group's resident state the program takes as arguments (e.g. "critic
    params", "critic optimizer"), so a pool's other holdings are not counted twice; `named`:
    arguments whose per-device bytes a report names (params, optimizer, batch, ...);
    `trains`: part of an update (it changes the group's state)."""

    name: str
    fn: Any
    args: tuple
    replaces: tuple[str, ...]
    named: dict[str, Any] = dataclasses.field(default_factory=dict)
    trains: bool = False


@functools.partial(jax.jit, static_argnums=1)
def _divide(sums: dict[str, jax.Array], count: int) -> dict[str, jax.Array]:
    # Jitted with a static count: eager `v / count` would upload the Python int every step.
    return {k: v / count for k, v in sums.items()}


class WorkerGroup:
    """A model on a pool: mesh, layout, graphdef, params and optional optimizer state."""

    def __init__(
        self,
        name: str,
        pool: ResourcePool,
        mesh_spec: str | MeshSpec,
        model: nnx.Module,
        *,
        rules: str | dict = "train",
        optimizer: optax.GradientTransformation | None = None,
        home: Mesh | None = None,
        sequence_parallel: str = "ulysses",
        vl=None,
    ):
        self.name = name
        # A vision-language policy's `VLConfig` (`hfjax.workers.vision`): the group's passes
        # then take the images its batches carry. None: text only.
        self.vl = vl
        self.pool = pool
        self.mesh = pool.mesh(mesh_spec)
        # Where the dataflow keeps its batch: methods' Batch outputs are collected onto it.
        self.home = home
        self.config = model.config
        # A mesh with `sequence` > 1 splits rows' tokens; attention then crosses the shards by
        # `sequence_parallel` (hfjax.models.sequence_parallel), refused here if it cannot.
        problem = sp.heads_problem(self.config.num_heads, self.config.num_kv_heads,
                                   self.mesh.shape, sequence_parallel,
                                   key=f"{name}.sequence_parallel")
        if problem:
            raise ValueError(f"{name} on mesh {MeshSpec.parse(mesh_spec).text!r}: {problem}")
        self.layout = shd.layout(self.mesh, rules, sequence_parallel=sequence_parallel)
        self.graphdef, state = nnx.split(model)
        self.param_shardings = self.layout.state_shardings(state)
        # A model built on another mesh (or loaded elsewhere) moves device to device here.
        # Each group owns its buffers: updates donate them, so none may be shared with the model
        # it was built from (a reference policy is often a copy of the actor on the same mesh).
        # An abstract model (leaves are ShapeDtypeStructs) gives an abstract group: params and
        # optimizer state as ShapeDtypeStructs with their shardings, from which the dry run
        # lowers and compiles the group's own programs without allocating anything.
        self.params = jax.tree.map(
            lambda sh, var: var.replace(_place(var.get_value(), sh)),
            self.param_shardings,
            state,
            is_leaf=shd.is_variable,
        )
        # With LoRA adapters (`hfjax.models.lora`) only they train: the base gets no gradient,
        # no optimizer state and no update.
        self._set_trainable(state)
        # LoRA adapter dropout in training steps (`hfjax.models.lora_dropout`); None: none.
        self.dropout = lora.dropout_of(model) if self.trainable is not None else None
        self.lora: lora.LoraSpec | None = None
        self.base_graphdef = (lora.base_graphdef(model) if self.trainable is not None
                              else self.graphdef)
        self._train_calls = 0
        self.set_optimizer(optimizer)

    def _set_trainable(self, state) -> None:
        self.trainable = lora.trainable_filter(state)
        self.train_shardings = (
            self.layout.state_shardings(update.split_trainable(state, self.trainable)[0])
            if self.trainable is not None else self.param_shardings)

    def add_adapters(self, spec: lora.LoraSpec, seed: int = 0) -> None:
        """Adds LoRA adapters (`hfjax.models.lora`) to this group's model: from now on only
        they (and a value or score head) train, the rest is the frozen base, and the base's
        own graphdef (`base_graphdef`) reads the base without them. The base arrays stay
        where they are (not copied); the adapters are placed by the group's layout, and the
        optimizer is installed afresh over them (its state is the adapters')."""
        model = self.model()
        if getattr(model, "visual", None) is not None:
            raise ValueError(f"{self.name}: actor.freeze_vision=False with LoRA trains no "
                             "vision tower (adapters go on the language model only); set "
                             "actor.freeze_vision=True or actor.lora.rank=0")
        self.base_graphdef = self.graphdef
        lora.add_adapters(model, spec, seed)
        self.lora = spec
        self.graphdef, state = nnx.split(model)
        self.param_shardings = self.layout.state_shardings(state)
        self.params = jax.tree.map(
            lambda sh, var: var if not isinstance(var, nnx.LoRAParam)
            else var.replace(_place(var.get_value(), sh)),
            self.param_shardings, state, is_leaf=shd.is_variable)
        self._set_trainable(state)
        self.dropout = lora.dropout_of(model)
        self.set_optimizer(self.optimizer)

    def base_params(self, params=None):
        """The frozen base of (the given or current) params: all of them without adapters."""
        p = self.params if params is None else params
        return lora.base_state(p) if self.trainable is not None else p

    def trainable_params(self, params=None):
        """The part of (the given or current) params that trains: the adapters under LoRA,
        else all of them."""
        p = self.params if params is None else params
        return update.split_trainable(p, self.trainable)[0]

    def seeing(self, model, arrays):
        """The context to trace a pass of `model` over rows whose arrays are `arrays` in: the
        rows' images, if they carry any (`hfjax.workers.vision.seeing`)."""
        return vision.seeing(self.name, self.vl, model, vision.images_of(arrays))

    def jit(self, fn: Callable, **jit_kwargs) -> Callable:
        """`jax.jit(fn)` traced under this group's layout, so that the model's logical
        activation constraints (`hfjax.parallel.sharding.constrain`) apply to its mesh."""
        return jax.jit(shd.under_layout(self.layout, fn), **jit_kwargs)

    def set_optimizer(self, optimizer: optax.GradientTransformation | None) -> None:
        """Installs an optimizer with fresh state; compiled update programs are dropped."""
        self.optimizer = optimizer
        self.opt_state = self.opt_shardings = None
        self._programs: dict[tuple, Callable] = {}
        if optimizer is None:
            return
        everywhere = self.layout.replicated()
        # Moments and other per-parameter state take their parameter's sharding, everything
        # else (step counts) is replicated. Left to XLA, `init`'s zeros have no input to follow
        # and come out replicated: every device would hold the whole optimizer state.
        train = self.trainable_params()
        shapes = jax.eval_shape(optimizer.init, train)
        self.opt_shardings = optax.tree_map_params(
            optimizer, lambda _, sharding: sharding, shapes,
            jax.tree.map(lambda x: x.sharding, train),
            transform_non_params=lambda _: everywhere)
        if self.abstract:
            self.opt_state = jax.tree.map(
                lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
                self.opt_shardings)
        else:
            self.opt_state = jax.jit(optimizer.init, out_shardings=self.opt_shardings)(train)

    def train(self, loss_fn, batch: Batch, keys, *, mini: int, micro: int, epochs: int,
              shuffle: bool, budget: TokenBudget | None = None, grouped: bool = False,
              normalisers=update.normalisers, group: int = 1) -> dict[str, jax.Array]:
        """Runs `epochs` passes of micro-batched updates of `loss_fn` over mini-batches of
        `batch`; returns the metrics averaged over the steps (device scalars, not fetched),
        except `nonfinite` and `nonfinite_params`: the number of updates not applied, and of
        those that left a non-finite parameter (`hfjax.engine.update`).
        `normalisers(mini_batch)` gives the totals the loss divides by (default: response
        tokens and sequences).

        With a token `budget`, mini-batches are packed and micro-batches cut by the budget
        (`hfjax.engine.packing`) instead of `micro` rows at a time; `grouped`: micro-batches of
        `micro` rows of similar lengths, each only as wide as its rows need
        (`hfjax.engine.grouping`). `group` > 1: the rows come in groups of that many
        consecutive rows (a prompt's samples) that shuffling and micro-batches keep whole
        (`hfjax.engine.shared_prompt`)."""
        update.check_mini_batching(len(batch), mini, micro, self.dp_size, self.name)
        if micro % group:
            raise ValueError(f"{self.name}: micro-batches of {micro} sequences can't hold whole "
                             f"groups of {group} samples")
        if grouped and budget is not None:
            raise ValueError(f"{self.name}: group_by_length and use_remove_padding both cut "
                             "micro-batches to real tokens; turn one of them off")
        shape = None
        if budget is not None:
            shape = budget.shape(mini, batch["input_ids"].shape[1], self.dp_size, self.name)
        if grouped:
            step = self.grouped_program(loss_fn, normalisers)
            r = batch["responses"].shape[1]
            p = batch["input_ids"].shape[1] - r
            ext = grouping.extents(batch["attention_mask"], r)
        else:
            step = self.update_program(loss_fn, mini // micro, normalisers, shape, group)
        sums: dict[str, jax.Array] = {}
        count = 0
        picked = batch.select(keys)
        for rows in update.mini_batch_rows(len(batch), mini, epochs, shuffle, self._train_calls,
                                           group):
            mb = picked.take(rows).to(self.mesh)  # a gather's output layout is XLA's choice
            # With adapter dropout, the step's masks come from (this update call, mini-batch).
            named = (() if self.dropout is None
                     else (self.dropout_counter(self._train_calls, count),))
            if grouped:
                parts = (self.on_mesh(grouping.cut(mb.arrays, c, r))
                         for c in grouping.plan(ext[:, rows], micro, p, r, self.dp_size, group))
                if self.dropout is not None:
                    parts = ((part, self.dropout_counter(self._train_calls, count, j))
                             for j, part in enumerate(parts))
                self.params, self.opt_state, m = step(self.params, self.opt_state,
                                                      dict(mb.arrays), parts)
            else:
                self.params, self.opt_state, m = step(self.params, self.opt_state,
                                                      dict(mb.arrays), *named)
            sums = m if not sums else jax.tree.map(jnp.add, sums, m)
            count += 1
        self._train_calls += 1
        out = _divide(sums, count)
        out["nonfinite"] = sums["nonfinite"]
        out["nonfinite_params"] = sums["nonfinite_params"]
        return out

    def dropout_counter(self, *values: int) -> jax.Array:
        """A uint32 vector of `values` on every device of the mesh: what names an update
        step's (or micro-batch's) adapter-dropout key (`hfjax.models.lora_dropout.step_key`).
        Its upload, a few bytes per step, is deliberate."""
        with jax.transfer_guard("allow"):
            return jax.device_put(np.asarray(values, np.uint32), self.layout.replicated())

    def on_mesh(self, arrays: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """`arrays` with their rows split over this group's data-parallel devices."""
        return dict(Batch(arrays).to(self.mesh).arrays)

    def grouped_program(self, loss_fn, normalisers=update.normalisers) -> Callable:
        """The update step over length-grouped micro-batches of `loss_fn`
        (`hfjax.engine.update.make_grouped_update_step`; each micro-batch shape compiles once)."""
        key = (loss_fn.__name__, "grouped", normalisers)
        if key not in self._programs:
            self._programs[key] = update.make_grouped_update_step(
                loss_fn, self.optimizer, self.param_shardings, self.opt_shardings,
                normalisers=normalisers, jit=self.jit, trainable=self.trainable,
                grad_shardings=self.train_shardings, dropout=self.dropout)
        return self._programs[key]

    def update_program(self, loss_fn, n_micro: int, normalisers=update.normalisers,
                       packing: PackShape | None = None, group: int = 1) -> Callable:
        """The jitted update step `step(params, opt_state, mini_batch)` of `loss_fn` over
        `n_micro` micro-batches (of whole groups of `group` rows), or packed micro-batches of
        `packing`'s shape (compiled once per combination; the dry run lowers the same one)."""
        key = (loss_fn.__name__, n_micro, normalisers, packing, group)
        if key not in self._programs:
            logging.info("%s: compiling %s with %d micro-batches (packing: %s)", self.name,
                         loss_fn.__name__, n_micro, packing)
            self._programs[key] = update.make_update_step(
                loss_fn, self.optimizer, n_micro, self.param_shardings, self.opt_shardings,
                normalisers=normalisers, jit=self.jit, packing=packing, group=group,
                trainable=self.trainable, dropout=self.dropout,
            )
        return self._programs[key]

    # -- programs at abstract shapes (the dry run and the pre-run memory check) ----------------

    def programs(self, shape: StepShape) -> list[Program]:
        """Every program this group compiles for a step of `shape`, at abstract shapes, in the
        modes its config selects (padded, packed, length-grouped, shared-prompt rows). A
        group with no device programs lists none."""
        return []

    def abstract_rows(self, n: int, width: int, dtype: str = "int32") -> jax.ShapeDtypeStruct:
        """An abstract [n, width] batch array split over this group's data-parallel devices."""
        return jax.ShapeDtypeStruct((n, width), jnp.dtype(dtype),
                                    sharding=batch_sharding(self.mesh))

    def abstract_sequences(self, n: int, shape: StepShape) -> dict[str, jax.ShapeDtypeStruct]:
        """The sequence arrays of `n` rows at `shape`'s widths (`SEQUENCES` and the mask)."""
        return {"input_ids": self.abstract_rows(n, shape.width),
                "attention_mask": self.abstract_rows(n, shape.width),
                "responses": self.abstract_rows(n, shape.response_len),
                "response_mask": self.abstract_rows(n, shape.response_len)}

    def padded_rows(self, n: int) -> int:
        """`n` rounded up to this group's data-parallel size, as dispatch pads a batch."""
        return n + (-n % self.dp_size)

    def update_programs(self, what: str, loss_fn, batch: dict[str, Any], micro: int, *,
                        budget: TokenBudget | None = None, grouped: bool = False,
                        group: int = 1, normalisers=update.normalisers) -> list[Program]:
        """The update programs `train` runs for a mini-batch `batch` (abstract) of `loss_fn`:
        one strided or packed step, or, length-grouped, a full-width micro-batch's gradient
        accumulation and the optimizer update (the widest cut bounds every cut's memory)."""
        name = f"{self.name}.{what}"
        state = (f"{self.name} params", f"{self.name} optimizer")
        named = {"params": self.params, "optimizer": self.opt_state, "batch": batch}
        mini = batch["input_ids"].shape[0]
        if not grouped:
            shape = None
            if budget is not None:
                shape = budget.shape(mini, batch["input_ids"].shape[1], self.dp_size, self.name)
            step = self.update_program(loss_fn, mini // micro, normalisers, shape, group)
            args = (self.params, self.opt_state, batch, *self._abstract_counter(2))
            return [Program(name, step, args, state, named, True)]
        step = self.grouped_program(loss_fn, normalisers)
        everywhere = self.layout.replicated()

        def placed(tree):
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                               sharding=everywhere), tree)

        totals = placed(jax.eval_shape(step.totals, batch))
        mb = {k: jax.ShapeDtypeStruct((micro, *v.shape[1:]), v.dtype, sharding=v.sharding)
              for k, v in batch.items()}
        grads = self.trainable_params()
        counter = self._abstract_counter(3)
        _, metrics = jax.eval_shape(step.accumulate, self.params, grads, mb, totals, *counter)
        return [
            Program(name, step.accumulate, (self.params, grads, mb, totals, *counter),
                    (f"{self.name} params",),
                    {"params": self.params, "gradients": grads, "batch": mb}, True),
            Program(f"{name}.apply", step.apply,
                    (self.params, self.opt_state, grads, placed(metrics)), state,
                    {"params": self.params, "optimizer": self.opt_state, "gradients": grads},
                    True),
        ]

    def _abstract_counter(self, n: int) -> tuple:
        """() without adapter dropout, else an abstract `dropout_counter` of `n` values (the
        update programs' last argument)."""
        if self.dropout is None:
            return ()
        return (jax.ShapeDtypeStruct((n,), jnp.uint32, sharding=self.layout.replicated()),)

    @property
    def abstract(self) -> bool:
        """True for a group built from an abstract model (see `is_abstract`)."""
        return is_abstract(self.params)

    @property
    def dp_size(self) -> int:
        return dp_size(self.mesh)

    def model(self, params=None) -> nnx.Module:
        """The NNX model view of (the given or current) params; use inside jitted code."""
        return nnx.merge(self.graphdef, self.params if params is None else params)

    def __repr__(self) -> str:
        axes = ",".join(f"{k}={v}" for k, v in self.mesh.shape.items() if v > 1) or "1 device"
        return f"{type(self).__name__}({self.name!r}, pool={self.pool.name}, mesh={axes})"
