"""Dropout on the LoRA adapters' input during training (PEFT's `lora_dropout`).

An adapted projection computes x @ W + (alpha / rank) * (dropout(x) @ A) @ B: the base
product sees x whole, the adapters a copy of x with each element zeroed with probability
`rate` and the rest scaled by 1 / (1 - rate). Every target projection of every layer draws its
own mask (PEFT gives each adapted module a dropout of its own).

Dropout happens only inside a training step's loss, and only there: an update program
(`hfjax.engine.update`) traces each micro-batch's loss under `training(key, rate)`, and the
decoder (`hfjax.models.transformer.Backbone`) reads the key while it is traced. Scoring,
reference log-probs, decoding, merging and export never enter that context, so they compute
the adapters on x whole. A model whose adapters have no dropout never gets a key: its
programs are those of a model without this module.

The key is a function of the run's seed and the step: `step_key(seed, counter)` folds a
counter (the group's update call, the mini-batch within it, and for length-grouped
micro-batches the micro-batch) into the seed's key, and the micro-batch scan folds in the
micro-batch's index. A resumed run restores the call count, so it draws the masks the
uninterrupted run drew.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp

# The entry of a layer's arrays (`Layers.arrays()`, sliced per layer) that holds its key.
LAYER_KEY = "lora_dropout_key"
# Separates the dropout's key stream from the adapters' initialisation under the same seed.
_STREAM = 0x10AD


@dataclasses.dataclass(frozen=True)
class Dropout:
    """Adapter dropout of a model: `rate` in (0, 1), masks drawn from keys of `seed`."""

    rate: float
    seed: int

    def __post_init__(self):
        if not 0.0 < self.rate < 1.0:
            raise ValueError(f"lora.dropout={self.rate}; adapter dropout needs a rate in (0, 1)")


_ACTIVE: contextvars.ContextVar[tuple[jax.Array, float] | None] = contextvars.ContextVar(
    "hfjax_lora_dropout", default=None)


@contextlib.contextmanager
def training(key: jax.Array, rate: float) -> Iterator[None]:
    """Within: the forward passes being traced apply adapter dropout of `rate` with masks
    drawn from `key` (a typed PRNG key, traced or not)."""
    token = _ACTIVE.set((key, float(rate)))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active() -> tuple[jax.Array, float] | None:
    """(key, rate) of the enclosing `training` context; None outside one."""
    return _ACTIVE.get()


def step_key(seed: int, counter: jax.Array) -> jax.Array:
    """The key of one update step: `seed`'s dropout stream with each entry of `counter` (a
    small integer vector, e.g. [update call, mini-batch]) folded in, in order."""
    key = jax.random.fold_in(jax.random.key(seed), _STREAM)
    for i in range(counter.shape[0]):
        key = jax.random.fold_in(key, counter[i])
    return key


def layer_keys(key: jax.Array, n_layers: int) -> jax.Array:
    """One key per decoder layer [n_layers], to ride with the stacked layer arrays."""
    return jax.random.split(key, n_layers)


def apply(x: jax.Array, key: jax.Array, rate: float) -> jax.Array:
    """x with each element zeroed with probability `rate` and the others divided by
    1 - rate (inverted dropout, in x's dtype)."""
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))
