"""Named model shapes: a tiny test size and the common open models hfjax targets.

Each preset is the architecture only (no weights); `ModelConfig.replace` changes numerics or
execution flags, e.g. `PRESETS["smollm2-135m"].replace(dtype="bfloat16")`.
"""

from hfjax.models.config import ModelConfig

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True,
    ),
    "smollm2-135m": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True,
    ),
    "qwen2.5-0.5b": ModelConfig(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
        num_heads=14, num_kv_heads=2, head_dim=64, model_type="qwen2", attention_bias=True,
        rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": ModelConfig(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
        num_heads=12, num_kv_heads=2, head_dim=128, model_type="qwen2", attention_bias=True,
        rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=True,
    ),
    "qwen2.5-7b": ModelConfig(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
        num_heads=28, num_kv_heads=4, head_dim=128, model_type="qwen2", attention_bias=True,
        rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=False,
    ),
    "llama3-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=8192, tie_word_embeddings=False,
    ),
}


def get_preset(name: str) -> ModelConfig:
    """The ModelConfig registered under `name`; ValueError listing the known names otherwise."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]
