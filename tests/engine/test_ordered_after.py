"""`update.ordered_after`, the data edge that orders a loss's mask sums after the forward pass
and an update step's batch after its totals (the XLA:CPU workaround in hfjax/engine/update.py):
it keeps its value whatever the bits of `ready`, and it survives XLA's optimizations (an
optimization barrier did not: XLA:CPU removes it before running)."""

import jax
import jax.numpy as jnp
import numpy as np

from hfjax.engine.update import ordered_after

# Values whose bits are all zero but one, or special: the select must keep `x` for each.
READY = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1e-45, -1.0, 3.4e38], np.float32)


def test_the_value_is_unchanged_whatever_ready_holds():
    x = jnp.arange(16, dtype=jnp.int32).reshape(2, 8) - 3
    same_shape = jax.jit(ordered_after)(x, jnp.asarray(np.stack([READY, READY[::-1]])))
    np.testing.assert_array_equal(same_shape, x)
    for r in READY:  # a scalar `ready`, as the update step's totals
        np.testing.assert_array_equal(jax.jit(ordered_after)(x, jnp.float32(r)), x)
    mask = jnp.array([[True, False], [False, True]])
    np.testing.assert_array_equal(ordered_after(mask, jnp.zeros((2, 2), jnp.bfloat16)), mask)


def test_the_edge_is_in_the_optimized_program():
    x, ready = jnp.ones((4, 8), jnp.int32), jnp.zeros((4, 8), jnp.float32)
    hlo = jax.jit(ordered_after).lower(x, ready).compile().as_text()
    assert "select" in hlo and "bitcast-convert" in hlo, hlo
