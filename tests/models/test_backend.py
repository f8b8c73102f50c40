"""Every per-backend choice, per explicit target (`hfjax.models.backend`), and the dtypes a
program compiled here for a GPU or TPU target holds its attention inputs in."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from hfjax.models import backend, presets, transformer
from hfjax.models import rope as rope_lib

F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)


def test_storage_dtype_is_the_target_s():
    # These tests run on CPU devices: a CPU keeps a 16-bit model's attention in float32, an
    # accelerator in its compute dtype, and so does a program compiled here for one.
    assert backend.device_platform() == "cpu"
    assert backend.storage_dtype(BF16) == F32
    assert backend.storage_dtype(BF16, "cpu") == F32
    assert backend.storage_dtype(jnp.float16, "cpu") == F32
    for platform in ("gpu", "cuda", "tpu"):
        assert backend.storage_dtype(BF16, platform) == BF16
    assert backend.storage_dtype(F32, "gpu") == F32
    with backend.compiling_for("gpu"):
        assert backend.storage_dtype(BF16) == BF16
        assert backend.storage_dtype(BF16, "cpu") == F32  # an explicit platform wins
    with backend.compiling_for("cpu"):
        assert backend.storage_dtype(BF16) == F32
    assert backend.storage_dtype(BF16) == F32  # the context is left


def test_attention_impl_per_target():
    assert backend.attention_impl("auto", BF16, 64) == "dense"  # these CPU devices
    assert backend.attention_impl("auto", BF16, 64, "cpu") == "dense"
    assert backend.attention_impl("xla", F32, 64) == "xla"
    assert backend.attention_impl("cudnn", BF16, 64) == "blockwise"  # no GPU here
    # A GPU target: blockwise is auto; a TPU target's splash cannot compile here: blockwise.
    assert backend.attention_impl("auto", BF16, 64, "gpu") == "blockwise"
    assert backend.attention_impl("auto", BF16, 128, "tpu") == "blockwise"
    with backend.compiling_for("gpu"):  # a dry run for a GPU target
        assert backend.target_platform() == "gpu" and backend.stand_in()
        assert backend.attention_impl("auto", BF16, 64) == "blockwise"
    assert backend.target_platform() == "cpu" and not backend.stand_in()
    assert backend.cudnn_takes(F32, 64) is not None
    assert backend.cudnn_takes(BF16, 60) is not None
    assert backend.cudnn_takes(BF16, 128) is None
    with pytest.raises(ValueError, match="attention_impl='flash'"):
        backend.attention_impl("flash", F32, 64)


def test_decode_fusion_and_sampling_per_target():
    assert backend.decode_choice() == ("full", "cpu")
    assert backend.decode_choice(platform="tpu") == ("full", "gpu")
    # "auto" on a GPU is the Pallas read; it cannot compile on these CPU devices, so the
    # chunked read stands in, unless the kernel is interpreted.
    assert backend.decode_choice(platform="gpu") == ("chunked", "gpu")
    assert backend.decode_choice(platform="gpu", interpret=True) == ("pallas", "gpu")
    assert backend.decode_choice("full", "cpu", platform="gpu") == ("full", "cpu")
    with pytest.raises(ValueError, match="kv_layout=gpu"):
        backend.decode_choice("pallas", "cpu")
    with pytest.raises(ValueError, match="rollout.kv_layout='paged'"):
        backend.decode_choice("auto", "paged")
    assert not backend.fuse_projections()
    assert backend.fuse_projections(platform="gpu") and backend.fuse_projections(1, "tpu")
    assert not backend.fuse_projections(2, "gpu")  # a tensor axis splits the weights
    assert not backend.blocked_token_draw()
    assert backend.blocked_token_draw("gpu") and backend.blocked_token_draw("tpu")
    with backend.compiling_for("tpu"):
        assert backend.fuse_projections() and backend.blocked_token_draw()


def test_compute_dtype_and_remat_policy():
    assert backend.compute_dtype("auto", "gpu") == "bfloat16"
    assert backend.compute_dtype("auto", "tpu") == "bfloat16"
    assert backend.compute_dtype("auto", "cpu", hidden_size=64) == "float32"  # too small
    assert backend.compute_dtype("float32", "gpu") == "float32"
    with backend.compiling_for("gpu"):
        assert backend.compute_dtype("auto") == "bfloat16"
    calls = []

    def peak(n):
        return lambda: calls.append(n) or n

    assert backend.remat_policy("dots") == "dots"
    assert backend.remat_policy("auto") == "full"  # a plan: no dry run to decide with
    assert backend.remat_policy("auto", None, peak(5)) == "none"  # no memory known
    assert calls == []  # ... and nothing compiled for it
    limit = 1000
    fits = int(backend.REMAT_HEADROOM * limit)
    assert backend.remat_policy("auto", limit, peak(fits)) == "none"
    assert backend.remat_policy("auto", limit, peak(fits + 1)) == "full"
    assert calls == [fits, fits + 1]


def test_attention_inputs_compiled_for_a_gpu_target_are_bf16():
    """The model's q/k/v, traced on these CPU devices: float32 for a CPU, bfloat16 when the
    program is compiled for a GPU target (as the dry run compiles it)."""
    cfg = dataclasses.replace(presets.get_preset("tiny"), dtype="bfloat16")
    stacked = transformer.build(cfg, "causal_lm", seed=0).model.layers.arrays()
    p = {k: v[0] for k, v in stacked.items()}
    h = jnp.zeros((2, 8, cfg.hidden_size), BF16)
    positions = jnp.broadcast_to(jnp.arange(8), (2, 8))

    def dtypes():
        rope = rope_lib.rope_tables(positions, rope_lib.rope_inv_freq(cfg),
                                       backend.storage_dtype(cfg.jnp_dtype), 8)
        q, k, v = jax.eval_shape(lambda p, h: transformer.attention_inputs(cfg, rope, p, h),
                                 p, h)
        return {q.dtype, k.dtype, v.dtype}

    assert dtypes() == {F32}
    with backend.compiling_for("gpu"):
        assert dtypes() == {BF16}


def test_the_remaining_differences_are_stated():
    assert backend.stand_in_differences("cpu") == ""  # compiled on what it runs on
    gpu = backend.stand_in_differences("cuda")
    assert "for gpu" in gpu and "XLA:CPU" in gpu and "Pallas decode read" in gpu
    assert "splash" in backend.stand_in_differences("tpu")
