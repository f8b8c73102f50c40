"""Public architecture presets: their shapes, random-weight loading and abstract building."""

import time

import jax
import numpy as np
import pytest
import torch
import transformers

import hfjax.models as M
from hfjax.models import presets, transformer
from hfjax.models.config import ModelConfig
from hfjax.parallel.mesh import MeshSpec

# Parameter counts as published with each model (billions, rounded as the model hubs show them).
PUBLIC_SIZES_B = {
    "llama2-7b": 6.74,
    "llama2-13b": 13.0,
    "codellama-34b": 33.7,
    "llama3.1-8b": 8.03,
    "llama3.1-70b": 70.6,
    "qwen2.5-0.5b": 0.494,
    "qwen2.5-7b": 7.62,
    "qwen2.5-32b": 32.8,
    "qwen2.5-72b": 72.7,
    "qwen3-8b": 8.19,
    "qwen3-32b": 32.8,
}


@pytest.mark.parametrize("name", sorted(PUBLIC_SIZES_B))
def test_preset_has_the_published_size(name):
    cfg = presets.get_preset(name)
    leaves = jax.tree.leaves(presets.abstract_state(name))
    counted = sum(int(np.prod(x.shape)) for x in leaves)
    assert counted == cfg.num_params()
    assert counted / 1e9 == pytest.approx(PUBLIC_SIZES_B[name], rel=6e-3)


@pytest.mark.parametrize("name", sorted(PUBLIC_SIZES_B))
def test_transformers_builds_the_same_model_from_the_preset_config(name):
    """The preset's HF config.json, built by transformers on the meta device (no memory): the
    same parameter count, and the family's q/k/v biases and q/k norms where expected."""
    cfg = presets.get_preset(name)
    hf = transformers.AutoConfig.for_model(**cfg.to_hf_config())
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    names = {n for n, _ in model.named_parameters()}
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    has_bias = "model.layers.0.self_attn.q_proj.bias" in names
    has_qk_norm = "model.layers.0.self_attn.q_norm.weight" in names
    assert (has_bias, has_qk_norm) == {
        "llama": (False, False), "qwen2": (True, False), "qwen3": (False, True)}[cfg.model_type]
    assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg


def test_llama31_rope_scaling_and_qwen_ties():
    llama = presets.get_preset("llama3.1-70b")
    assert llama.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 8192}
    assert llama.rope_theta == 500000.0 and llama.max_position_embeddings == 131072
    assert presets.get_preset("qwen2.5-0.5b").tie_word_embeddings
    assert not presets.get_preset("qwen2.5-7b").tie_word_embeddings
    # Qwen3-32B's attention is wider than its residual stream.
    q3 = presets.get_preset("qwen3-32b")
    assert q3.num_heads * q3.head_dim == 8192 != q3.hidden_size


def test_abstract_70b_allocates_nothing():
    before = len(jax.live_arrays())
    t0 = time.perf_counter()
    state = presets.abstract_state("llama3.1-70b")
    took = time.perf_counter() - t0
    assert len(jax.live_arrays()) == before
    assert took < 20
    assert presets.param_bytes("llama3.1-70b") == 4 * 70_553_706_496
    assert presets.param_bytes(presets.get_preset("llama3.1-70b").replace(
        param_dtype="bfloat16")) == 2 * 70_553_706_496
    emb = state["model"]["embed_tokens"].get_value()
    assert isinstance(emb, jax.ShapeDtypeStruct) and emb.shape == (128256, 8192)


SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
             num_kv_heads=2, head_dim=16)


def test_load_preset_builds_random_weights_in_their_shardings():
    mesh = MeshSpec.parse("fsdp=4,tensor=2").build(jax.devices())
    model = M.load("preset:qwen3-8b", mesh=mesh, seed=3, **SMALL)
    cfg = model.config
    assert (cfg.model_type, cfg.qk_norm, cfg.vocab_size, cfg.head_dim) == ("qwen3", True, 512, 16)
    layers = model.model.layers
    assert layers.q_norm[...].shape == (2, 16)
    # The training layout: embed over fsdp, heads over tensor.
    assert layers.q_proj[...].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    assert len(layers.q_proj[...].sharding.device_set) == 8
    # The same values as an unsharded build from the same seed (to rounding: XLA fuses the
    # jitted initialiser's scaling differently from the eager one).
    ref = transformer.build(cfg, seed=3)
    np.testing.assert_allclose(np.asarray(layers.up_proj[...]),
                               np.asarray(ref.model.layers.up_proj[...]), rtol=1e-6, atol=1e-9)
    ids = np.array([[1, 2, 3, 4]], np.int32)
    np.testing.assert_allclose(np.asarray(model(ids)), np.asarray(ref(ids)), atol=1e-5)


def test_load_preset_numerics_overrides():
    model = M.load("preset:qwen2.5-0.5b", dtype="bfloat16", param_dtype="float32", **SMALL)
    assert model.config.attention_bias and model.config.dtype == "bfloat16"
    assert model.model.layers.q_bias[...].dtype == np.float32


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown model preset 'qwen9-1t'; known: .*llama3.1-70b"):
        M.load("preset:qwen9-1t")
    with pytest.raises(ValueError, match=r"no tokenizer"):
        M.load_tokenizer("preset:qwen2.5-7b")
