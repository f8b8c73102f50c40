"""make_optimizer's cosine decay (sft.lr_schedule=cosine): the step sizes follow a cosine from
lr to 0 over decay_steps."""

import math

import jax.numpy as jnp
import pytest

from hfjax.engine import update


def test_cosine_decay_steps_follow_the_cosine():
    lr, steps = 3e-3, 8
    opt = update.make_optimizer(lr, grad_clip=0.0, decay_steps=steps)
    params = jnp.zeros(())
    state = opt.init(params)
    for t in range(steps + 2):
        # A constant gradient makes Adam's bias-corrected m / sqrt(v) exactly 1 (eps aside),
        # so each update is minus that step's rate.
        u, state = opt.update(jnp.ones(()), state, params)
        want = lr * 0.5 * (1 + math.cos(math.pi * min(t, steps) / steps))
        assert float(-u) == pytest.approx(want, rel=1e-4, abs=1e-9), t  # float32 cosine


def test_constant_rate_without_decay_and_no_mixing_with_warmup():
    opt = update.make_optimizer(1e-3, grad_clip=0.0)
    state = opt.init(jnp.zeros(()))
    for _ in range(3):
        u, state = opt.update(jnp.ones(()), state, jnp.zeros(()))
        assert float(-u) == pytest.approx(1e-3, rel=1e-4)
    with pytest.raises(ValueError, match="decay_steps and warmup_steps together"):
        update.make_optimizer(1e-3, warmup_steps=2, decay_steps=4)
