"""FLOP counts of a decoder model's passes, from its config: what the planner prices
(`hfjax.planner.pricing`) and what MFU is measured against (`hfjax.run.mfu`)."""

from __future__ import annotations

from hfjax.models.config import ModelConfig


def layer_matmul_params(cfg: ModelConfig) -> int:
    """W: the matmul weights of one decoder layer (q, k, v, o and the gated MLP)."""
    return cfg.hidden_size * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + (
        3 * cfg.hidden_size * cfg.intermediate_size)


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
