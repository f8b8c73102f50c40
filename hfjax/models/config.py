"""Model configuration for the decoder family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3).

One dataclass covers the family; the differences are flags (q/k/v bias, q/k RMSNorm, tied
embeddings, llama3 RoPE scaling). `from_hf_config` / `to_hf_config` translate to and from an HF
`config.json` dictionary.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

# model_type -> (HF architecture class name, family flags that differ from plain Llama).
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": {"architecture": "LlamaForCausalLM"},
    "mistral": {"architecture": "MistralForCausalLM"},
    "qwen2": {"architecture": "Qwen2ForCausalLM", "attention_bias": True},
    "qwen3": {"architecture": "Qwen3ForCausalLM", "qk_norm": True},
}

REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
# hfjax.models.attention.IMPLEMENTATIONS (kept here so that the config needs no JAX kernels).
ATTENTION_IMPLS = ("auto", "dense", "xla", "cudnn", "blockwise", "splash")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static shape and numerics description of one decoder model."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    model_type: str = "llama"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # llama3-style scaling: {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}; None for plain RoPE.
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # Numerics: parameters are stored in param_dtype; matmuls run in dtype.
    param_dtype: str = "float32"
    dtype: str = "float32"
    # Execution: scan over stacked layers (flat compile time) and the remat policy.
    scan_layers: bool = True
    remat_policy: str = "none"
    # The attention implementation (hfjax.models.attention): auto picks one per platform.
    attention_impl: str = "auto"

    def __post_init__(self):
        if self.model_type not in ARCHITECTURES:
            raise ValueError(
                f"unknown model_type {self.model_type!r}; supported: {sorted(ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads="
                f"{self.num_kv_heads}; grouped-query attention needs whole groups"
            )
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(
                f"unknown remat_policy {self.remat_policy!r}; choose one of {REMAT_POLICIES}"
            )
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(
                f"unknown attention_impl {self.attention_impl!r}; choose one of {ATTENTION_IMPLS}"
            )
        for name in ("param_dtype", "dtype"):
            if getattr(self, name) not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"{name}={getattr(self, name)!r}; use float32 or bfloat16")

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def jnp_param_dtype(self):
        return jnp.dtype(self.param_dtype)

    def replace(self, **kw) -> ModelConfig:
        return dataclasses.replace(self, **kw)

    def num_params(self) -> int:
        """Total parameter count (embeddings counted once when tied)."""
        d, i, h = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * h * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.attention_bias:
            attn += h * (self.num_heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            attn += 2 * h
        layer = attn + 3 * d * i + 2 * d
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + emb + d

    @classmethod
    def from_hf_config(cls, hf: dict, **overrides) -> ModelConfig:
        """Builds a config from an HF `config.json` dictionary.

        Raises ValueError naming the field when the architecture or a field is unsupported.
        """
        model_type = hf.get("model_type")
        if model_type not in ARCHITECTURES:
            archs = hf.get("architectures")
            raise ValueError(
                f"unknown architecture: model_type={model_type!r} architectures={archs}; "
                f"hfjax supports model_type in {sorted(ARCHITECTURES)}"
            )
        required = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
        missing = [k for k in required if k not in hf]
        if missing:
            raise ValueError(f"config.json is missing field(s) {missing}")
        n_heads = hf["num_attention_heads"]
        rope_scaling = hf.get("rope_scaling")
        rope_theta = hf.get("rope_theta")
        # Newer HF configs fold theta and scaling into `rope_parameters`.
        rp = hf.get("rope_parameters")
        if rp:
            rope_theta = rp.get("rope_theta", rope_theta)
            if rp.get("rope_type", "default") != "default":
                rope_scaling = dict(rp)
        if rope_scaling is not None:
            rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if rope_type in (None, "default"):
                rope_scaling = None
            elif rope_type != "llama3":
                raise ValueError(
                    f"config.json rope_scaling type {rope_type!r} is not supported; "
                    "hfjax supports default and llama3 RoPE"
                )
            else:
                rope_scaling = {
                    "rope_type": "llama3",
                    "factor": float(rope_scaling["factor"]),
                    "low_freq_factor": float(rope_scaling["low_freq_factor"]),
                    "high_freq_factor": float(rope_scaling["high_freq_factor"]),
                    "original_max_position_embeddings": int(
                        rope_scaling["original_max_position_embeddings"]
                    ),
                }
        flags = ARCHITECTURES[model_type]
        kw = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=n_heads,
            num_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
            model_type=model_type,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", flags.get("attention_bias", False))),
            qk_norm=flags.get("qk_norm", False),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
        )
        kw.update(overrides)
        return cls(**kw)

    def to_hf_config(self) -> dict:
        """Returns an HF `config.json` dictionary that transformers loads."""
        hf = {
            "architectures": [ARCHITECTURES[self.model_type]["architecture"]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            # A copy: consumers such as transformers normalise the dict in place.
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.param_dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "use_cache": True,
        }
        if self.model_type == "llama":
            hf["attention_bias"] = self.attention_bias
            hf["mlp_bias"] = False
        if self.model_type == "qwen3":
            hf["attention_bias"] = self.attention_bias
        if self.model_type in ("qwen2", "qwen3", "mistral"):
            hf["sliding_window"] = None
            hf["use_sliding_window"] = False
        return hf


def scratch_model_config(m, vocab_size: int, pad_id: int, eos_id: int,
                         max_positions: int, compute_dtype: str = "float32") -> ModelConfig:
    """The config of a model trained from scratch, from the `model` config section; it holds
    `max_positions` tokens (the task's longest prompt plus response) and computes in
    `compute_dtype` (`model.dtype` resolved for the platform) over `model.param_dtype`
    weights."""
    return ModelConfig(
        vocab_size=m.vocab_size or vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        tie_word_embeddings=True,
        param_dtype=m.param_dtype,
        dtype=compute_dtype,
        scan_layers=m.scan_layers,
        remat_policy=m.remat_policy,
        attention_impl=m.attention_impl,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        max_position_embeddings=max_positions,
    )
