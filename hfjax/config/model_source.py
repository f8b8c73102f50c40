"""Where a run's model and tokenizer come from, from the `model` config section.

`model.path` is an HF directory, a `.gguf` file or `preset:NAME` (an architecture from
`hfjax.models.presets` with random weights); empty, it is a tiny model from scratch sized by the
section. `model_config` gives the ModelConfig either way without reading a weight (what the dry
run compiles from); `initial_model` builds the model itself.

Precision: `model.dtype` is the compute dtype (`auto` resolved for the platform by
`hfjax.models.backend.compute_dtype`), `model.param_dtype` the master weights'.

Presets carry no tokenizer. A run takes `model.tokenizer` when given, else the checkpoint's own,
else the embedded arithmetic task's (its 18 ids are valid ids of any preset's vocabulary, so a
preset can run the default task end to end); a preset on parquet data needs `model.tokenizer`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from flax import nnx

from hfjax.data import arith, images, shapes, tool_arith
from hfjax.engine import layout_choice
from hfjax.models import backend, load_tokenizer, presets, qwen2_5_vl, transformer, vision
from hfjax.models import load as load_model
from hfjax.models.config import ModelConfig, scratch_model_config
from hfjax.models.hf_io import read_model_config
from hfjax.parallel.mesh import ResourcePool


def task_tokenizer(cfg):
    """The run's tokenizer (see the module docstring). ValueError when a preset runs a parquet
    task without `model.tokenizer`."""
    m = cfg.model
    if m.tokenizer:
        return load_tokenizer(m.tokenizer)
    if m.path and presets.preset_name(m.path) is None:
        return load_tokenizer(m.path)
    if cfg.data.task == "arith_tool":
        return tool_arith.tokenizer()
    if cfg.data.task == "shapes":
        return shapes.tokenizer()
    if cfg.data.task not in ("arith", "arith_chain"):  # (arith's tokenizer)
        raise ValueError(f"model.path={m.path!r} has no tokenizer for data.task="
                         f"{cfg.data.task!r}; give one with --config.model.tokenizer=PATH "
                         "(an HF directory or .gguf file)")
    return arith.tokenizer()


def model_overrides(cfg, compute_dtype: str) -> dict:
    """The `model` section's settings of a model loaded from `model.path` (its weights' and
    compute dtypes, how many of its layers, layer scan, rematerialisation, attention), as
    `load_model` takes them."""
    m = cfg.model
    return dict(dtype=compute_dtype, param_dtype=m.param_dtype, max_layers=m.max_layers,
                scan_layers=m.scan_layers, remat_policy=m.remat_policy,
                attention_impl=m.attention_impl, moe_impl=m.moe_impl,
                capacity_factor=m.capacity_factor)


def vision_language(cfg, compute_dtype: str = "float32") -> qwen2_5_vl.VLConfig | None:
    """The VLConfig of a vision-language `model.path` (a Qwen2.5-VL directory or
    `preset:qwen2.5-vl-*`) with the section's settings, read without a weight; None for a
    text-only path or a model from scratch (`model.vision_depth` builds its tower in
    `vision_model`)."""
    m = cfg.model
    if not m.path:
        return None
    return qwen2_5_vl.read_config(m.path, **model_overrides(cfg, compute_dtype))


def check_vision_tokens(vl: qwen2_5_vl.VLConfig, tokenizer) -> None:
    """ValueError unless the tokenizer writes the model's image, vision start and end tokens
    (`hfjax.data.images.VISION_TOKENS`) as the model's ids."""
    want = dict(zip(images.VISION_TOKENS, (vl.vision_start_token_id, vl.vision_end_token_id,
                                           vl.image_token_id)))
    got = {t: tokenizer.backend.token_to_id(t) for t in want}
    if got != want:
        raise ValueError(f"the tokenizer's vision tokens {got} are not the model's {want}; "
                         "give the model's own tokenizer (--config.model.tokenizer)")


def compute_dtype(cfg, platform: str) -> str:
    """`model.dtype` resolved on `platform` for this run's actor
    (`hfjax.models.backend.compute_dtype`; for `auto` on a CPU the model's hidden size counts,
    read from model.path's preset, .gguf header or config.json without loading weights)."""
    m = cfg.model
    hidden = None
    if m.dtype == "auto" and platform == "cpu":
        hidden = model_config(cfg, None, "float32").hidden_size if m.path else m.hidden_size
    return backend.compute_dtype(m.dtype, backend.canonical(platform), hidden)


def model_config(cfg, tokenizer, compute_dtype: str) -> ModelConfig:
    """The actor's ModelConfig, without loading weights: from model.path (preset, .gguf header
    or config.json), else the scratch model that holds the task's longest prompt and response.
    ValueError for an unknown preset."""
    m = cfg.model
    if m.path:
        vl = vision_language(cfg, compute_dtype)
        if vl is not None:  # the decoder of a vision-language model
            return vl.text
        return read_model_config(m.path, **model_overrides(cfg, compute_dtype))
    positions = cfg.data.max_prompt_length + cfg.rollout.response_length
    return scratch_model_config(m, tokenizer.vocab_size, tokenizer.pad_id, tokenizer.eos_id,
                                positions, compute_dtype)


def initial_model(cfg, tokenizer, compute_dtype: str, pools: Mapping[str, ResourcePool]):
    """The actor before training: a checkpoint or preset from model.path, else a fresh model
    from scratch (`model_config`). A preset's random weights come from the run's seed and are
    created directly in the actor's training layout."""
    c = cfg
    if c.model.path:
        rules = c.actor.rules
        if rules == layout_choice.AUTO:
            # The choice needs the model's state; create it in the first candidate's
            # layout, and the actor group moves it if it chooses other rules.
            rules = layout_choice.CANDIDATES[0]
        placed = dict(mesh=pools["actor"].mesh(c.actor.mesh), rules=rules, seed=c.seed)
        vl = vision_language(cfg, compute_dtype)
        if vl is not None:  # its tower and merger from the checkpoint too
            check_vision_tokens(vl, tokenizer)
            return qwen2_5_vl.load(c.model.path, vl, **placed)
        kw = placed if presets.preset_name(c.model.path) is not None else {}
        return load_model(c.model.path, head="causal_lm", **model_overrides(cfg, compute_dtype),
                          **kw)
    text = model_config(cfg, tokenizer, compute_dtype)
    if c.model.vision_depth:
        return vision_model(cfg, tokenizer, text)
    return transformer.build(text, "causal_lm", seed=c.seed)


def vision_model(cfg, tokenizer, text: ModelConfig) -> qwen2_5_vl.VisionLM:
    """A Qwen2.5-VL-shaped policy from scratch: the scratch decoder `text` with M-RoPE bands
    (a quarter of each head's frequencies for time, the rest shared by rows and columns, as
    Qwen2.5-VL's 16/24/24 of 64) and a tower of `model.vision_*` sizes (windows of 2 x 2
    merged patches, the last block attending over the whole picture); its image and vision
    tokens are the tokenizer's (`hfjax.data.images.VISION_TOKENS`)."""
    m = cfg.model
    half = text.head_dim // 2
    t = max(half // 4, 1)
    section = (half - 2 * ((half - t) // 2), (half - t) // 2, (half - t) // 2)
    text = dataclasses.replace(text, mrope_section=section)
    tower = vision.VisionConfig(depth=m.vision_depth, hidden_size=m.vision_hidden_size,
                                intermediate_size=2 * m.vision_hidden_size,
                                num_heads=m.vision_num_heads, out_hidden_size=text.hidden_size,
                                window_size=56, fullatt_block_indexes=(m.vision_depth - 1,),
                                param_dtype=m.param_dtype, dtype=text.dtype)
    ids = {name: tokenizer.backend.token_to_id(token)
           for name, token in zip(("vision_start_token_id", "vision_end_token_id",
                                   "image_token_id"), images.VISION_TOKENS)}
    if None in ids.values():
        raise ValueError(f"model.vision_depth > 0 needs the vision tokens "
                         f"{', '.join(images.VISION_TOKENS)} in the tokenizer")
    vl = qwen2_5_vl.VLConfig(text, tower, video_token_id=-1, **ids)
    return qwen2_5_vl.VisionLM(vl, rngs=nnx.Rngs(cfg.seed))
