"""The random-weight model with LoRA adapters that the LoRA benchmarks share."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from hfjax.models import lora, transformer
from hfjax.models.config import ModelConfig


def bench_config(hidden: int, layers: int, positions: int) -> ModelConfig:
    """A Llama-style shape of the given width and depth: heads of 64, MLP 4x, a KV head per
    256 of width."""
    return ModelConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=4 * hidden,
                       num_layers=layers, num_heads=hidden // 64,
                       num_kv_heads=max(1, hidden // 256), head_dim=64,
                       max_position_embeddings=positions)


def adapted_model(cfg: ModelConfig, rank: int, rng: np.random.Generator, dropout: float = 0.0):
    """(model, graphdef of the model before its adapters): rank-`rank` adapters (alpha 2 *
    rank) on every projection, B drawn from `rng` so that the adapters change the outputs."""
    model = transformer.build(cfg, seed=0)
    base_graphdef = nnx.split(model)[0]
    lora.add_adapters(model, lora.LoraSpec(rank, 2.0 * rank, dropout=dropout), seed=1)
    for name, var in vars(model.model.layers).items():
        if name.endswith("_lora_b"):
            var.set_value(jnp.asarray(0.02 * rng.standard_normal(var.get_value().shape),
                                      jnp.float32))
    return model, base_graphdef
