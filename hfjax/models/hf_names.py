"""HF tensor names <-> hfjax parameter paths: each family's name templates and the layout
conversions between an HF tensor and hfjax's parameter (heads split out, matrices transposed,
experts stacked), used by the safetensors loader and writer (hfjax/models/hf_io.py)."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

from hfjax.models import moe
from hfjax.models.config import ModelConfig


def _heads(w, n):  # [n*h, d] -> [d, n, h]
    return w.T.reshape(w.shape[1], n, -1)


# our parameter path -> (HF name template, HF -> ours, ours -> HF). `{i}` is the layer index.
_L = "model.layers.{i}."
CONVERTERS: dict[str, tuple[str, Callable, Callable]] = {
    "model.embed_tokens": ("model.embed_tokens.weight", lambda w, c: w, lambda w, c: w),
    "model.norm": ("model.norm.weight", lambda w, c: w, lambda w, c: w),
    "lm_head": ("lm_head.weight", lambda w, c: w.T, lambda w, c: w.T),
    "score": ("score.weight", lambda w, c: w.T, lambda w, c: w.T),
    "model.layers.input_norm": (_L + "input_layernorm.weight", lambda w, c: w, lambda w, c: w),
    "model.layers.post_attn_norm": (
        _L + "post_attention_layernorm.weight",
        lambda w, c: w,
        lambda w, c: w,
    ),
    "model.layers.q_proj": (
        _L + "self_attn.q_proj.weight",
        lambda w, c: _heads(w, c.num_heads),
        lambda w, c: w.reshape(w.shape[0], -1).T,
    ),
    "model.layers.k_proj": (
        _L + "self_attn.k_proj.weight",
        lambda w, c: _heads(w, c.num_kv_heads),
        lambda w, c: w.reshape(w.shape[0], -1).T,
    ),
    "model.layers.v_proj": (
        _L + "self_attn.v_proj.weight",
        lambda w, c: _heads(w, c.num_kv_heads),
        lambda w, c: w.reshape(w.shape[0], -1).T,
    ),
    "model.layers.o_proj": (
        _L + "self_attn.o_proj.weight",
        lambda w, c: w.T.reshape(c.num_heads, c.head_dim, -1),
        lambda w, c: w.reshape(-1, w.shape[-1]).T,
    ),
    "model.layers.q_bias": (
        _L + "self_attn.q_proj.bias",
        lambda w, c: w.reshape(c.num_heads, -1),
        lambda w, c: w.reshape(-1),
    ),
    "model.layers.k_bias": (
        _L + "self_attn.k_proj.bias",
        lambda w, c: w.reshape(c.num_kv_heads, -1),
        lambda w, c: w.reshape(-1),
    ),
    "model.layers.v_bias": (
        _L + "self_attn.v_proj.bias",
        lambda w, c: w.reshape(c.num_kv_heads, -1),
        lambda w, c: w.reshape(-1),
    ),
    "model.layers.q_norm": (_L + "self_attn.q_norm.weight", lambda w, c: w, lambda w, c: w),
    "model.layers.k_norm": (_L + "self_attn.k_norm.weight", lambda w, c: w, lambda w, c: w),
    "model.layers.gate_proj": (_L + "mlp.gate_proj.weight", lambda w, c: w.T, lambda w, c: w.T),
    "model.layers.up_proj": (_L + "mlp.up_proj.weight", lambda w, c: w.T, lambda w, c: w.T),
    "model.layers.down_proj": (_L + "mlp.down_proj.weight", lambda w, c: w.T, lambda w, c: w.T),
}

_T = (lambda w, c: w.T, lambda w, c: w.T)
# Mixtures of experts: the router and each expert's projections, per family. `{e}` is the
# expert index; an expert's HF tensor is one [out, in] slice of our [experts, in, out] stack.
MOE_CONVERTERS: dict[str, dict[str, tuple[str, Callable, Callable]]] = {
    "qwen3_moe": {
        "model.layers.router": (_L + "mlp.gate.weight", *_T),
        "model.layers.expert_gate": (_L + "mlp.experts.{e}.gate_proj.weight", *_T),
        "model.layers.expert_up": (_L + "mlp.experts.{e}.up_proj.weight", *_T),
        "model.layers.expert_down": (_L + "mlp.experts.{e}.down_proj.weight", *_T),
    },
    "mixtral": {
        "model.layers.router": (_L + "block_sparse_moe.gate.weight", *_T),
        "model.layers.expert_gate": (_L + "block_sparse_moe.experts.{e}.w1.weight", *_T),
        "model.layers.expert_up": (_L + "block_sparse_moe.experts.{e}.w3.weight", *_T),
        "model.layers.expert_down": (_L + "block_sparse_moe.experts.{e}.w2.weight", *_T),
    },
}
EXPERT_PARAMS = ("model.layers.expert_gate", "model.layers.expert_up", "model.layers.expert_down")

# HF tensors that carry nothing hfjax needs.
IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def converters(model_type: str = "llama") -> dict[str, tuple[str, Callable, Callable]]:
    """Our parameter path -> (HF name template, HF -> ours, ours -> HF) for a family."""
    return {**CONVERTERS, **MOE_CONVERTERS.get(model_type, {})}


@functools.cache
def _hf_name_index(model_type: str) -> list[tuple[re.Pattern, str]]:
    out = []
    for ours, (tmpl, _, _) in converters(model_type).items():
        pat = re.escape(tmpl).replace(re.escape("{i}"), r"(?P<i>\d+)")
        pat = pat.replace(re.escape("{e}"), r"(?P<e>\d+)")
        out.append((re.compile("^" + pat + "$"), ours))
    return out


def parse_hf_name(name: str, model_type: str = "llama"
                  ) -> tuple[str, int | None, int | None] | None:
    """(our parameter path, layer index or None, expert index or None) for an HF tensor name
    of a `model_type` checkpoint; None if unknown."""
    for pat, ours in _hf_name_index(model_type):
        m = pat.match(name)
        if m:
            groups = m.groupdict()
            i, e = groups.get("i"), groups.get("e")
            return ours, None if i is None else int(i), None if e is None else int(e)
    return None


def stacked_layers(cfg: ModelConfig, path: str) -> list[int] | None:
    """The layer indices a stacked parameter `path` holds, in order (None: not stacked)."""
    if not path.startswith("model.layers."):
        return None
    return list(cfg.layer_indices(moe.layer_kind(cfg, path.split(".")[-1])))
