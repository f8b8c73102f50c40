"""bfloat16 compute over float32 master weights, forward and backward; float32 log-probs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hfjax.models import backend, low_precision, precision, transformer
from hfjax.models.presets import get_preset
from hfjax.numerics import core

CFG = get_preset("tiny").replace(vocab_size=512, num_layers=2)
IDS = jnp.asarray(np.random.default_rng(0).integers(0, 512, (4, 12)), jnp.int32)


def _loss_and_grads(cfg):
    model = transformer.build(cfg, seed=1)
    graphdef, params = nnx.split(model)

    def loss(p):
        logits = nnx.merge(graphdef, p)(IDS)
        return -core.logprobs_from_logits(logits[:, :-1], IDS[:, 1:]).mean()

    return jax.jit(jax.value_and_grad(loss))(params)


def _flat(tree):
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


@pytest.mark.parametrize("remat", ["none", "dots"])
def test_bf16_compute_over_f32_masters_trains_like_f32(remat):
    loss32, g32 = _loss_and_grads(CFG.replace(remat_policy=remat))
    loss16, g16 = _loss_and_grads(CFG.replace(dtype="bfloat16", param_dtype="float32",
                                              remat_policy=remat))
    # Master weights and their gradients stay float32.
    assert {x.dtype for x in jax.tree.leaves(g16)} == {jnp.dtype("float32")}
    a, b = _flat(g32), _flat(g16)
    assert np.isfinite(b).all()
    assert float(loss16) == pytest.approx(float(loss32), rel=2e-2)
    cosine = a @ b / np.linalg.norm(a) / np.linalg.norm(b)
    assert cosine > 0.995, cosine
    assert np.linalg.norm(b - a) / np.linalg.norm(a) < 0.1


def test_logits_and_logprobs_are_float32_not_rounded_to_bf16():
    model = transformer.build(CFG.replace(dtype="bfloat16"), seed=1)
    logits = model(IDS)
    assert logits.dtype == jnp.float32
    # A bfloat16 head would leave every logit on the bfloat16 grid.
    as_bf16 = logits.astype(jnp.bfloat16).astype(jnp.float32)
    assert float(jnp.mean(logits != as_bf16)) > 0.5
    ref = transformer.build(CFG, seed=1)
    lp16 = core.logprobs_from_logits(logits[:, :-1], IDS[:, 1:])
    lp32 = core.logprobs_from_logits(ref(IDS)[:, :-1], IDS[:, 1:])
    assert lp16.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(lp16), np.asarray(lp32), atol=0.05)


@pytest.mark.parametrize("rows", [8, 7])  # the weight gradient's split form, and odd rows
@pytest.mark.parametrize("transpose_w", [False, True])  # x @ w, and x @ w.T (a tied head)
def test_matmul_backward_stays_in_bf16_with_f32_accumulation(rows, transpose_w):
    x = jnp.asarray(np.random.default_rng(1).standard_normal((rows, 16)), jnp.bfloat16)
    w = jnp.asarray(np.random.default_rng(2).standard_normal((16, 4)), jnp.float32)
    if transpose_w:
        w = w.T

    def f(x, w):
        y = low_precision.matmul(x, w, jnp.bfloat16, jnp.float32, transpose_w=transpose_w)
        return jnp.sum(y**2)

    dx, dw = jax.jit(jax.grad(f, argnums=(0, 1)))(x, w)
    assert (dx.dtype, dw.dtype) == (jnp.bfloat16, jnp.float32)
    # Reference: float64 products of the bfloat16-rounded operands.
    x64 = np.asarray(x, np.float64)
    w64 = np.asarray(w.astype(jnp.bfloat16), np.float64)
    w64 = w64.T if transpose_w else w64
    g = 2 * x64 @ w64
    g_bf16 = np.asarray(jnp.asarray(g, jnp.bfloat16), np.float64)  # the cotangent in bf16
    dw_ref = x64.T @ g_bf16
    np.testing.assert_allclose(np.asarray(dw), dw_ref.T if transpose_w else dw_ref,
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dx, np.float64), g_bf16 @ w64.T, rtol=1e-2, atol=1e-2)
    # Every dot of the backward pass multiplies bfloat16 by bfloat16 into float32: none is a
    # float32 dot fed by an upcast operand. And no left operand is contracted over its first
    # dimension alone (a transposed x): XLA:CPU converts such a dot's operands to float32
    # (bench/precision_matmul.py).
    jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x, w)
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 3
    for e in dots:
        assert [v.aval.dtype for v in e.invars] == [jnp.bfloat16, jnp.bfloat16]
        assert e.params["preferred_element_type"] == jnp.float32
        (lhs_c, _), _ = e.params["dimension_numbers"]
        if rows % 2 == 0:
            assert tuple(lhs_c) != (0,), e


def test_f32_matmul_is_the_plain_product():
    x = jnp.asarray(np.random.default_rng(3).standard_normal((5, 7)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(4).standard_normal((7, 3)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(low_precision.matmul(x, w, jnp.float32)),
                                  np.asarray(x @ w))


AMX_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
"""
ZEN5_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni
"""
EPYC_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13 64-Core Processor
flags\t\t: fpu sse2 avx2 amx_fp16_lookalike xavx512_bf16
"""


def test_native_bf16_detection_and_auto_dtype():
    assert precision.native_bf16_flags(AMX_CPUINFO) == ("amx_bf16", "avx512_bf16")
    assert precision.native_bf16_flags(ZEN5_CPUINFO) == ("avx512_bf16",)
    assert precision.native_bf16_flags(EPYC_CPUINFO) == ()  # whole flags only
    assert precision.native_bf16_flags("") == ()  # no /proc/cpuinfo
    auto = backend.compute_dtype
    big, small = precision.BF16_MIN_HIDDEN, precision.BF16_MIN_HIDDEN - 1
    assert auto("auto", "cpu", big, AMX_CPUINFO) == "bfloat16"
    assert auto("auto", "cpu", big, ZEN5_CPUINFO) == "bfloat16"
    assert auto("auto", "cpu", small, AMX_CPUINFO) == "float32"  # too small to repay the casts
    assert auto("auto", "cpu", small, ZEN5_CPUINFO) == "float32"
    assert auto("auto", "cpu", big, EPYC_CPUINFO) == "float32"  # emulated bf16
    assert auto("auto", "cpu", None, AMX_CPUINFO) == "float32"
    assert auto("auto", "tpu", 128, EPYC_CPUINFO) == "bfloat16"
    assert auto("auto", "gpu") == "bfloat16"
    assert auto("float32", "tpu") == "float32" and auto("bfloat16", "cpu", 8) == "bfloat16"
    with pytest.raises(ValueError, match="model.dtype='fp8'"):
        auto("fp8", "cpu")
    # This host: the answer agrees with the flags line the kernel reports.
    with open(precision.CPUINFO) as f:
        flags_line = next((ln for ln in f if ln.startswith("flags")), "").split()
    assert precision.native_bf16_flags() == tuple(
        f for f in precision.NATIVE_BF16_FLAGS if f in flags_line)
