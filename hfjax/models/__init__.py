"""The decoder model family, its heads, presets, and HF / GGUF weights in and out."""

from hfjax.models.config import ModelConfig
from hfjax.models.hf_io import load, save_hf
from hfjax.models.transformer import (
    Backbone,
    CausalLM,
    KVCache,
    ScoreModel,
    ValueModel,
    build,
    positions_from_mask,
)


def load_tokenizer(path: str):
    """A `Tokenizer` from an HF directory (tokenizer.json) or a `.gguf` file."""
    from hfjax.models.tokenizer import load_tokenizer as _load

    return _load(path)


__all__ = [
    "Backbone",
    "CausalLM",
    "KVCache",
    "ModelConfig",
    "ScoreModel",
    "ValueModel",
    "build",
    "load",
    "load_tokenizer",
    "positions_from_mask",
    "save_hf",
]
