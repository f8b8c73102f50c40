"""Qwen2.5-VL: the vision tower (`hfjax.models.vision`) feeding hfjax's Qwen2 decoder.

The language model is `transformer.CausalLM` itself, configured with M-RoPE bands
(`ModelConfig.mrope_section`); nothing of it is copied here. A prompt's image placeholders
(`image_token_id`, one per merged 2x2 patch group) have their token embeddings replaced, in
order, by the tower's outputs, and every token gets three position components (temporal,
row, column): text tokens count up as usual, an image's tokens take their frame, row and
column offset by the position where the image starts, and the text after an image resumes at
that start plus the image's longer side in merged units. Positions are computed on the host
from the token ids and image grids (`mrope_positions`), like the tower's layout.

HF checkpoints load and save in transformers' `Qwen2_5_VLForConditionalGeneration` layout
(`load_hf`, `save_hf`): the decoder's tensors through `hfjax.models.hf_io`, the tower's through
`vision.HF_NAMES`.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hfjax.models import hf_io, presets, vision
from hfjax.models.config import ModelConfig
from hfjax.models.transformer import CausalLM
from hfjax.parallel import sharding as shd


@dataclasses.dataclass(frozen=True)
class VLConfig:
    """A vision-language model: the decoder's config, the tower's, and the special tokens."""

    text: ModelConfig
    vision: vision.VisionConfig
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int

    def __post_init__(self):
        if not self.text.mrope_section:
            raise ValueError("a Qwen2.5-VL decoder needs mrope_section (its M-RoPE bands)")
        if self.vision.out_hidden_size != self.text.hidden_size:
            raise ValueError(f"vision out_hidden_size={self.vision.out_hidden_size} must equal "
                             f"the decoder's hidden_size={self.text.hidden_size}")

    @classmethod
    def from_hf_config(cls, hf: dict, dtype: str = "float32", **text_overrides) -> VLConfig:
        """From an HF Qwen2.5-VL config.json: transformers 5's nested `text_config` or the
        flat layout of the published checkpoints (`rope_scaling: {type: mrope, ...}`).
        `text_overrides` change the decoder's ModelConfig fields (its `param_dtype` is the
        tower's too)."""
        if hf.get("model_type") != "qwen2_5_vl":
            raise ValueError(f"model_type={hf.get('model_type')!r} is not qwen2_5_vl")
        text = dict(hf.get("text_config") or hf)
        rope = dict(text.pop("rope_parameters", None) or text.pop("rope_scaling", None) or {})
        section = rope.get("mrope_section")
        if not section:
            raise ValueError("config.json has no mrope_section (rope_parameters / rope_scaling)")
        text.pop("rope_scaling", None)
        text.update(model_type="qwen2", rope_theta=rope.get("rope_theta",
                                                            text.get("rope_theta", 1e6)))
        text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", False))
        if "tie_word_embeddings" in hf:
            text["tie_word_embeddings"] = hf["tie_word_embeddings"]
        text_overrides = {"dtype": dtype, "param_dtype": dtype, **text_overrides}
        tcfg = ModelConfig.from_hf_config(text, mrope_section=tuple(section), **text_overrides)
        vcfg = vision.VisionConfig.from_hf_config(hf["vision_config"], dtype=tcfg.dtype,
                                                  param_dtype=tcfg.param_dtype)
        return cls(tcfg, vcfg, hf["image_token_id"], hf["video_token_id"],
                   hf["vision_start_token_id"], hf["vision_end_token_id"])

    def to_hf_config(self) -> dict:
        """An HF config.json dictionary (transformers 5's nested layout)."""
        text = self.text.to_hf_config()
        for key in ("architectures", "rope_scaling", "rope_theta", "use_sliding_window",
                    "sliding_window", "torch_dtype"):
            text.pop(key, None)
        text.update(model_type="qwen2_5_vl_text", rope_parameters={
            "rope_type": "default", "rope_theta": self.text.rope_theta,
            "mrope_section": list(self.text.mrope_section)})
        return {"architectures": ["Qwen2_5_VLForConditionalGeneration"],
                "model_type": "qwen2_5_vl", "text_config": text,
                "vision_config": self.vision.to_hf_config(),
                "tie_word_embeddings": self.text.tie_word_embeddings,
                "image_token_id": self.image_token_id, "video_token_id": self.video_token_id,
                "vision_start_token_id": self.vision_start_token_id,
                "vision_end_token_id": self.vision_end_token_id,
                "dtype": self.text.param_dtype}


def config_record(cfg: VLConfig) -> dict:
    """The tower's config and the special tokens as JSON data (a checkpoint holds the
    decoder's config apart, as a text-only run's): `from_record` reads it back."""
    out = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "text"}
    out["vision"]["fullatt_block_indexes"] = list(cfg.vision.fullatt_block_indexes)
    return out


def from_record(text: ModelConfig, record: dict) -> VLConfig:
    """The VLConfig of a decoder config and a `config_record`."""
    return VLConfig(text, vision.VisionConfig(**record["vision"]),
                    **{k: v for k, v in record.items() if k != "vision"})


def mrope_positions(cfg: VLConfig, input_ids, attention_mask, grids):
    """M-RoPE positions [3, B, T] (int32) and each row's offset [B] from its real-token count
    to its next position (decoded token j of a row takes position n_real + j + offset).

    `grids` [(t, h, w), ...] are the images' patch grids in the order their placeholders
    appear, row by row. Padding (attention mask 0) gets position 0. Raises ValueError naming
    the row when placeholder counts and grids disagree.
    """
    ids = np.asarray(input_ids)
    mask = np.ones(ids.shape, bool) if attention_mask is None else np.asarray(attention_mask,
                                                                               bool)
    m = cfg.vision.spatial_merge_size
    B, T = ids.shape
    out = np.zeros((3, B, T), np.int32)
    offsets = np.zeros(B, np.int32)
    grids = [tuple(int(x) for x in g) for g in grids]
    k = 0
    for b in range(B):
        row = ids[b][mask[b]]
        pos, cur, j = [], 0, 0
        while j < len(row):
            if row[j] != cfg.image_token_id:
                pos.append(np.full(3, cur))
                cur, j = cur + 1, j + 1
                continue
            if k >= len(grids):
                raise ValueError(f"row {b}: more image placeholders than images")
            t, h, w = grids[k]
            gh, gw = h // m, w // m
            n = t * gh * gw
            if j + n > len(row) or np.any(row[j:j + n] != cfg.image_token_id):
                raise ValueError(f"row {b}: image {k} ({t}x{h}x{w} patches) needs {n} "
                                 "consecutive placeholders")
            ft, fh, fw = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
            pos.extend(np.stack([ft, fh, fw], -1).reshape(-1, 3) + cur)
            cur, j, k = cur + max(gh, gw), j + n, k + 1
        pos = np.asarray(pos, np.int32).reshape(-1, 3)
        out[:, b, mask[b]] = pos.T
        offsets[b] = (pos.max() + 1 if len(pos) else 0) - len(row)
    if k != len(grids):
        raise ValueError(f"{len(grids)} images but {k} have placeholders in the prompts")
    return out, offsets


def place_images(embeds: jax.Array, is_image: jax.Array, features: jax.Array) -> jax.Array:
    """Token embeddings [B, T, D] with the image placeholders' rows replaced by `features`
    [N, D] in row-major order (the n-th placeholder of the batch takes feature n)."""
    B, T, D = embeds.shape
    flat = is_image.reshape(-1)
    index = jnp.clip(jnp.cumsum(flat) - 1, 0, features.shape[0] - 1)
    placed = features.astype(embeds.dtype)[index].reshape(B, T, D)
    return jnp.where(is_image[..., None], placed, embeds)


class VisionLM(nnx.Module):
    """The policy: `lm` (a `transformer.CausalLM` with M-RoPE) and `visual` (the tower)."""

    def __init__(self, cfg: VLConfig, *, rngs: nnx.Rngs, lm: CausalLM | None = None,
                 visual: vision.VisionTower | None = None):
        self.config = cfg
        self.lm = lm if lm is not None else CausalLM(cfg.text, rngs=rngs)
        self.visual = visual if visual is not None else vision.VisionTower(cfg.vision,
                                                                           rngs=rngs)

    def embed(self, input_ids, features=None):
        """Token embeddings [B, T, D] with the image `features` [N, D] (the tower's output for
        the batch's images, in placeholder order) at the placeholders."""
        h = self.lm.model.embed(input_ids)
        if features is None:
            return h
        return place_images(h, input_ids == self.config.image_token_id, features)

    def __call__(self, input_ids, attention_mask=None, *, pixels=None, layout=None,
                 features=None, positions=None, **kw):
        """Logits [B, T, V] (and the cache with `cache=`). Images come as `pixels` [N,
        patch_dim] with their `vision.layout`, or as `features` the tower already gave (a
        prompt's images embedded once for all its samples). `positions` are
        `mrope_positions`' [3, B, T] (required with images)."""
        if pixels is not None:
            features = self.visual(pixels, layout)
        if features is not None and positions is None:
            raise ValueError("a prompt with images needs its M-RoPE positions "
                             "(qwen2_5_vl.mrope_positions)")
        embeds = self.embed(input_ids, features)
        return self.lm(input_ids, attention_mask, embeds=embeds, positions=positions, **kw)


def policy(model: VisionLM, freeze_vision: bool = True):
    """(the actor's model, its frozen tower or None) of a vision-language policy, as
    `ActorRollout(..., model, tower=...)` takes them (`hfjax.workers.vision`): with
    `freeze_vision` the language model alone trains and the tower stays beside it; without,
    the language model holds the tower as `visual`, so it trains and moves with it."""
    if freeze_vision:
        return model.lm, model.visual
    model.lm.visual = model.visual
    return model.lm, None


def _preset(vocab: int, hidden: int, inter: int, layers: int, heads: int, kv: int,
            tie: bool) -> VLConfig:
    text = ModelConfig(model_type="qwen2", attention_bias=True, rope_theta=1000000.0,
                       vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv,
                       head_dim=hidden // heads, rms_norm_eps=1e-6, tie_word_embeddings=tie,
                       mrope_section=(16, 24, 24), max_position_embeddings=128000,
                       bos_token_id=151643, eos_token_id=151645)
    tower = vision.VisionConfig(depth=32, hidden_size=1280, intermediate_size=3420,
                                num_heads=16, out_hidden_size=hidden, window_size=112,
                                fullatt_block_indexes=(7, 15, 23, 31))
    return VLConfig(text, tower, image_token_id=151655, video_token_id=151656,
                    vision_start_token_id=151652, vision_end_token_id=151653)


# The published Qwen2.5-VL-Instruct shapes (their config.json): 3.75B and 8.29B parameters,
# 0.67B of them the vision tower's.
PRESETS = {
    "qwen2.5-vl-3b": lambda: _preset(151936, 2048, 11008, 36, 16, 2, tie=True),
    "qwen2.5-vl-7b": lambda: _preset(152064, 3584, 18944, 28, 28, 4, tie=False),
}


def get_preset(name: str) -> VLConfig:
    """The `VLConfig` of a published shape (`PRESETS`)."""
    if name not in PRESETS:
        raise ValueError(f"unknown vision-language preset {name!r}; choose one of "
                         f"{sorted(PRESETS)}")
    return PRESETS[name]()


def read_config(path: str, *, dtype: str = "float32", max_layers: int = 0,
                **text_overrides) -> VLConfig | None:
    """The VLConfig of a vision-language `path` (`preset:qwen2.5-vl-*`, or an HF directory
    whose config.json says model_type qwen2_5_vl), read without a weight; None for any other
    path (a text-only model). `max_layers` > 0 keeps the decoder's first layers at most;
    `text_overrides` as `VLConfig.from_hf_config` takes them."""
    path = str(path or "")
    name = presets.preset_name(path)
    if not path:
        return None
    if name is not None:
        if name not in PRESETS:
            return None
        cfg = get_preset(name)
        text = cfg.text.replace(**{"dtype": dtype, "param_dtype": dtype, **text_overrides})
        cfg = dataclasses.replace(cfg, text=text, vision=dataclasses.replace(
            cfg.vision, dtype=text.dtype, param_dtype=text.param_dtype))
    else:
        config_json = os.path.join(path, "config.json")
        if not os.path.isfile(config_json):
            return None
        with open(config_json) as f:
            hf = json.load(f)
        if hf.get("model_type") != "qwen2_5_vl":
            return None
        cfg = VLConfig.from_hf_config(hf, dtype, **text_overrides)
    if 0 < max_layers < cfg.text.num_layers:
        cfg = dataclasses.replace(cfg, text=cfg.text.replace(num_layers=max_layers))
    return cfg


def load(path: str, cfg: VLConfig, *, mesh=None, rules: str | dict = "train",
         seed: int = 0) -> VisionLM:
    """The `VisionLM` of `path` with config `cfg` (`read_config(path, ...)`): an HF
    directory's weights (`load_hf`), or a preset's random ones from `seed`, in the `rules`
    layout of `mesh` (the default device without one)."""
    if presets.preset_name(path) is None:
        return load_hf(path, mesh=mesh, rules=rules, cfg=cfg)
    model = VisionLM(cfg, rngs=nnx.Rngs(seed))
    if mesh is not None:
        graphdef, state = nnx.split(model)
        state = jax.device_put(state, shd.layout(mesh, rules).state_shardings(state))
        model = nnx.merge(graphdef, state)
    return model


def abstract(cfg: VLConfig) -> VisionLM:
    """The model's structure with ShapeDtypeStruct leaves: nothing is allocated."""
    return nnx.eval_shape(lambda: VisionLM(cfg, rngs=nnx.Rngs(0)))


def load_hf(path: str, *, dtype: str = "float32", mesh=None, rules: str | dict = "train",
            cfg: VLConfig | None = None) -> VisionLM:
    """A `VisionLM` from an HF Qwen2.5-VL directory (safetensors), in the `rules` layout of
    `mesh` (the decoder tensor by tensor, as `hf_io.assemble` places it; the tower with the
    same rules for its own axes), or on the default device without a mesh. Tensors under
    `model.language_model.` (transformers 5 in memory) read as `model.`. `cfg` (default: the
    directory's, in `dtype`) may keep fewer decoder layers (`read_config(max_layers=)`)."""
    cfg = cfg or VLConfig.from_hf_config(hf_io._read_config(path), dtype=dtype)
    files = hf_io._safetensor_files(path)
    visual = {}
    in_model = hf_io._in_first_layers(cfg.text)

    def text_tensors():
        for name, w in hf_io._iter_safetensors(files):
            name = name.replace("model.language_model.", "model.", 1)
            if name.startswith("model.visual."):
                name = name[len("model."):]
            if name.startswith("visual."):
                visual[name] = w
            elif in_model(name):
                yield name, w

    lm = hf_io.assemble(cfg.text, text_tensors(), mesh=mesh, rules=rules)
    tower = vision.from_hf_tensors(cfg.vision, visual)
    if mesh is not None:
        graphdef, state = nnx.split(tower)
        state = jax.device_put(state, shd.layout(mesh, rules).state_shardings(state))
        tower = nnx.merge(graphdef, state)
    return VisionLM(cfg, rngs=nnx.Rngs(0), lm=lm, visual=tower)


def save_hf(model: VisionLM, path: str, tokenizer=None) -> str:
    """Writes `model` as an HF Qwen2.5-VL directory (config.json, model.safetensors and the
    `tokenizer`'s files) that transformers' `Qwen2_5_VLForConditionalGeneration.
    from_pretrained` loads; written under a temporary name and renamed into place, replacing
    an earlier export. Returns path."""
    from safetensors.numpy import save_file

    with hf_io.written_in_place(path, ".tmp-hfjax-vl-") as tmp:
        tensors = dict(hf_io.iter_hf_tensors(model.lm))
        tensors.update(vision.to_hf_tensors(model.visual))
        tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(model.config.to_hf_config(), f, indent=1)
        if tokenizer is not None:
            tokenizer.save(tmp)
    return path
