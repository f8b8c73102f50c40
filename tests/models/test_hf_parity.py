"""hfjax logits against transformers on tiny random models of each family."""

import jax
import numpy as np
import pytest
from hf_fixtures import hf_logits, left_padded_batch, make_hf_model

import hfjax.models as M
from hfjax.parallel.mesh import MeshSpec
from hfjax.parallel.sharding import Layout

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]


@pytest.fixture(scope="module", params=FAMILIES)
def hf_model(request, tmp_path_factory):
    d = str(tmp_path_factory.mktemp(request.param))
    return request.param, make_hf_model(request.param, d), d


def _valid_max_diff(a, b, mask):
    return float(np.abs(a - b)[mask.astype(bool)].max())


@pytest.mark.parametrize("causal_block", [128, 5])
def test_logits_match_transformers(hf_model, causal_block, monkeypatch):
    """Rows of 12 columns: one attention block (the default) and causal query blocks of 5
    (blocks of 5, 5 and 2 columns, each reading only the keys up to its end)."""
    from hfjax.models import attention

    monkeypatch.setattr(attention, "CAUSAL_BLOCK", causal_block)
    kind, ref, path = hf_model
    ids, mask = left_padded_batch(ref.config.vocab_size)
    want = hf_logits(ref, ids, mask)
    for scan in (True, False):
        model = M.load(path, scan_layers=scan)
        got = np.asarray(model(ids, mask))
        assert got.shape == want.shape
        assert _valid_max_diff(got, want, mask) <= 1e-4, (kind, scan)


def test_sharded_logits_match(hf_model):
    kind, ref, path = hf_model
    mesh = MeshSpec.parse("fsdp=4,tensor=2").build(jax.devices())
    model = M.load(path, mesh=mesh)
    q = model.model.layers.q_proj.get_value()
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    assert len(q.sharding.device_set) == 8
    ids, mask = left_padded_batch(ref.config.vocab_size)
    got = np.asarray(jax.jit(lambda i, m: model(i, m))(ids, mask))
    assert _valid_max_diff(got, hf_logits(ref, ids, mask), mask) <= 1e-4


def test_export_round_trip(hf_model, tmp_path):
    import torch
    import transformers as tf

    kind, ref, path = hf_model
    model = M.load(path)
    out = M.save_hf(model, str(tmp_path / "export"))
    again = tf.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    ids, mask = left_padded_batch(ref.config.vocab_size, seed=3)
    got = np.asarray(model(ids, mask))
    assert _valid_max_diff(got, hf_logits(again, ids, mask), mask) <= 1e-5


def test_layout_is_the_only_difference():
    """The same logical axes map to different specs under different layouts."""
    cfg = M.ModelConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
    )
    mesh = MeshSpec.parse("fsdp=4,tensor=2").build(jax.devices())
    train = Layout(mesh).spec(("layers", "embed", "mlp"), (2, 32, 64))
    decode = Layout(mesh, {"embed": None, "mlp": "tensor"}).spec(
        ("layers", "embed", "mlp"), (2, 32, 64)
    )
    assert train == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    assert decode == jax.sharding.PartitionSpec(None, None, "tensor")
    del cfg
