"""Model configuration for the decoder family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, and the
mixtures of experts Qwen3-MoE and Mixtral).

One dataclass covers the family; the differences are flags (q/k/v bias, q/k RMSNorm, tied
embeddings, llama3 RoPE scaling, a sparse MLP: `num_experts` > 0). `from_hf_config` /
`to_hf_config` translate to and from an HF `config.json` dictionary.
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
    "qwen3_moe": {"architecture": "Qwen3MoeForCausalLM", "qk_norm": True, "moe": True},
    "mixtral": {"architecture": "MixtralForCausalLM", "moe": True, "norm_topk_prob": True},
}

# hfjax.models.backend.MOE_IMPLS (kept here so that the config needs no JAX kernels).
MOE_IMPLS = ("auto", "ragged", "capacity")

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
    # Multimodal RoPE (Qwen2.5-VL): the head_dim/2 frequencies split into temporal, height and
    # width bands, each rotated by its own position component; () is plain RoPE.
    mrope_section: tuple[int, ...] = ()
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
    # Mixture of experts (`hfjax.models.moe`): 0 experts is a dense model. A sparse layer
    # routes each token to `num_experts_per_tok` of `num_experts` gated MLPs of
    # `moe_intermediate_size`; layers in `mlp_only_layers`, or whose index + 1 is not a
    # multiple of `decoder_sparse_step`, keep a dense MLP of `intermediate_size` (Qwen3-MoE's
    # definitions). `norm_topk_prob` renormalises the k routing weights to sum to 1.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Dispatch (`hfjax.models.backend.moe_impl`): dropless grouped matmul or capacity buffers
    # of capacity_factor x the mean load per expert (tokens past it are dropped).
    moe_impl: str = "auto"
    capacity_factor: float = 1.25

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
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        object.__setattr__(self, "mrope_section", tuple(int(i) for i in self.mrope_section))
        if self.mrope_section and (len(self.mrope_section) != 3
                                   or 2 * sum(self.mrope_section) != self.head_dim):
            raise ValueError(f"mrope_section={list(self.mrope_section)} must be 3 bands (temporal, "
                             f"height, width) summing to head_dim/2={self.head_dim // 2}")
        self._check_moe()

    def _check_moe(self):
        """Refuses sparse settings that cannot run, each in one line naming the fix."""
        E, k = self.num_experts, self.num_experts_per_tok
        if self.moe_impl not in MOE_IMPLS:
            raise ValueError(f"moe_impl={self.moe_impl!r}; choose one of {MOE_IMPLS}")
        if ARCHITECTURES[self.model_type].get("moe") and E <= 0:
            raise ValueError(f"model_type={self.model_type!r} is a mixture of experts; set "
                             "num_experts > 0")
        if E < 0:
            raise ValueError(f"num_experts={E}; use 0 for a dense model or a positive count")
        if E == 0:
            return
        if not 1 <= k <= E:
            raise ValueError(f"num_experts_per_tok={k} with num_experts={E}: each token needs "
                             f"between 1 and {E} experts")
        if self.moe_intermediate_size <= 0:
            raise ValueError(f"num_experts={E} needs moe_intermediate_size > 0 (the experts' "
                             "MLP width)")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step={self.decoder_sparse_step}; use 1 (every "
                             "layer sparse) or more")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"mlp_only_layers={list(self.mlp_only_layers)} names layer(s) "
                             f"{bad} of a {self.num_layers}-layer model")
        if not any(self.sparse_layers()):
            raise ValueError("num_experts > 0 but no layer is sparse (mlp_only_layers / "
                             "decoder_sparse_step leave every layer dense); set num_experts=0")
        if self.model_type == "mixtral" and (not self.norm_topk_prob
                                             or not all(self.sparse_layers())):
            raise ValueError("Mixtral renormalises its top-k weights and has no dense layers; "
                             "set norm_topk_prob=True and leave mlp_only_layers empty")
        if self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor={self.capacity_factor}; use a positive factor")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def sparse_layers(self) -> tuple[bool, ...]:
        """Whether each layer's MLP is the mixture of experts (Qwen3-MoE's rule: not in
        `mlp_only_layers` and (index + 1) a multiple of `decoder_sparse_step`)."""
        return tuple(self.num_experts > 0 and i not in self.mlp_only_layers
                     and (i + 1) % self.decoder_sparse_step == 0
                     for i in range(self.num_layers))

    def layer_indices(self, kind: str) -> tuple[int, ...]:
        """The layers that hold a parameter of `kind`: "all", "sparse" (router and experts)
        or "dense" (the gated MLP's gate/up/down)."""
        sparse = self.sparse_layers()
        if kind == "all":
            return tuple(range(self.num_layers))
        want = kind == "sparse"
        return tuple(i for i, s in enumerate(sparse) if s == want)

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
        n_sparse = len(self.layer_indices("sparse"))
        mlps = (self.num_layers - n_sparse) * 3 * d * i + n_sparse * (
            3 * d * self.moe_intermediate_size * self.num_experts + d * self.num_experts)
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + 2 * d) + mlps + emb + d

    def active_params(self) -> int:
        """Parameters a token passes through: the total with each sparse layer's experts
        counted `num_experts_per_tok` times instead of `num_experts` (the router in full)."""
        idle = self.num_experts - self.num_experts_per_tok
        n_sparse = len(self.layer_indices("sparse"))
        return self.num_params() - n_sparse * idle * 3 * self.hidden_size * (
            self.moe_intermediate_size)

    @classmethod
    def from_hf_config(cls, hf: dict, **overrides) -> ModelConfig:
        """Builds a config from an HF `config.json` dictionary.

        Raises ValueError naming the field when the architecture or a field is unsupported.
        """
        model_type = hf.get("model_type")
        if model_type == "qwen2_5_vl":
            raise ValueError("a Qwen2.5-VL checkpoint is a vision-language model: "
                             "hfjax.models.qwen2_5_vl.load_hf loads it, and launch.train trains "
                             "it as the actor (model.path); the other entry points and roles "
                             "(launch.sft, reward, cost and teacher models) take text-only "
                             "checkpoints (docs/vision.md)")
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
        moe = {}
        if flags.get("moe"):
            # Published Qwen3-MoE configs say num_experts, transformers 5 writes
            # num_local_experts; Mixtral's experts are `intermediate_size` wide.
            n_exp = hf.get("num_experts", hf.get("num_local_experts"))
            if not n_exp or "num_experts_per_tok" not in hf:
                raise ValueError(f"config.json of a {model_type} model is missing num_experts "
                                 "(or num_local_experts) / num_experts_per_tok")
            moe = dict(num_experts=int(n_exp), num_experts_per_tok=int(hf["num_experts_per_tok"]),
                       moe_intermediate_size=int(hf.get("moe_intermediate_size")
                                                 or hf["intermediate_size"]),
                       norm_topk_prob=bool(hf.get("norm_topk_prob",
                                                  flags.get("norm_topk_prob", False))),
                       decoder_sparse_step=int(hf.get("decoder_sparse_step") or 1),
                       mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()))
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
            **moe,
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
        if self.model_type in ("qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral"):
            hf["sliding_window"] = None
            hf["use_sliding_window"] = False
        if self.model_type == "qwen3_moe":
            hf.update(attention_bias=self.attention_bias, num_experts=self.num_experts,
                      moe_intermediate_size=self.moe_intermediate_size,
                      norm_topk_prob=self.norm_topk_prob,
                      decoder_sparse_step=self.decoder_sparse_step,
                      mlp_only_layers=list(self.mlp_only_layers))
        if self.model_type == "mixtral":
            hf.update(num_local_experts=self.num_experts,
                      intermediate_size=self.moe_intermediate_size)
        if self.is_moe:
            hf.update(num_experts_per_tok=self.num_experts_per_tok, output_router_logits=False)
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
        num_experts=m.num_experts,
        num_experts_per_tok=m.num_experts_per_tok if m.num_experts else 0,
        moe_intermediate_size=(m.moe_intermediate_size or m.intermediate_size
                               if m.num_experts else 0),
        moe_impl=m.moe_impl,
        capacity_factor=m.capacity_factor,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        max_position_embeddings=max_positions,
    )
