"""Named model shapes: a tiny test size and the public architectures hfjax targets.

Each preset is the architecture only (no weights). `load("preset:NAME")` builds one with random
weights, sharded straight onto a mesh; `abstract_state("NAME")` gives its parameters as
`jax.ShapeDtypeStruct`s without allocating anything (what a dry run compiles from).
`ModelConfig.replace` changes numerics or execution flags, e.g.
`get_preset("qwen2.5-7b").replace(dtype="bfloat16")`.

The public presets copy the shape fields of each model's published `config.json` (the base
model's; the -Instruct variants share every shape and differ in `eos_token_id`,
`max_position_embeddings` and, for Qwen2.5-32B/-72B, `rms_norm_eps`=1e-6). The family flags
come with the model_type: q/k/v biases for qwen2, q/k RMSNorm for qwen3. Llama-3.1 uses llama3
RoPE scaling. Qwen3-32B's attention width (64 heads x 128) is larger than its hidden size 5120,
which is why `head_dim` is always explicit. The mixtures of experts (qwen3-30b-a3b,
qwen3-235b-a22b, mixtral-8x7b) carry their expert count, top-k and expert width
(`ModelConfig.num_params` / `active_params`: 30.5B / 3.3B, 235.1B / 22.2B, 46.7B / 12.9B).
"""

from __future__ import annotations

from hfjax.models.config import ModelConfig

_LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _qwen2(**kw) -> ModelConfig:
    return ModelConfig(model_type="qwen2", attention_bias=True, rope_theta=1000000.0,
                       bos_token_id=151643, eos_token_id=151643, **kw)


def _qwen3(**kw) -> ModelConfig:
    kw = {"model_type": "qwen3", **kw}
    return ModelConfig(qk_norm=True, vocab_size=151936, head_dim=128,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
                       tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645, **kw)


def _qwen3_moe(**kw) -> ModelConfig:
    return _qwen3(model_type="qwen3_moe", num_experts=128, num_experts_per_tok=8,
                  norm_topk_prob=True, **kw)


def _llama2(**kw) -> ModelConfig:
    kw = {"rope_theta": 10000.0, "max_position_embeddings": 4096, **kw}
    return ModelConfig(model_type="llama", vocab_size=32000, head_dim=128, rms_norm_eps=1e-5,
                       tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, **kw)


def _llama31(**kw) -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=128256, head_dim=128, rms_norm_eps=1e-5,
                       rope_theta=500000.0, rope_scaling=dict(_LLAMA31_ROPE),
                       max_position_embeddings=131072, tie_word_embeddings=False,
                       bos_token_id=128000, eos_token_id=128001, **kw)


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
    # Llama-3 8B (no RoPE scaling, 8K context): the shapes of Llama-3.1-8B.
    "llama3-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=8192, tie_word_embeddings=False,
    ),
    "llama3.1-8b": _llama31(hidden_size=4096, intermediate_size=14336, num_layers=32,
                            num_heads=32, num_kv_heads=8),
    "llama3.1-70b": _llama31(hidden_size=8192, intermediate_size=28672, num_layers=80,
                             num_heads=64, num_kv_heads=8),
    # The HybridFlow paper's model sizes (7B, 13B, 34B; Llama-2 architecture). Llama-2 has no
    # released 34B; Code Llama 34B (a Llama-2 derivative with grouped-query attention and a
    # 1e6 RoPE base) is the public 34B of that family.
    "llama2-7b": _llama2(hidden_size=4096, intermediate_size=11008, num_layers=32,
                         num_heads=32, num_kv_heads=32),
    "llama2-13b": _llama2(hidden_size=5120, intermediate_size=13824, num_layers=40,
                          num_heads=40, num_kv_heads=40),
    "codellama-34b": _llama2(hidden_size=8192, intermediate_size=22016, num_layers=48,
                             num_heads=64, num_kv_heads=8, rope_theta=1000000.0,
                             max_position_embeddings=16384),
    "qwen2.5-0.5b": _qwen2(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                           num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
                           rms_norm_eps=1e-6, max_position_embeddings=32768,
                           tie_word_embeddings=True),
    "qwen2.5-1.5b": _qwen2(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                           num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128,
                           rms_norm_eps=1e-6, max_position_embeddings=32768,
                           tie_word_embeddings=True),
    "qwen2.5-7b": _qwen2(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                         num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
                         rms_norm_eps=1e-6, max_position_embeddings=131072,
                         tie_word_embeddings=False),
    "qwen2.5-32b": _qwen2(vocab_size=152064, hidden_size=5120, intermediate_size=27648,
                          num_layers=64, num_heads=40, num_kv_heads=8, head_dim=128,
                          rms_norm_eps=1e-5, max_position_embeddings=131072,
                          tie_word_embeddings=False),
    "qwen2.5-72b": _qwen2(vocab_size=152064, hidden_size=8192, intermediate_size=29568,
                          num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
                          rms_norm_eps=1e-5, max_position_embeddings=131072,
                          tie_word_embeddings=False),
    "qwen3-8b": _qwen3(hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
                       num_kv_heads=8),
    "qwen3-32b": _qwen3(hidden_size=5120, intermediate_size=25600, num_layers=64, num_heads=64,
                        num_kv_heads=8),
    # Mixtures of experts: every layer sparse (no mlp_only_layers, decoder_sparse_step 1).
    "qwen3-30b-a3b": _qwen3_moe(hidden_size=2048, intermediate_size=6144,
                                moe_intermediate_size=768, num_layers=48, num_heads=32,
                                num_kv_heads=4),
    "qwen3-235b-a22b": _qwen3_moe(hidden_size=4096, intermediate_size=12288,
                                  moe_intermediate_size=1536, num_layers=94, num_heads=64,
                                  num_kv_heads=4),
    # Mixtral-8x7B v0.1: the experts are the `intermediate_size` MLPs, top-2 renormalised.
    "mixtral-8x7b": ModelConfig(
        model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=14336, norm_topk_prob=True,
    ),
}

PRESET_PREFIX = "preset:"


def get_preset(name: str) -> ModelConfig:
    """The ModelConfig registered under `name`; ValueError listing the known names otherwise."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


def preset_name(path: str) -> str | None:
    """NAME for a model path 'preset:NAME', None for any other path."""
    path = str(path)
    return path[len(PRESET_PREFIX):].strip() if path.startswith(PRESET_PREFIX) else None


def abstract_state(preset: str | ModelConfig, head: str = "causal_lm"):
    """The parameters of a preset (or config) as an nnx State of ShapeDtypeStructs.

    Nothing is allocated: the model is traced under `nnx.eval_shape`, so even a 70B preset
    takes a moment and no memory.
    """
    from flax import nnx

    from hfjax.models import transformer

    cfg = get_preset(preset) if isinstance(preset, str) else preset
    return nnx.state(transformer.abstract(cfg, head), nnx.Param)


def param_bytes(preset: str | ModelConfig, head: str = "causal_lm") -> int:
    """Total parameter bytes of a preset (or config) in its param_dtype, from abstract shapes."""
    import jax
    import numpy as np

    leaves = jax.tree.leaves(abstract_state(preset, head))
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves))
