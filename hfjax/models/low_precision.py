"""Matmuls in the model's compute dtype, accumulated in float32, forward and backward: the
product every projection and the LM head run (`hfjax.models.transformer`).

`matmul` takes float32 master weights and activations, casts both to the compute dtype, and
returns the product in the dtype asked for; below float32 a custom VJP keeps the backward
pass's two dots in the compute dtype too, each written in a form XLA:CPU's low-precision kernel
takes as it is (`dot_form`; bench/precision_matmul.py measures them).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hfjax.models import backend


def matmul(x: jax.Array, w: jax.Array, dtype, out_dtype=None, *,
           transpose_w: bool = False) -> jax.Array:
    """x [M, K] @ w [K, N] (with `transpose_w`, x @ w.T for w [N, K], e.g. a tied embedding)
    with both operands in the compute `dtype`, result in `out_dtype` (default: `dtype`). x may
    also be [B, T, K] (a contraction over its last dimension only; `transformer._proj` says when).

    Below float32 the products are accumulated in float32, forward and backward, and the weight
    gradient comes back in w's dtype (the float32 master). Plain autodiff of a
    float32-accumulating dot would hand the backward pass a float32 cotangent, and both its
    matmuls would run in float32: the slow path on GPUs and TPUs, and for the LM head the
    largest matmuls of the model. Each of the three dots is written in a form that XLA:CPU's
    bf16 x bf16 -> f32 kernel takes as it is (`dot_form`): with AMX it runs 4-5x faster than
    float32 (about 2x with AVX-512 BF16), while a plain bf16 -> bf16 dot, or one whose
    transposed operand XLA folds into a contraction over the first dimension, runs no faster
    than float32
    (bench/precision_matmul.py).
    """
    dtype = jnp.dtype(dtype)
    out_dtype = dtype if out_dtype is None else jnp.dtype(out_dtype)
    if dtype == jnp.float32:
        w = w.astype(dtype)
        return (x.astype(dtype) @ (w.T if transpose_w else w)).astype(out_dtype)
    return _low_precision_matmul(x, w, dtype, out_dtype, transpose_w)


def dot_form(a: jax.Array, b: jax.Array, form: str) -> jax.Array:
    """A 2-D product accumulated in float32, in one of three forms: "ab" a [M, K] @ b [K, N],
    "abT" a @ b.T for b [N, K], "aTb" a.T @ b for a [M, K], b [M, N].

    "aTb" is the weight gradient's form. XLA:CPU folds a plain `a.T` into the dot as a
    contraction over the first dimension, which its low-precision kernel does not take (both
    operands would go to float32). On CPU, M is split into [M / 2, 2] and the dot contracts
    both: XLA then writes a.T out with a copy and runs the kernel on it (the split keeps a
    row-sharded M's sharding on its leading part). Other backends get the plain dot.
    """
    f32 = jnp.float32
    last = a.ndim - 1  # a may be [B, T, K]: its leading dimensions are all "M"
    if form == "ab":
        return jax.lax.dot_general(a, b, (((last,), (0,)), ((), ())), preferred_element_type=f32)
    if form == "abT":
        return jax.lax.dot_general(a, b, (((last,), (1,)), ((), ())), preferred_element_type=f32)
    if a.ndim > 2:  # [B, T, K] x [B, T, N]: contracting both leading dims is the form below
        lead = tuple(range(last))
        return jax.lax.dot_general(a, b, ((lead, lead), ((), ())), preferred_element_type=f32)
    m = a.shape[0]
    if m % 2 or backend.device_platform() != "cpu":
        return jnp.dot(a.T, b, preferred_element_type=f32)
    return jax.lax.dot_general(a.reshape(m // 2, 2, -1), b.reshape(m // 2, 2, -1),
                               (((0, 1), (0, 1)), ((), ())), preferred_element_type=f32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _low_precision_matmul(x, w, dtype, out_dtype, transpose_w):
    return _low_precision_matmul_fwd(x, w, dtype, out_dtype, transpose_w)[0]


def _low_precision_matmul_fwd(x, w, dtype, out_dtype, transpose_w):
    xc, wc = x.astype(dtype), w.astype(dtype)
    y = dot_form(xc, wc, "abT" if transpose_w else "ab").astype(out_dtype)
    # Empty arrays carry the primal dtypes to the backward pass (residuals must be arrays).
    return y, (xc, wc, jnp.empty((0,), x.dtype), jnp.empty((0,), w.dtype))


def _low_precision_matmul_bwd(dtype, out_dtype, transpose_w, res, g):
    del out_dtype
    xc, wc, x_dtype, w_dtype = res
    gc = g.astype(dtype)
    if transpose_w:  # y = x @ w.T: dx = g @ w, dw = g.T @ x
        dx, dw = dot_form(gc, wc, "ab"), dot_form(gc, xc, "aTb")
    else:  # y = x @ w: dx = g @ w.T, dw = x.T @ g
        dx, dw = dot_form(gc, wc, "abT"), dot_form(xc, gc, "aTb")
    return dx.astype(x_dtype.dtype), dw.astype(w_dtype.dtype)


_low_precision_matmul.defvjp(_low_precision_matmul_fwd, _low_precision_matmul_bwd)
