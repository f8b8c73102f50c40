"""Tiny random HF models built by transformers inside the tests (the reference)."""

import numpy as np
import torch

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)


def make_hf_model(kind: str, out_dir: str, seed: int = 0):
    """Builds, saves and returns a tiny random transformers model of the given family."""
    import transformers as tf

    torch.manual_seed(seed)
    if kind == "llama":
        cfg = tf.LlamaConfig(
            **TINY,
            tie_word_embeddings=False,
            rope_theta=50000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**TINY, tie_word_embeddings=True))
    elif kind == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**TINY, tie_word_embeddings=False))
    elif kind == "mistral":
        model = tf.MistralForCausalLM(
            tf.MistralConfig(**TINY, tie_word_embeddings=False, sliding_window=None)
        )
    elif kind in MOE:
        model = make_hf_moe(kind)
    else:
        raise ValueError(kind)
    # Random init leaves norms at 1 and biases at 0; perturb them so they are exercised.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith(".gate.weight"):
                # A router at initialisation scale gives near-equal probabilities: scaled up,
                # its top-k has clear margins (no near-ties for rounding to flip).
                p.copy_(torch.randn_like(p))
    model.eval()
    model.save_pretrained(out_dir)
    return model


# Tiny mixtures of experts: Qwen3-MoE with renormalised top-k, Qwen3-MoE with a dense first
# layer (mlp_only_layers) and no renormalisation, and Mixtral.
MOE = ("qwen3_moe", "qwen3_moe_mixed", "mixtral")


def make_hf_moe(kind: str):
    import transformers as tf

    experts = dict(num_experts_per_tok=2, tie_word_embeddings=False)
    if kind == "mixtral":
        cfg = tf.MixtralConfig(**{**TINY, "intermediate_size": 32}, num_local_experts=8,
                               sliding_window=None, **experts)
        return tf.MixtralForCausalLM(cfg)
    mixed = kind == "qwen3_moe_mixed"
    cfg = tf.Qwen3MoeConfig(**{**TINY, "num_hidden_layers": 3 if mixed else 2}, num_experts=8,
                            moe_intermediate_size=32, norm_topk_prob=not mixed,
                            mlp_only_layers=[0] if mixed else [], **experts)
    return tf.Qwen3MoeForCausalLM(cfg)


def left_padded_batch(vocab: int, lengths=(9, 5, 12, 1), seed: int = 0):
    """(input_ids, attention_mask) of a left-padded batch of mixed lengths, as numpy int32."""
    rng = np.random.default_rng(seed)
    T = max(lengths)
    ids = np.zeros((len(lengths), T), np.int32)
    mask = np.zeros((len(lengths), T), np.int32)
    for b, n in enumerate(lengths):
        ids[b, T - n :] = rng.integers(1, vocab, n)
        mask[b, T - n :] = 1
    return ids, mask


def hf_logits(model, ids, mask):
    """transformers logits with positions counted from each row's first real token."""
    pos = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(ids, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            position_ids=torch.tensor(pos, dtype=torch.long),
        )
    return out.logits.float().numpy()


def make_hf_score_model(kind: str, out_dir: str, seed: int = 0, pad_token_id: int = 0):
    """Builds, saves and returns a tiny random *ForSequenceClassification model (one label, a
    reward model's shape) of the given family, with a pad token for last-token pooling."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(**TINY, num_labels=1, pad_token_id=pad_token_id)
    if kind == "llama":
        model = tf.LlamaForSequenceClassification(tf.LlamaConfig(**common))
    elif kind == "qwen2":
        model = tf.Qwen2ForSequenceClassification(tf.Qwen2Config(**common))
    else:
        raise ValueError(kind)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
        # Random init gives a small head; scale it so scores differ visibly between rows.
        model.score.weight.mul_(20.0)
    model.eval()
    model.save_pretrained(out_dir)
    return model


def hf_scores(model, ids, mask):
    """transformers' sequence scores [B] (positions counted from each row's first real token)."""
    pos = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(ids, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            position_ids=torch.tensor(pos, dtype=torch.long),
        )
    return out.logits.float().numpy()[:, 0]


_GGUF_LAYER = {
    "attn_norm": (), "ffn_norm": (), "attn_q": ("heads", "hidden"),
    "attn_k": ("kv", "hidden"), "attn_v": ("kv", "hidden"), "attn_output": ("hidden", "heads"),
    "ffn_gate": ("ffn", "hidden"), "ffn_up": ("ffn", "hidden"), "ffn_down": ("hidden", "ffn"),
}


def make_tiny_gguf(path: str, seed: int = 0) -> str:
    """Writes a tiny random Llama as a float32 GGUF file (TINY's shapes, untied head, no
    tokenizer metadata: a run takes its tokenizer from model.tokenizer); returns the path."""
    from gguf import GGMLQuantizationType, GGUFWriter

    t = TINY
    dims = {"hidden": t["hidden_size"], "ffn": t["intermediate_size"],
            "heads": t["num_attention_heads"] * t["head_dim"],
            "kv": t["num_key_value_heads"] * t["head_dim"]}
    rng = np.random.default_rng(seed)
    shapes = {"token_embd.weight": (t["vocab_size"], dims["hidden"]),
              "output_norm.weight": (dims["hidden"],),
              "output.weight": (t["vocab_size"], dims["hidden"])}
    for i in range(t["num_hidden_layers"]):
        for name, shape in _GGUF_LAYER.items():
            shapes[f"blk.{i}.{name}.weight"] = tuple(dims[d] for d in shape) or (dims["hidden"],)
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(t["num_hidden_layers"])
    writer.add_context_length(t["max_position_embeddings"])
    writer.add_embedding_length(dims["hidden"])
    writer.add_feed_forward_length(dims["ffn"])
    writer.add_head_count(t["num_attention_heads"])
    writer.add_head_count_kv(t["num_key_value_heads"])
    writer.add_rope_dimension_count(t["head_dim"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(t["rms_norm_eps"])
    for name, shape in shapes.items():
        scale = 0.1 if len(shape) == 2 else 0.05
        w = rng.normal(scale=scale, size=shape).astype(np.float32)
        if len(shape) == 1:
            w += 1.0  # norm weights near 1
        writer.add_tensor(name, w, raw_dtype=GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)
