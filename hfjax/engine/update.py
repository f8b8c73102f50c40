"""Micro-batched gradient steps: one jitted program per mini-batch.

A mini-batch arrives as arrays with a leading batch axis, sharded over the data-parallel axes.
The program views it as [n_micro, micro, ...] with a *strided* split (micro-batch i takes rows
i, i + n_micro, ...), so every micro-batch is spread over all data-parallel devices instead of
sitting on one of them. A `lax.scan` accumulates gradients over the micro-batches, then one
optimizer update is applied. Parameters and optimizer state are donated.

Each loss function returns its micro-batch loss already weighted by the micro-batch's share of
the mini-batch normaliser (its share of the tokens for token-mean, of the sequences for a
sequence mean), so the accumulated gradient is exactly the gradient of the mini-batch loss,
whatever the micro-batch size.

With a token budget (`use_remove_padding`), the mini-batch is instead packed into rows of real
tokens and cut into micro-batches by the budget, a `lax.while_loop` over as many as its lengths
need (`hfjax.engine.packing`); the loss functions and their weighting are the same.
Length-grouped micro-batches (`group_by_length`, `hfjax.engine.grouping`) differ in shape, so
there each one is a call of its own program that adds into a donated gradient accumulator, and
a last program applies the update (`make_grouped_update_step`).

Non-finite numbers are caught inside the program (no host round trip; the trainer reads the
flags with the step's metrics):
- when the mini-batch loss or the gradient norm is NaN or infinite, the optimizer update is not
  applied: the step returns its parameters and optimizer state as they were, `nonfinite` = 1;
- when a finite gradient still makes a parameter non-finite (an update that overflows float32),
  `nonfinite_params` = 1. That update has been applied: taking it back would need a copy of
  the parameters and optimizer state alive through the update (measured: +1.25x the parameters'
  bytes of temporary memory with a select), where a `lax.cond` on the loss and gradient norm
  costs nothing. The trainer therefore ends the run on it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from hfjax.engine import packing as packing_lib
from hfjax.engine.packing import PackShape
from hfjax.models import lora_dropout

LossFn = Callable[[Any, dict[str, jax.Array], dict[str, jax.Array]], tuple[jax.Array, dict]]


def strided_micro_batches(x: jax.Array, n_micro: int, group: int = 1) -> jax.Array:
    """[B, ...] -> [n_micro, B // n_micro, ...] where micro-batch i holds rows i::n_micro, or
    with `group` > 1 the groups of `group` consecutive rows (a prompt's samples) i::n_micro."""
    b = x.shape[0]
    y = jnp.swapaxes(x.reshape((b // (n_micro * group), n_micro, group) + x.shape[1:]), 0, 1)
    return y.reshape((n_micro, b // n_micro) + x.shape[1:])


def _unstride(y: jax.Array, group: int) -> jax.Array:
    """The inverse of `strided_micro_batches`: [n_micro, B // n_micro, ...] -> [B, ...]."""
    n_micro, rows = y.shape[:2]
    y = y.reshape((n_micro, rows // group, group) + y.shape[2:])
    return jnp.swapaxes(y, 0, 1).reshape((n_micro * rows,) + y.shape[3:])


def in_micro_batches(fn: Callable, n_micro: int, *arrays: Any, group: int = 1) -> Any:
    """`fn(*arrays)` computed over `n_micro` strided micro-batches of the arrays' rows (rows, or
    groups of `group` rows, i::n_micro, as the update takes them), one after another, with the
    outputs put back in row order: a scoring pass whose working set (e.g. [rows, positions,
    vocabulary] logits) is that of one micro-batch. n_micro = 1: one pass."""
    if n_micro == 1:
        return fn(*arrays)
    # Arguments may be pytrees of row arrays (None and empty ones too).
    out = jax.lax.map(lambda xs: fn(*xs), tuple(
        jax.tree.map(lambda a: strided_micro_batches(a, n_micro, group), x) for x in arrays))
    return jax.tree.map(lambda y: _unstride(y, group), out)


def scoring_micro_batches(rows: int, micro_rows: int) -> int:
    """How many micro-batches a scoring pass over `rows` takes: rows / micro_rows when that
    divides evenly into several, else 1 (one pass)."""
    if micro_rows <= 0 or rows <= micro_rows or rows % micro_rows:
        return 1
    return rows // micro_rows


def split_trainable(params, trainable) -> tuple[Any, Any]:
    """(what trains, what stays frozen) of a model state: `trainable` is an NNX filter (e.g.
    `nnx.LoRAParam`, `hfjax.models.lora`) or None (everything trains; frozen is None)."""
    if trainable is None:
        return params, None
    return nnx.split_state(params, trainable, ...)


def with_frozen(loss_fn: LossFn, frozen) -> LossFn:
    """`loss_fn` as a function of the trainable part of the state, `frozen` held fixed (no
    gradient is formed for it, so no accumulator or optimizer state either)."""
    if frozen is None:
        return loss_fn
    return lambda train, mb, totals: loss_fn(nnx.merge_state(train, frozen), mb, totals)


def join_trainable(train, frozen):
    """The inverse of `split_trainable`."""
    return train if frozen is None else nnx.merge_state(train, frozen)


def under_dropout(loss_fn: LossFn, dropout: lora_dropout.Dropout | None, key) -> Callable:
    """`loss_fn` as fn(params, micro_batch, totals, i): micro-batch i's loss traced under
    adapter dropout (`hfjax.models.lora_dropout`) with `key` and i folded in; without
    `dropout`, `loss_fn` itself (i unused)."""
    if dropout is None:
        return lambda params, mb, totals, i: loss_fn(params, mb, totals)

    def keyed(params, mb, totals, i):
        with lora_dropout.training(jax.random.fold_in(key, i), dropout.rate):
            return loss_fn(params, mb, totals)

    return keyed


def make_update_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    n_micro: int,
    param_shardings: Any = None,
    opt_shardings: Any = None,
    normalisers: Callable[[dict[str, jax.Array]], dict[str, jax.Array]] | None = None,
    jit: Callable = jax.jit,
    packing: PackShape | None = None,
    group: int = 1,
    trainable: Any = None,
    dropout: lora_dropout.Dropout | None = None,
) -> Callable:
    """Returns step(params, opt_state, batch) -> (params, opt_state, metrics), compiled with
    `jit` (a worker group's `WorkerGroup.jit`, which traces under its layout).

    `loss_fn(params, micro_batch, totals)` returns (weighted loss, metrics dict of scalars);
    `normalisers(batch)` computes mini-batch totals (e.g. token counts) passed as `totals`.
    Metrics are summed over micro-batches (they are weighted like the loss), plus `grad_norm`,
    `nonfinite` (1 when the update was not applied) and `nonfinite_params` (1 when the applied
    update left a non-finite parameter), see the module docstring.

    With `packing`, the mini-batch is packed and cut into micro-batches by its token budget
    instead (`hfjax.engine.packing`, `n_micro` unused); `loss_fn` then reads its micro-batch's
    outputs with `packing.response_values`. `group`: micro-batches take whole groups of that
    many consecutive rows (a prompt's samples, `hfjax.engine.shared_prompt`).

    `trainable` (an NNX filter, see `split_trainable`): only those variables get gradients and
    updates (the optimizer state is theirs); the rest pass through unchanged (LoRA's frozen
    base).

    `dropout` (LoRA adapter dropout, `hfjax.models.lora_dropout`): the step takes a fourth
    argument, `counter` (a small uint32 vector, e.g. [update call, mini-batch]), and traces
    micro-batch i's loss under the key `lora_dropout.step_key(dropout.seed, counter)` with i
    folded in (packed micro-batches: their first packed row). Without it the step is
    step(params, opt_state, batch), its program that of a model without dropout.
    """

    def _scan_micro_batches(loss_fn, params, batch, totals, keyed):
        micro = jax.tree.map(lambda x: strided_micro_batches(x, n_micro, group), batch)
        grad_fn = jax.value_and_grad(keyed, has_aux=True)

        def body(acc, xs):
            i, mb = xs if dropout is not None else (None, xs)
            (loss, metrics), grads = grad_fn(params, mb, totals, i)
            g_acc, m_acc = acc
            g_acc = jax.tree.map(jnp.add, g_acc, grads)
            m_acc = jax.tree.map(jnp.add, m_acc, {"loss": loss, **metrics})
            return (g_acc, m_acc), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        first = jax.eval_shape(lambda: loss_fn(params, jax.tree.map(lambda x: x[0], micro), totals))
        m0 = {"loss": jnp.zeros((), jnp.float32)}
        m0.update({k: jnp.zeros(v.shape, v.dtype) for k, v in first[1].items()})
        xs = micro if dropout is None else (jnp.arange(n_micro, dtype=jnp.uint32), micro)
        (grads, metrics), _ = jax.lax.scan(body, (zeros, m0), xs)
        return grads, metrics

    def step(params, opt_state, batch, counter=None):
        totals = normalisers(batch) if normalisers else {}
        if totals:  # the micro-batches read the batch once the totals exist (`ordered_after`)
            ready = sum(jnp.sum(t).astype(jnp.float32) for t in jax.tree.leaves(totals))
            batch = jax.tree.map(lambda x: ordered_after(x, ready), batch)
        train, frozen = split_trainable(params, trainable)
        loss = with_frozen(loss_fn, frozen)
        if dropout is not None and counter is None:
            raise ValueError("an update step with adapter dropout takes a counter (its fourth "
                             "argument) to draw its masks from")
        key = None if dropout is None else lora_dropout.step_key(dropout.seed, counter)
        keyed = under_dropout(loss, dropout, key)
        if packing is None:
            grads, metrics = _scan_micro_batches(loss, train, batch, totals, keyed)
        else:
            # A packed micro-batch is known by its first packed row (`accumulate_grads`).
            grads, metrics = packing_lib.accumulate_grads(
                lambda p, mb, t: keyed(p, mb, t, mb["first_row"]), train, batch, totals,
                packing)
        train, opt_state, metrics = apply_grads(optimizer, train, opt_state, grads, metrics)
        return join_trainable(train, frozen), opt_state, metrics

    shardings = _state_shardings(param_shardings, opt_shardings)
    if shardings and dropout is not None:
        shardings["in_shardings"] += (None,)
    return jit(step, donate_argnums=(0, 1), **shardings)


def make_grouped_update_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    param_shardings: Any = None,
    opt_shardings: Any = None,
    normalisers: Callable[[dict[str, jax.Array]], dict[str, jax.Array]] | None = None,
    jit: Callable = jax.jit,
    trainable: Any = None,
    grad_shardings: Any = None,
    dropout: lora_dropout.Dropout | None = None,
) -> Callable:
    """Returns step(params, opt_state, mini_batch, micro_batches) -> (params, opt_state,
    metrics) for micro-batches of different shapes (`hfjax.engine.grouping`): one compiled
    program per micro-batch shape adds its gradient into the accumulator (donated), then one
    applies the update as `make_update_step` does. `normalisers` are taken over the whole
    mini-batch; `micro_batches` is an iterable of micro-batch dicts already on the mesh.
    `trainable`: as in `make_update_step`; the gradients then have `grad_shardings` (the
    trainable part's). `dropout`: as in `make_update_step`; `micro_batches` then yields
    (micro-batch, counter) pairs, each counter naming its micro-batch (e.g. [update call,
    mini-batch, micro-batch])."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if trainable is None:
        grad_shardings = param_shardings

    def accumulate(params, grads, mb, totals, counter=None):
        train, frozen = split_trainable(params, trainable)
        if dropout is not None:  # one micro-batch: its counter names it whole
            key = lora_dropout.step_key(dropout.seed, counter)
            fn = functools.partial(under_dropout(with_frozen(loss_fn, frozen), dropout, key),
                                   i=0)
            (loss, metrics), g = jax.value_and_grad(fn, has_aux=True)(train, mb, totals)
        else:
            (loss, metrics), g = jax.value_and_grad(with_frozen(loss_fn, frozen), has_aux=True)(
                train, mb, totals) if frozen is not None else grad_fn(params, mb, totals)
        return jax.tree.map(jnp.add, grads, g), {"loss": loss, **metrics}

    grads_out = {} if grad_shardings is None else {"out_shardings": (grad_shardings, None)}
    add = jit(accumulate, donate_argnums=1, **grads_out)
    zeros = jit(lambda p: jax.tree.map(jnp.zeros_like, split_trainable(p, trainable)[0]),
                **({} if grad_shardings is None else {"out_shardings": grad_shardings}))
    totals_of = jit(normalisers or (lambda _: {}))
    kw = _state_shardings(param_shardings, opt_shardings)
    if kw:  # (params, opt_state, grads, metrics)
        kw["in_shardings"] = (param_shardings, opt_shardings, grad_shardings, None)

    def apply_trainable(params, opt_state, grads, metrics):
        train, frozen = split_trainable(params, trainable)
        train, opt_state, metrics = apply_grads(optimizer, train, opt_state, grads, metrics)
        return join_trainable(train, frozen), opt_state, metrics

    apply = jit(apply_trainable, donate_argnums=(0, 1), **kw)

    def step(params, opt_state, batch, micro_batches):
        totals = totals_of(batch)
        grads, sums = zeros(params), None
        for mb in micro_batches:
            if dropout is None:
                grads, metrics = add(params, grads, mb, totals)
            else:
                grads, metrics = add(params, grads, mb[0], totals, mb[1])
            sums = metrics if sums is None else jax.tree.map(jnp.add, sums, metrics)
        if sums is None:
            raise ValueError("a grouped update step needs at least one micro-batch")
        return apply(params, opt_state, grads, sums)

    # Its compiled parts, for listings at abstract shapes (`WorkerGroup.programs`): the
    # normalisers, one micro-batch's gradient accumulation, and the optimizer update.
    step.totals, step.accumulate, step.apply = totals_of, add, apply
    return step


def apply_grads(optimizer: optax.GradientTransformation, params, opt_state, grads,
                metrics: dict[str, jax.Array]):
    """One optimizer update with the accumulated `grads` unless the loss (`metrics["loss"]`)
    or the gradient norm is not finite (module docstring); adds `grad_norm`, `nonfinite` and
    `nonfinite_params` to the metrics."""
    metrics = dict(metrics)
    metrics["grad_norm"] = optax.tree_utils.tree_norm(grads)
    ok = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])

    def apply(state):
        p, s = state
        updates, s = optimizer.update(grads, s, p)
        p = optax.apply_updates(p, updates)
        return p, s, jnp.logical_not(all_finite(p))

    # A cond, not a select: the update still runs in place on the donated buffers.
    params, opt_state, broke = jax.lax.cond(
        ok, apply, lambda state: (*state, jnp.bool_(False)), (params, opt_state))
    metrics["nonfinite"] = 1.0 - ok.astype(jnp.float32)
    metrics["nonfinite_params"] = broke.astype(jnp.float32)
    return params, opt_state, metrics


def _state_shardings(param_shardings, opt_shardings) -> dict:
    """in/out shardings pinning (params, opt_state, ...) to theirs; {} when not given."""
    if param_shardings is None:
        return {}
    return dict(in_shardings=(param_shardings, opt_shardings, None),
                out_shardings=(param_shardings, opt_shardings, None))


def all_finite(tree: Any) -> jax.Array:
    """True (a device scalar) when no floating-point leaf of `tree` holds a NaN or infinity."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    if not leaves:
        return jnp.bool_(True)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def make_optimizer(
    lr: float,
    *,
    weight_decay: float = 0.0,
    grad_clip: float = 1.0,
    warmup_steps: int = 0,
    betas: tuple[float, float] = (0.9, 0.999),
    decay_steps: int = 0,
) -> optax.GradientTransformation:
    """AdamW with optional global-norm clipping and linear warm-up to a constant rate; with
    `decay_steps` (and no warm-up) the rate follows a cosine from `lr` to 0 over that many
    steps instead, which lets a fixed-length warm start settle to a lower loss."""
    if decay_steps and warmup_steps:
        raise ValueError("make_optimizer: decay_steps and warmup_steps together; use one")
    schedule = optax.linear_schedule(0.0, lr, warmup_steps) if warmup_steps else lr
    if decay_steps:
        schedule = optax.cosine_decay_schedule(lr, decay_steps)
    if warmup_steps:
        schedule = optax.join_schedules([schedule, optax.constant_schedule(lr)], [warmup_steps])
    parts = []
    if grad_clip and grad_clip > 0:
        parts.append(optax.clip_by_global_norm(grad_clip))
    parts.append(optax.adamw(schedule, b1=betas[0], b2=betas[1], weight_decay=weight_decay))
    return optax.chain(*parts)


def mini_batch_rows(n: int, mini: int, epochs: int, shuffle: bool, seed: int, group: int = 1):
    """Yields each mini-batch's row indices for `epochs` passes over `n` rows, a fresh
    permutation per epoch when shuffling; `group` > 1 permutes whole groups of that many
    consecutive rows (a prompt's samples stay together and in order)."""
    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        order = np.arange(n)
        if shuffle:
            order = (rng.permutation(n // group)[:, None] * group + np.arange(group)).reshape(-1)
        for start in range(0, n, mini):
            yield order[start : start + mini]


def check_mini_batching(n: int, mini: int, micro: int, dp: int, who: str) -> None:
    """Raises ValueError unless n sequences split into mini-batches of micro-batches evenly."""
    if mini <= 0 or n % mini:
        raise ValueError(
            f"{who}: mini-batch of {mini} sequences does not divide the batch of {n}; "
            "pick ppo_mini_batch_size so that train_batch_size is a multiple of it"
        )
    if micro <= 0 or mini % micro:
        raise ValueError(
            f"{who}: micro-batch of {micro} sequences does not divide the mini-batch of {mini}; "
            "pick ppo_micro_batch_size as a divisor of the mini-batch"
        )
    if micro % dp:
        raise ValueError(
            f"{who}: micro-batch of {micro} sequences does not split over {dp} data-parallel "
            "devices; make ppo_micro_batch_size a multiple of the data-parallel size"
        )


def normalisers(batch):
    """Mini-batch totals that losses divide by: response tokens and non-empty sequences."""
    mask = batch["response_mask"]
    return {
        "tokens": jnp.maximum(jnp.sum(mask), 1).astype(jnp.float32),
        "seqs": jnp.maximum(jnp.sum(jnp.any(mask > 0, axis=-1)), 1).astype(jnp.float32),
    }


def ordered_after(x: jax.Array, ready: jax.Array) -> jax.Array:
    """`x`, unchanged, as a value that exists only once `ready` (a scalar, or x's shape) does.

    A workaround for XLA:CPU (jaxlib 0.10.2): a program read back from the persistent
    compilation cache loses the order between a while loop that holds collectives (the
    layers' scan, with its FSDP all-gathers) and the collectives outside it (a mask's sum), as
    its thunks are deserialized (`WhileThunkFromProto` gives the loop body its own
    collective resource). Devices then enter the two in different orders and deadlock. The
    losses read their masks through this with `ready` the forward pass's output, and the
    update step reads its batch after the totals, so data orders them on every device. An
    optimization barrier does not: XLA:CPU removes it before running. The select keeps `x`
    (a 32-bit pattern with its low bit set is never zero); elementwise, it costs nothing
    next to the model.
    """
    bits = jax.lax.bitcast_convert_type(jax.lax.stop_gradient(ready).astype(jnp.float32),
                                        jnp.int32)
    return jnp.where((bits | 1) != 0, x, jnp.zeros_like(x))


def share_of_normaliser(mask, totals, loss_agg_mode: str):
    """This micro-batch's share of the mini-batch normaliser for the aggregation mode."""
    if loss_agg_mode == "token-mean":
        return jnp.sum(mask).astype(jnp.float32) / totals["tokens"]
    return jnp.sum(jnp.any(mask > 0, axis=-1)).astype(jnp.float32) / totals["seqs"]
