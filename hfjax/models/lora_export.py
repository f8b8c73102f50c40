"""A LoRA run's actor out of its checkpoint: restore targets, the adapted model, the merged
model, and the PEFT export (`hfjax.run.export.load_actor` / `export_hf`).

The checkpoint holds the adapters (`actor_params`) and, when the run made its base, the base
(`actor_base`); otherwise the trainer state names the base's path and fingerprints
(`hfjax.workers.lora_state`), and the base is loaded from that path again and checked.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import jax
from flax import nnx

from hfjax.models import lora, peft_io, qwen2_5_vl
from hfjax.models.config import ModelConfig
from hfjax.models.hf_io import load as load_model
from hfjax.models.hf_io import save_hf


def spec_of(record: dict) -> lora.LoraSpec:
    """The LoraSpec a checkpoint's LoRA record describes."""
    s = record["spec"]
    return lora.LoraSpec(rank=int(s["rank"]), alpha=float(s["alpha"]),
                         targets=tuple(s["targets"]), dropout=float(s["dropout"]))


def targets(model: nnx.Module, record: dict, graphdefs: dict, placement: Callable) -> dict:
    """Restore targets of a LoRA checkpoint for the abstract `model` (the base's structure):
    the adapters, and the base when the run saved it. Fills graphdefs["actor"] (with
    adapters) and graphdefs["base"]."""
    graphdefs["base"] = nnx.split(model)[0]
    lora.add_adapters(model, spec_of(record))
    graphdef, state = nnx.split(model)
    graphdefs["actor"] = graphdef

    def place(var, sharding):
        x = var.get_value()
        return var.replace(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding))

    from hfjax.parallel import sharding as shd

    placed = jax.tree.map(place, state, placement(state), is_leaf=shd.is_variable)
    out = {"actor_params": lora.adapter_state(placed)}
    if record["base"]["saved"]:
        out["actor_base"] = lora.base_state(placed)
    return out


def model(restored, graphdefs: dict, fingerprints: Callable) -> nnx.Module:
    """The adapted actor of a restored LoRA checkpoint; a base named by path is loaded from
    it and must have the fingerprints recorded at training time (ValueError otherwise)."""
    record, items = restored.state["lora"], restored.items
    if record["base"]["saved"]:
        base = items["actor_base"]
    else:
        path = record["base"]["path"]
        cfg = restored.state["model_config"]
        if restored.state.get("vision"):  # a Qwen2.5-VL directory: its language model
            vl = qwen2_5_vl.from_record(ModelConfig(**cfg), restored.state["vision"]["config"])
            loaded = qwen2_5_vl.load_hf(path, cfg=vl).lm
        else:
            loaded = load_model(path, head="causal_lm", dtype=cfg["dtype"],
                                param_dtype=cfg["param_dtype"], max_layers=cfg["num_layers"],
                                scan_layers=cfg["scan_layers"],
                                remat_policy=cfg["remat_policy"],
                                attention_impl=cfg["attention_impl"])
        base = nnx.state(loaded)
        if fingerprints(lora.leaf_names(base)) != record["base"]["fingerprints"]:
            raise ValueError(f"the base model at {path} is not the one the adapters were "
                             "trained on (its weights' fingerprints differ)")
    return nnx.merge(graphdefs["actor"], nnx.merge_state(items["actor_params"], base))


def merged(adapted: nnx.Module) -> nnx.Module:
    """The base model with the adapters merged into its weights (W + scale * A @ B)."""
    graphdef, state = nnx.split(adapted)
    base_gd = lora.base_graphdef(adapted)
    return nnx.merge(base_gd, jax.jit(lambda s: lora.merged_state(graphdef, base_gd, s))(state))


def save_peft(adapted: nnx.Module, record: dict, out: str, tokenizer) -> str:
    """Writes the adapters of `adapted` in PEFT's format to `out`, with a base that
    `AutoPeftModelForCausalLM.from_pretrained(out)` loads by the name in adapter_config.json:
    an HF directory base is named by its absolute path; any other (a .gguf file, a preset, a
    base the checkpoint saved) is written once as an HF directory in `out/base`, which
    transformers loads without a `gguf_file=` argument, and named instead. For a
    vision-language `adapted` (`qwen2_5_vl.VisionLM`), the adapters are its language model's
    and the base written is the whole Qwen2.5-VL model, its tower included."""
    spec = spec_of(record)
    vl = isinstance(adapted, qwen2_5_vl.VisionLM)
    lm = adapted.lm if vl else adapted
    arrays = {k: v.get_value() for k, v in vars(lm.model.layers).items()
              if isinstance(v, nnx.LoRAParam)}
    path = record["base"]["path"]
    hf_base = bool(path) and os.path.isfile(os.path.join(path, "config.json"))
    base_dir = os.path.abspath(path if hf_base else os.path.join(out, "base"))
    peft_io.save_peft(arrays, lm.config, spec, out, base_dir,
                      layers_prefix=peft_io.VL_LAYERS if vl else peft_io.LAYERS)
    if not hf_base:
        base = nnx.merge(lora.base_graphdef(lm), lora.base_state(nnx.state(lm)))
        if vl:
            qwen2_5_vl.save_hf(qwen2_5_vl.VisionLM(adapted.config, rngs=None, lm=base,
                                                   visual=adapted.visual),
                               base_dir, tokenizer=tokenizer)
        else:
            save_hf(base, base_dir, tokenizer=tokenizer)
    return out
