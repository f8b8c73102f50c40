"""Qwen2.5-VL against transformers' `Qwen2_5_VLForConditionalGeneration` on a tiny random model:
logits of prompts with zero, one and two images of different sizes (window and full attention
blocks both exercised: an image of 8x12 patches spans several 4x4-patch windows), the sampler's
greedy rows with images against `generate`, the HF round trip, and the refusals."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from PIL import Image

from hfjax.data import images
from hfjax.models import hf_io, vision
from hfjax.models import qwen2_5_vl as vl

IMAGE, START, END = 120, 118, 119


def _hf_config():
    import transformers as tf

    return tf.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=128, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1],
                                          "rope_theta": 10000.0}),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2,
                           out_hidden_size=32, window_size=56, fullatt_block_indexes=[1]),
        image_token_id=IMAGE, video_token_id=121, vision_start_token_id=START,
        vision_end_token_id=END)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(HF model, its directory, hfjax's load of it). Weights are shifted off transformers'
    init (zero biases, unit norms) so that every parameter's layout is checked."""
    import transformers as tf

    torch.manual_seed(0)
    hf = tf.Qwen2_5_VLForConditionalGeneration(_hf_config()).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    d = str(tmp_path_factory.mktemp("qwen2_5_vl"))
    hf.save_pretrained(d)
    return hf, d, vl.load_hf(d)


@pytest.fixture(scope="module")
def batch():
    """Three left-padded rows: no image; one 112x168 image; that image and a 56x84 one."""
    rng = np.random.default_rng(0)
    pics = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
            for h, w in [(112, 168), (56, 84)]]
    pixels, grids = images.preprocess(pics, min_pixels=56 * 56, max_pixels=224 * 224)
    n = [int(g.prod()) // 4 for g in grids]
    rows = [[3, 4, 5, 6, 7], [3, START, *[IMAGE] * n[0], END, 8, 9],
            [START, *[IMAGE] * n[0], END, 10, START, *[IMAGE] * n[1], END, 11]]
    T = max(map(len, rows))
    ids = np.zeros((3, T), np.int64)
    mask = np.zeros((3, T), np.int64)
    for b, r in enumerate(rows):
        ids[b, T - len(r):], mask[b, T - len(r):] = r, 1
    grid_list = np.asarray([grids[0], grids[0], grids[1]])
    all_pixels = np.concatenate([pixels[:int(grids[0].prod())], pixels])
    return ids, mask, all_pixels, grid_list


def _hf_inputs(ids, mask, pixels, grids):
    return dict(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                pixel_values=torch.tensor(pixels), image_grid_thw=torch.tensor(grids),
                mm_token_type_ids=torch.tensor((ids == IMAGE).astype(np.int64)))


@nnx.jit
def _forward(model, ids, mask, pixels, lay, pos):
    return model(ids, mask, pixels=pixels, layout=lay, positions=pos)


def _ours(model, ids, mask, pixels, grids):
    cfg = model.config
    pos, _ = vl.mrope_positions(cfg, ids, mask, grids)
    return np.asarray(_forward(model, ids, mask, pixels, vision.layout(cfg.vision, grids), pos))


def test_logits_match_transformers(models, batch):
    hf, _, ours = models
    ids, mask, pixels, grids = batch
    with torch.no_grad():
        ref = hf(**_hf_inputs(*batch)).logits.numpy()
        text_ref = hf(input_ids=torch.tensor(ids[:1, -5:])).logits.numpy()
    got = _ours(ours, *batch)
    assert np.abs(got - ref)[mask.astype(bool)].max() < 1e-4
    # A text-only call (no pixels): plain positions, which M-RoPE reduces to.
    text = np.asarray(ours(jnp.asarray(ids[:1, -5:])))
    assert np.abs(text - text_ref).max() < 1e-4
    # The image rows depend on the pictures (a blank image changes them; the text row not).
    blank = _ours(ours, ids, mask, np.zeros_like(pixels), grids)
    assert np.abs(blank[1:] - got[1:]).max() > 1e-3
    assert np.abs(blank[0] - got[0]).max() == 0


def test_save_loads_in_transformers(models, batch, tmp_path):
    import transformers as tf

    hf, _, ours = models
    vl.save_hf(ours, str(tmp_path))
    back = tf.Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tmp_path)).eval()
    with torch.no_grad():
        ref = hf(**_hf_inputs(*batch)).logits.numpy()
        got = back(**_hf_inputs(*batch)).logits.numpy()
    assert np.abs(got - ref)[batch[1].astype(bool)].max() < 1e-5
    assert json.load(open(tmp_path / "config.json"))["model_type"] == "qwen2_5_vl"


def test_placeholders_and_images_must_agree(models, batch):
    ids, mask, _, grids = batch
    cfg = models[2].config
    with pytest.raises(ValueError, match="row 2: more image placeholders than images"):
        vl.mrope_positions(cfg, ids, mask, grids[:2])
    with pytest.raises(ValueError, match="4 images but 3 have placeholders"):
        vl.mrope_positions(cfg, ids, mask, np.concatenate([grids, grids[:1]]))
    with pytest.raises(ValueError, match="row 1: image 1 .* needs 24 consecutive"):
        vl.mrope_positions(cfg, ids, mask, [grids[2], grids[0], grids[0]])
    with pytest.raises(ValueError, match="needs its M-RoPE positions"):
        models[2](jnp.asarray(ids), features=jnp.zeros((1, 32)))
    with pytest.raises(ValueError, match="mrope_section=.* summing to head_dim/2=4"):
        cfg.text.replace(mrope_section=(2, 2, 2))
    # The text-only loader (launch.sft's, a reward model's) refuses it, pointing at the VLM one.
    with pytest.raises(ValueError, match="Qwen2.5-VL checkpoint is a vision-language model"):
        hf_io.load(models[1])


def test_encode_image_by_image_equals_the_tower_over_one_list(models, batch):
    """`engine.images.encode` maps the tower over each grid shape's images (linear in the
    images); its features equal the tower's over all the patches at once (the batch: two
    images of one shape and one of another, in an order that interleaves them)."""
    from hfjax.engine import images as engine_images

    _, _, ours = models
    _, _, pixels, grids = batch
    order = [1, 0, 2]  # the small image first, then the two large ones
    sizes = [int(np.prod(g)) for g in grids]
    starts = np.concatenate([[0], np.cumsum(sizes)])
    pixels = np.concatenate([pixels[starts[i]:starts[i + 1]] for i in order])
    grids = grids[order]
    apart = engine_images.encode(ours, pixels, grids)
    together = engine_images.encode_together(ours, pixels, grids)
    assert apart.features.shape == together.features.shape == (sum(sizes) // 4, 32)
    np.testing.assert_allclose(np.asarray(apart.features), np.asarray(together.features),
                               atol=1e-5, rtol=0)


@pytest.mark.slow  # 22 s wall on the shared 2-core machine (two samplers compiled)
def test_rollout_with_images_shares_the_tower_across_samples(models, batch):
    """The sampler decodes the language model with the prompts' image features in its prefill:
    greedy rows equal transformers' `generate`, for each of n=2 samples of a prompt, while the
    tower ran once, over the 3 prompts' images (not once per sample)."""
    from hfjax.engine import images as engine_images
    from hfjax.engine.sampler import Sampler
    from hfjax.engine.token_select import SamplingParams
    from hfjax.models import transformer

    hf, _, ours = models
    ids, mask, pixels, grids = batch
    with torch.no_grad():
        ref = hf.generate(**_hf_inputs(*batch), max_new_tokens=5, do_sample=False).numpy()
    prompts = engine_images.encode(ours, pixels, grids)
    assert prompts.features.shape[0] == int((ids == IMAGE).sum())  # per prompt, not per sample
    sampler = Sampler(ours.lm, pad_id=0, max_prompt_len=64)
    out = sampler.generate(nnx.state(ours.lm), ids, mask,
                           SamplingParams(max_new_tokens=5, temperature=0.0, n=2),
                           images=prompts)
    want = np.repeat(ref[:, ids.shape[1]:], 2, axis=0)
    np.testing.assert_array_equal(np.asarray(out.tokens), want)
    # On a data=4 x tensor=2 decode mesh the 3 prompts are padded to 4 (the pad row repeats
    # prompt 0 and its image); the rows are the same.
    import jax

    from hfjax.parallel.mesh import MeshSpec

    mesh = MeshSpec.parse("data=4,tensor=2").build(jax.devices())
    meshed = Sampler(ours.lm, pad_id=0, max_prompt_len=64, mesh=mesh)
    out = meshed.generate(nnx.state(ours.lm), ids, mask,
                          SamplingParams(max_new_tokens=5, temperature=0.0, n=2), images=prompts)
    assert meshed.compile_log[0].batch == 4
    np.testing.assert_array_equal(np.asarray(out.tokens), want)
    text_model = transformer.build(ours.config.text.replace(mrope_section=()))
    with pytest.raises(ValueError, match="images for a text-only model"):
        Sampler(text_model, pad_id=0).generate(nnx.state(text_model), ids, mask,
                                               SamplingParams(max_new_tokens=2), images=prompts)
    with pytest.raises(ValueError, match="hold 54 image placeholders but the images give 36"):
        sampler.generate(nnx.state(ours.lm), ids, mask, SamplingParams(max_new_tokens=2),
                         images=prompts._replace(features=prompts.features[:36]))


def test_tower_shards_over_fsdp_and_tensor(models, batch):
    """Loaded onto fsdp=4 x tensor=2 under the training rules, the tower's weights are split
    (its own axes: vision_embed over fsdp, vision_heads and vision_mlp over tensor), the
    compiled tower computes each device's head of the attention ([1, N, N] scores, not the 2
    heads' [2, N, N]), and the logits equal the unsharded model's. A tensor size that does not
    divide the tower's heads is refused, naming the tensor."""
    import jax

    from hfjax.parallel.mesh import MeshSpec
    from hfjax.parallel.sharding import layout

    ours = models[2]
    ids, mask, pixels, grids = batch
    mesh = MeshSpec.parse("fsdp=4,tensor=2").build(jax.devices())
    sharded = vl.load_hf(models[1], mesh=mesh)
    assert tuple(sharded.lm.model.layers.q_proj[...].sharding.spec) == (None, "fsdp", "tensor")
    spec = sharded.visual.qkv[...].sharding.spec
    assert tuple(spec) == (None, "fsdp", None, "tensor")
    assert tuple(sharded.visual.gate_proj[...].sharding.spec) == (None, "fsdp", "tensor")
    np.testing.assert_allclose(_ours(sharded, *batch), _ours(ours, *batch), atol=1e-5)

    vlay = vision.layout(ours.config.vision, grids)
    n = pixels.shape[0]
    hlo = nnx.jit(lambda t, x, v: t(x, v)).lower(sharded.visual, jnp.asarray(pixels),
                                                 vlay).compile().as_text()
    assert f"f32[1,{n},{n}]" in hlo and f"f32[2,{n},{n}]" not in hlo

    with pytest.raises(ValueError, match=r"tensor proj: .*\(size 4\) do not divide dimension "
                                         "'vision_heads'=2"):
        layout(MeshSpec.parse("fsdp=2,tensor=4").build(jax.devices()), "train"
               ).state_shardings(nnx.state(ours.visual))


@pytest.mark.parametrize("name, total", [("qwen2.5-vl-3b", 3_754_622_976),
                                         ("qwen2.5-vl-7b", 8_292_166_656)])
def test_presets_have_the_published_parameter_counts(name, total):
    """The totals of the published checkpoints' safetensors (Qwen2.5-VL-3B/7B-Instruct)."""
    import jax

    model = vl.abstract(vl.get_preset(name))
    count = lambda m: sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
    assert count(model) == total
    assert count(model.visual) in (668_684_288, 676_550_144)  # the merger's output differs
