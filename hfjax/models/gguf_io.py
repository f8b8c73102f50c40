"""Read llama-family GGUF files into HF-named float32 weights and an HF-style config.

A GGUF file (llama.cpp's format) holds metadata key/values and tensors, some of them block
quantized. This module turns it into what `hf_io.py` produces from a safetensors checkpoint:

- `read_gguf_config(path)`: a `config.json`-style dict for `LlamaForCausalLM`;
- `iter_gguf_tensors(path)`: `(hf_name, float32 array)` pairs in HF naming and HF shapes, one
  tensor at a time, so a caller can shard each onto devices before reading the next;
- `dequantize(data, ggml_type, shape)`: the block dequantizers, vectorised in NumPy.

Only the quantization types in `SUPPORTED_TENSOR_TYPES` are decoded; anything else is refused up
front, before any tensor is produced.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from absl import logging
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama",)

_MISSING = object()


# ----------------------------------------------------------------------------------------------
# Opening files and reading metadata


def open_gguf(path: str | os.PathLike[str]) -> GGUFReader:
    """Open a GGUF file for reading; returns a memory-mapped `gguf.GGUFReader`.

    Raises FileNotFoundError for a missing path, and ValueError for a file that is not GGUF or
    that is truncated or damaged (the reader fails, or a tensor runs past the end of the file).
    Later calls for the same unchanged file share the parsed reader (`_parse`).
    """
    path = Path(path)
    if not path.is_file():
        hint = " (it is a directory; pass the .gguf file inside it)" if path.is_dir() else ""
        raise FileNotFoundError(f"GGUF file not found: {str(path)!r}{hint}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{str(path)!r} is not a GGUF file: it starts with {magic!r}, not b'GGUF'")
    stat = path.stat()
    size = stat.st_size
    try:
        reader = _parse(str(path.resolve()), size, stat.st_mtime_ns, stat.st_ino)
    except Exception as err:  # noqa: BLE001  (the reader fails in numpy on a short file)
        raise ValueError(
            f"{str(path)!r} is a truncated or damaged GGUF file ({size} bytes; reading it "
            f"failed: {err}); download or copy it again") from None
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise ValueError(
                f"{str(path)!r} is truncated: tensor {t.name} ends at byte {end}, the file has "
                f"{size} bytes; download or copy it again")
    if reader.byte_order == "S":
        # Block scales are decoded as little-endian float16; a byte-swapped file would decode to
        # garbage rather than fail, so refuse it here.
        raise ValueError(
            f"{str(path)!r} is a big-endian GGUF file; hfjax reads little-endian files only"
        )
    return reader


@functools.lru_cache(maxsize=4)
def _parse(path: str, size: int, mtime_ns: int, inode: int) -> GGUFReader:
    """The reader of one version of a file (its path, size, modification time and inode).
    Parsing the metadata reads a tokenizer's vocabulary and merges element by element (3-4 s
    for SmolLM2's 49k tokens), and loading a model opens the file for its config, its tensors
    and its tokenizer: kept, a file is parsed once. A failure is not kept."""
    return GGUFReader(path)


def _decode_scalar(part: np.ndarray, value_type: GGUFValueType) -> Any:
    if value_type == GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    if value_type == GGUFValueType.BOOL:
        return bool(part[0])
    if value_type in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
        # The shortest decimal that round-trips the stored width: an f32 epsilon written as 1e-5
        # reads back as 1e-05, not 9.999999747378752e-06, matching the original config.json.
        return float(str(part.dtype.type(part[0])))
    return int(part[0])


def read_gguf_field(reader: GGUFReader, key: str, default: Any = _MISSING) -> Any:
    """One metadata value from an open GGUF file, as a Python value.

    Returns a str, int, float or bool for scalars and a list of those for arrays. A missing key
    returns `default` when one is given, else raises KeyError naming the key.
    """
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise KeyError(f"GGUF metadata has no key {key!r}")
        return default
    # Decoding through parts/data/types directly, instead of ReaderField.contents(), keeps this
    # working on every gguf release that pyproject.toml allows.
    types = field.types
    if types[0] == GGUFValueType.ARRAY:
        item_type = types[-1]
        return [_decode_scalar(field.parts[i], item_type) for i in field.data]
    return _decode_scalar(field.parts[field.data[0]], types[0])


def _architecture(reader: GGUFReader, path: str | os.PathLike[str]) -> str:
    arch = read_gguf_field(reader, "general.architecture", None)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF file {str(path)!r} has architecture {arch!r}; hfjax reads only "
            f"{list(SUPPORTED_ARCHITECTURES)} GGUF files. Convert the HF checkpoint with "
            "hf_io instead."
        )
    return arch


def _int_field(reader: GGUFReader, key: str, default: Any = _MISSING) -> int:
    value = read_gguf_field(reader, key, default)
    if isinstance(value, list):
        # Some files store per-layer head counts; a uniform list is still one number.
        if len(set(value)) != 1:
            raise ValueError(f"GGUF key {key!r} varies per layer ({value}); hfjax needs one value")
        value = value[0]
    return int(value)


def read_gguf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """An HF `config.json`-style dict for the llama model in a GGUF file.

    Returns a dict with `architectures`, `model_type`, sizes, head counts, `head_dim`,
    `rms_norm_eps`, `rope_theta`, `max_position_embeddings`, `tie_word_embeddings` (true when the
    file has no `output.weight`), token ids, and `rope_scaling` when the file declares one.
    Raises ValueError for an architecture other than llama.
    """
    reader = open_gguf(path)
    arch = _architecture(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    _check_tensor_names(tensors, path)

    def key(name: str) -> str:
        return f"{arch}.{name}"

    hidden = _int_field(reader, key("embedding_length"))
    heads = _int_field(reader, key("attention.head_count"))
    kv_heads = _int_field(reader, key("attention.head_count_kv"), heads)
    head_dim = read_gguf_field(reader, key("attention.key_length"), None)
    if head_dim is None:
        head_dim = read_gguf_field(reader, key("rope.dimension_count"), hidden // heads)
    # The embedding matrix is the ground truth; older files lack `{arch}.vocab_size`.
    vocab_size = int(tensors["token_embd.weight"].shape[1])

    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": _int_field(reader, key("feed_forward_length")),
        "num_hidden_layers": _int_field(reader, key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(head_dim),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rms_norm_eps": read_gguf_field(reader, key("attention.layer_norm_rms_epsilon"), 1e-5),
        "rope_theta": read_gguf_field(reader, key("rope.freq_base"), 10000.0),
        "max_position_embeddings": _int_field(reader, key("context_length"), 2048),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    for hf_key, gguf_key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ):
        value = read_gguf_field(reader, gguf_key, None)
        if value is not None:
            config[hf_key] = int(value)
    rope_scaling = _rope_scaling(reader, arch)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def _rope_scaling(reader: GGUFReader, arch: str) -> dict[str, Any] | None:
    kind = read_gguf_field(reader, f"{arch}.rope.scaling.type", None)
    factor = read_gguf_field(reader, f"{arch}.rope.scaling.factor", None)
    if kind is None:
        # Files from before `rope.scaling.type` existed spell linear scaling this way.
        linear = read_gguf_field(reader, f"{arch}.rope.scale_linear", None)
        if linear is not None and linear != 1.0:
            return {"rope_type": "linear", "factor": linear}
        return None
    if kind == "none":
        return None
    if kind not in ("linear", "yarn"):
        raise ValueError(
            f"GGUF rope scaling type {kind!r} is not supported; hfjax reads 'linear' and 'yarn'"
        )
    scaling: dict[str, Any] = {"rope_type": kind, "factor": factor if factor is not None else 1.0}
    original = read_gguf_field(reader, f"{arch}.rope.scaling.original_context_length", None)
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


# ----------------------------------------------------------------------------------------------
# Tensor names

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF llama parameter name for a GGUF tensor name, or None when there is none."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return None


def _check_tensor_names(tensors: dict[str, Any], path: str | os.PathLike[str]) -> None:
    if "rope_freqs.weight" in tensors:
        # llama.cpp bakes llama-3.1-style rope scaling into this tensor instead of metadata; its
        # parameters cannot be read back reliably, and ignoring it would give a silently wrong
        # model.
        raise ValueError(
            f"GGUF file {str(path)!r} carries 'rope_freqs.weight' (llama-3.1 style rope scaling), "
            "which hfjax does not read; load the HF safetensors checkpoint with hf_io instead"
        )
    unknown = [name for name in tensors if hf_tensor_name(name) is None]
    if unknown:
        raise ValueError(
            f"GGUF file {str(path)!r} has tensors hfjax cannot map to HF llama names: "
            f"{unknown[:8]}{' ...' if len(unknown) > 8 else ''}"
        )
    if "token_embd.weight" not in tensors:
        raise ValueError(f"GGUF file {str(path)!r} has no 'token_embd.weight' tensor")


# ----------------------------------------------------------------------------------------------
# Dequantization
#
# Each block type is (elements per block, bytes per block, decoder). A decoder maps a
# (n_blocks, bytes_per_block) uint8 array to (n_blocks, elements_per_block) float32. Scales are
# widened to float32 before multiplying, as ggml does, so results match llama.cpp bit for bit.


def _f16_column(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    # In Q4 blocks byte j holds element j in its low nibble and element j + 16 in its high one.
    return np.concatenate([packed & 0x0F, packed >> 4], axis=1)


def _decode_q8_0(blocks: np.ndarray) -> np.ndarray:
    scale = _f16_column(blocks, 0)
    quants = blocks[:, 2:].view(np.int8).astype(np.float32)
    return quants * scale


def _decode_q4_0(blocks: np.ndarray) -> np.ndarray:
    scale = _f16_column(blocks, 0)
    quants = _nibbles(blocks[:, 2:]).astype(np.float32) - np.float32(8)
    return quants * scale


def _decode_q4_1(blocks: np.ndarray) -> np.ndarray:
    scale = _f16_column(blocks, 0)
    minimum = _f16_column(blocks, 2)
    quants = _nibbles(blocks[:, 4:]).astype(np.float32)
    return quants * scale + minimum


def _decode_f32(blocks: np.ndarray) -> np.ndarray:
    return blocks.view(np.float32)


def _decode_f16(blocks: np.ndarray) -> np.ndarray:
    return blocks.view(np.float16).astype(np.float32)


def _decode_bf16(blocks: np.ndarray) -> np.ndarray:
    # bfloat16 is the top half of a float32: widen the bits and shift them into place.
    return (blocks.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


_BlockDecoder = Callable[[np.ndarray], np.ndarray]

_BLOCK_TYPES: dict[GGMLQuantizationType, tuple[int, int, _BlockDecoder]] = {
    GGMLQuantizationType.F32: (1, 4, _decode_f32),
    GGMLQuantizationType.F16: (1, 2, _decode_f16),
    GGMLQuantizationType.BF16: (1, 2, _decode_bf16),
    GGMLQuantizationType.Q8_0: (32, 34, _decode_q8_0),
    GGMLQuantizationType.Q4_0: (32, 18, _decode_q4_0),
    GGMLQuantizationType.Q4_1: (32, 20, _decode_q4_1),
}

SUPPORTED_TENSOR_TYPES: tuple[str, ...] = tuple(t.name for t in _BLOCK_TYPES)


def dequantize(
    data: np.ndarray, ggml_type: GGMLQuantizationType | int, shape: tuple[int, ...]
) -> np.ndarray:
    """Decode one GGUF tensor's stored data into float32.

    `data` is the tensor's storage in any dtype (raw uint8 bytes, or the float16/float32 view
    `GGUFReader` gives for unquantized types); `shape` is the NumPy (row-major, i.e. GGUF dims
    reversed) shape of the decoded tensor. Returns a new float32 array of that shape.
    Raises ValueError for an unsupported type or a size that does not fit the type's blocks.
    """
    qtype = GGMLQuantizationType(int(ggml_type))
    if qtype not in _BLOCK_TYPES:
        raise ValueError(
            f"GGUF tensor type {qtype.name} is not supported; supported types: "
            f"{list(SUPPORTED_TENSOR_TYPES)}"
        )
    block_elems, block_bytes, decode = _BLOCK_TYPES[qtype]
    n_elements = int(np.prod(shape, dtype=np.int64))
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if n_elements % block_elems or raw.size != n_elements // block_elems * block_bytes:
        raise ValueError(
            f"{qtype.name} data of {raw.size} bytes cannot hold a tensor of shape {tuple(shape)} "
            f"({block_elems} elements per {block_bytes}-byte block)"
        )
    blocks = raw.reshape(-1, block_bytes)
    out = decode(blocks).reshape(shape)
    # The F32 path is a view of the (possibly memory-mapped) input; the caller gets its own copy.
    return np.array(out, dtype=np.float32, copy=True)


# ----------------------------------------------------------------------------------------------
# Tensors in HF layout


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q_proj/k_proj rows; returns the HF row order.

    HF llama rotates the two halves of each head's dimensions against each other; llama.cpp
    rotates adjacent pairs. Its converter therefore interleaves each head's rows: stored row
    `2*j + s` of a head is HF row `s*head_dim/2 + j`. This de-interleaves them.
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} projection rows do not split into {n_heads} heads of even size")
    half = rows // n_heads // 2
    per_head = weight.reshape(n_heads, half, 2, *weight.shape[1:])
    return np.ascontiguousarray(per_head.swapaxes(1, 2).reshape(weight.shape))


def _check_tensor_types(reader: GGUFReader, path: str | os.PathLike[str]) -> None:
    bad = [
        (t.name, t.tensor_type)
        for t in reader.tensors
        if GGMLQuantizationType(int(t.tensor_type)) not in _BLOCK_TYPES
    ]
    if bad:
        name, qtype = bad[0]
        more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
        raise ValueError(
            f"GGUF file {str(path)!r}: tensor {name!r} has type "
            f"{GGMLQuantizationType(int(qtype)).name}{more}, which hfjax cannot dequantize; "
            f"supported types: {list(SUPPORTED_TENSOR_TYPES)}"
        )


def iter_gguf_tensors(path: str | os.PathLike[str], keep=None
                      ) -> Iterator[tuple[str, np.ndarray]]:
    """Yield `(hf_name, float32 array)` for every tensor in a llama GGUF file, one at a time
    (only those whose HF name `keep` accepts, when given; the others are not dequantized).

    Names and shapes are HF `LlamaForCausalLM`'s (e.g. `model.layers.3.self_attn.q_proj.weight`
    of shape [n_heads * head_dim, hidden]); q/k rows are restored to HF order. `lm_head.weight`
    appears only when the file has an untied output matrix. The whole file is validated
    (architecture, tensor names, tensor types) before the first tensor is yielded, so a bad file
    raises ValueError without producing partial output.
    """
    reader = open_gguf(path)
    arch = _architecture(reader, path)
    _check_tensor_names({t.name: t for t in reader.tensors}, path)
    _check_tensor_types(reader, path)
    n_heads = _int_field(reader, f"{arch}.attention.head_count")
    n_kv_heads = _int_field(reader, f"{arch}.attention.head_count_kv", n_heads)

    for tensor in reader.tensors:
        hf_name = hf_tensor_name(tensor.name)
        assert hf_name is not None  # _check_tensor_names guarantees it
        if keep is not None and not keep(hf_name):
            continue
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        weight = dequantize(tensor.data, tensor.tensor_type, shape)
        if hf_name.endswith("q_proj.weight"):
            weight = unpermute_rope_rows(weight, n_heads)
        elif hf_name.endswith("k_proj.weight"):
            weight = unpermute_rope_rows(weight, n_kv_heads)
        logging.vlog(1, "gguf %s -> %s %s", tensor.name, hf_name, weight.shape)
        yield hf_name, weight
