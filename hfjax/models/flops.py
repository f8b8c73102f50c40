"""FLOP counts of a decoder model's passes, from its config: what the planner prices
(`hfjax.planner.pricing`) and what MFU is measured against (`hfjax.run.mfu`)."""

from __future__ import annotations

from hfjax.models.config import ModelConfig


def layer_matmul_params(cfg: ModelConfig) -> int:
    """W: the matmul weights a token passes through in one decoder layer (q, k, v, o and the
    gated MLP), averaged over the layers; a sparse layer counts its router and its
    `num_experts_per_tok` active experts (the active parameters, not the total)."""
    d = cfg.hidden_size
    attn = d * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    n_sparse = len(cfg.layer_indices("sparse"))
    dense = 3 * d * cfg.intermediate_size * (cfg.num_layers - n_sparse)
    sparse = n_sparse * d * (3 * cfg.moe_intermediate_size * cfg.num_experts_per_tok
                             + cfg.num_experts)
    return attn + (dense + sparse) // cfg.num_layers


def active_mlp_width(cfg: ModelConfig) -> float:
    """The MLP width a token's activations have in one layer, averaged over the layers: the
    dense MLP's `intermediate_size`, or in a sparse layer its k experts' k x
    `moe_intermediate_size` (what the planner's activation bytes count)."""
    n_sparse = len(cfg.layer_indices("sparse"))
    return ((cfg.num_layers - n_sparse) * cfg.intermediate_size
            + n_sparse * cfg.num_experts_per_tok * cfg.moe_intermediate_size) / cfg.num_layers


def layers_flops(cfg: ModelConfig, rows: int, tokens: int, context: int) -> float:
    """FLOPs of the decoder layers for `rows` x `tokens` new tokens attending over `context`
    keys each (2W + 4NH·context per token and layer)."""
    per_token = 2 * layer_matmul_params(cfg) + 4 * cfg.num_heads * cfg.head_dim * context
    return float(rows) * tokens * cfg.num_layers * per_token


def head_flops(cfg: ModelConfig, head: str, rows: int, seq: int, scored: int) -> float:
    """FLOPs of the output head: LM head on `scored` positions, value head on all, score head
    on one."""
    d = cfg.hidden_size
    if head == "causal_lm":
        return 2.0 * d * cfg.vocab_size * rows * scored
    if head == "value":
        return 2.0 * d * rows * seq
    return 2.0 * d * rows
