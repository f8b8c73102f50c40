"""LoRA adapters in PEFT's format: `adapter_config.json` + `adapter_model.safetensors`.

PEFT's LoRA layer computes `lora_B(lora_A(x)) * lora_alpha / r` with torch Linear weights
`lora_A.weight` [r, in] and `lora_B.weight` [out, r]; hfjax's adapters (`hfjax.models.lora`)
are A [layers, *in, r] and B [layers, r, *out] with x @ A @ B: per layer, PEFT's A is ours
flattened to [in, r] and transposed, and the same for B. The in and out dimensions flatten in
the order the HF weights do (`hfjax.models.hf_names.CONVERTERS`), e.g. q_proj's out is heads x
head_dim.
"""

from __future__ import annotations

import json
import os

import numpy as np

from hfjax.models import hf_io
from hfjax.models.config import ModelConfig
from hfjax.models.lora import LoraSpec
from hfjax.parallel.transfer import to_host

# Where a model's decoder layers sit under PEFT's wrapper: a causal LM's, and a Qwen2.5-VL's
# language model's (transformers 5's module tree, which PEFT names tensors by).
LAYERS = "base_model.model.model.layers"
VL_LAYERS = "base_model.model.model.language_model.layers"

_MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def peft_tensors(adapters: dict[str, object], cfg: ModelConfig, spec: LoraSpec,
                 layers_prefix: str = LAYERS) -> dict[str, np.ndarray]:
    """{PEFT tensor name: float32 array} of stacked adapters {`<proj>_lora_a|b`: array}, the
    decoder layers named under `layers_prefix`."""
    out = {}
    for name in spec.targets:
        a = np.asarray(to_host(adapters[f"{name}_lora_a"]), np.float32)
        b = np.asarray(to_host(adapters[f"{name}_lora_b"]), np.float32)
        for i in range(cfg.num_layers):
            prefix = f"{layers_prefix}.{i}.{_MODULE[name]}.{name}"
            out[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(
                a[i].reshape(-1, spec.rank).T)
            out[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(
                b[i].reshape(spec.rank, -1).T)
    return out


def adapter_config(spec: LoraSpec, base_model: str, layers_prefix: str = LAYERS) -> dict:
    """PEFT's adapter_config.json for `spec` on the model at `base_model`. The target
    modules are the projections' names, or, for a vision-language model (whose tower has
    projections of the same names), a pattern that matches the language model's alone."""
    targets = list(spec.targets)
    if layers_prefix != LAYERS:
        inner = layers_prefix.removeprefix("base_model.model.").replace(".", r"\.")
        targets = rf"{inner}\.\d+\.(self_attn|mlp)\.({'|'.join(spec.targets)})"
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
        "modules_to_save": None,
    }


def save_peft(adapters: dict[str, object], cfg: ModelConfig, spec: LoraSpec, out_dir: str,
              base_model: str, layers_prefix: str = LAYERS) -> str:
    """Writes `out_dir` (adapter_config.json, adapter_model.safetensors) for adapters on the
    model at `base_model`, its decoder layers under `layers_prefix`; written under a
    temporary name and renamed into place. Returns out_dir."""
    from safetensors.numpy import save_file

    # An earlier export at out_dir is replaced (the caller checked it is one).
    with hf_io.written_in_place(out_dir, ".tmp-hfjax-peft-") as tmp:
        save_file(peft_tensors(adapters, cfg, spec, layers_prefix),
                  os.path.join(tmp, "adapter_model.safetensors"), {"format": "pt"})
        with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
            json.dump(adapter_config(spec, base_model, layers_prefix), f, indent=2)
    return out_dir
