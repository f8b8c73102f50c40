"""Bad checkpoints get one clear error naming the tensor or field, and no partial output."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
from hf_fixtures import make_hf_model
from safetensors.numpy import load_file, save_file

import hfjax.models as M
from hfjax.parallel.mesh import MeshSpec


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("llama"))
    make_hf_model("llama", d)
    return d


def _copy(src, tmp_path, name="bad"):
    dst = str(tmp_path / name)
    shutil.copytree(src, dst)
    return dst


def _edit_weights(path, fn):
    fn_path = os.path.join(path, "model.safetensors")
    tensors = load_file(fn_path)
    fn(tensors)
    save_file(tensors, fn_path, {"format": "pt"})


def test_unknown_architecture(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path)
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["model_type"] = "gpt_neox"
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ValueError, match="unknown architecture: model_type='gpt_neox'"):
        M.load(d)


def test_missing_tensor(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path)
    _edit_weights(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        M.load(d)


def test_shape_mismatch(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path)

    def shrink(t):
        name = "model.layers.0.self_attn.k_proj.weight"
        t[name] = t[name][:8]

    _edit_weights(d, shrink)
    with pytest.raises(ValueError, match=r"self_attn\.k_proj\.weight: shape \(8, 64\)"):
        M.load(d)


def test_mesh_that_does_not_divide(llama_dir):
    # 4 attention heads cannot be split 8 ways over `tensor`.
    mesh = MeshSpec.parse("tensor=8").build(jax.devices())
    with pytest.raises(ValueError, match=r"do not divide dimension 'heads'=4"):
        M.load(llama_dir, mesh=mesh)


def test_export_failure_leaves_no_partial_output(llama_dir, tmp_path):
    model = M.load(llama_dir)

    class Broken:
        def save(self, out_dir):
            raise RuntimeError("tokenizer write failed")

    out = tmp_path / "export"
    with pytest.raises(RuntimeError, match="tokenizer write failed"):
        M.save_hf(model, str(out), tokenizer=Broken())
    assert not out.exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-hfjax-")]


def test_sharded_index_round_trip(llama_dir, tmp_path):
    """save_hf splits into index-sharded files; load reads them back identically."""
    model = M.load(llama_dir)
    out = M.save_hf(model, str(tmp_path / "sharded"), max_shard_bytes=20_000)
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    again = M.load(out)
    ids = np.array([[1, 2, 3, 4]], np.int32)
    np.testing.assert_array_equal(np.asarray(model(ids)), np.asarray(again(ids)))


def test_max_layers_keeps_a_checkpoints_first_layers(llama_dir, tmp_path):
    """`max_layers` cuts an HF directory or a .gguf file to its first layers, their weights
    unchanged; a larger value keeps every layer, and a preset keeps its depth. Smoke mode sets
    it (0 means all, so 0 is lowered too)."""
    from hf_fixtures import make_tiny_gguf

    from configs import ppo_arith
    from launch import smoke

    gguf = make_tiny_gguf(tmp_path / "tiny.gguf")
    for path in (llama_dir, gguf):
        full, cut = M.load(path), M.load(path, max_layers=1)
        assert full.config.num_layers == 2 and cut.config.num_layers == 1
        full_state, cut_state = nnx_leaves(full), nnx_leaves(cut)
        for name, w in cut_state.items():
            ref = full_state[name]
            np.testing.assert_array_equal(w, ref[:1] if w.shape != ref.shape else ref, name)
        assert M.load(path, max_layers=5).config.num_layers == 2
    assert M.hf_io.read_model_config("preset:tiny", max_layers=1).num_layers == \
        M.hf_io.read_model_config("preset:tiny").num_layers
    cfg = ppo_arith.get_config()
    assert "model.max_layers 0->2" in smoke.shrink_config(cfg) and cfg.model.max_layers == 2


def nnx_leaves(model):
    from flax import nnx

    return {"/".join(map(str, k)): np.asarray(v.get_value())
            for k, v in nnx.to_flat_state(nnx.state(model))}
