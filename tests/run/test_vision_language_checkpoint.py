"""A Qwen2.5-VL checkpoint through `launch.train`'s trainer and back out, as a user runs it:
`model.path` names a tiny random `Qwen2_5_VLForConditionalGeneration` that transformers builds
and saves here, `data.task=parquet` a verl multimodal parquet (the shapes task's rows, one
picture each). The run loads the tower and merger from the checkpoint (not from scratch),
takes one GRPO step, and its export loads in transformers with the trained model's logits on a
prompt with a picture; a LoRA run on the language model exports adapters that PEFT loads onto
the base, without key warnings, with the adapted model's logits."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from support import tiny_rl_config

from hfjax.data import prepare, shapes
from hfjax.models import qwen2_5_vl as vl
from hfjax.models import vision as vision_model
from hfjax.run.checkpoint import RunCheckpointer
from hfjax.run.export import export_hf
from hfjax.run.trainer import Trainer
from hfjax.workers import vision

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(HF directory of a tiny random Qwen2.5-VL whose vision tokens are the shapes task's
    tokenizer's, the train and validation parquet files)."""
    import transformers as tf

    tok = shapes.tokenizer()
    ids = {t: tok.backend.token_to_id(t) for t in ("<|vision_start|>", "<|vision_end|>",
                                                  "<|image_pad|>")}
    cfg = tf.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=32, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, bos_token_id=tok.eos_id,
                         eos_token_id=tok.eos_id,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1],
                                          "rope_theta": 10000.0}),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2,
                           out_hidden_size=32, window_size=56, fullatt_block_indexes=[1]),
        image_token_id=ids["<|image_pad|>"], video_token_id=31,
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(0)
    hf = tf.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    root = tmp_path_factory.mktemp("vl")
    hf.save_pretrained(str(root / "base"))
    tok.save(str(root / "base"))
    for split, n, seed in (("train", 16, 0), ("test", 4, 1)):
        prepare.write_rows(shapes.problems(n, seed, split=split), root / f"{split}.parquet")
    return root


def _config(root, out, lora_rank=0):
    c = tiny_rl_config(algorithm="grpo", out_dir=out)
    c.model.path = str(root / "base")
    c.model.dtype = "float32"
    c.data.task = "parquet"
    c.data.train_files, c.data.val_files = str(root / "train.parquet"), str(root / "test.parquet")
    c.data.max_prompt_length = 16
    c.data.train_batch_size = 4
    c.actor.share_prompt = False  # rows with images are scored as padded rows
    c.actor.use_kl_loss = True
    # The random policy scores 0 on every sample (no GRPO advantage): the entropy bonus
    # gives the step a gradient.
    c.actor.entropy_coeff = 0.01
    c.algo.adv_estimator = "grpo"
    c.algo.use_kl_in_reward = False
    c.rollout.n = 2
    c.actor.ppo_mini_batch_size = 4
    c.actor.lora.rank, c.actor.lora.alpha = lora_rank, 8.0
    c.actor.lora.targets = "q_proj,v_proj,down_proj"
    return c


def _prompt(t):
    """A training row's prompt with its picture: (ids, mask, patches, grids) of one row."""
    host = vision.prompts(t.train_data.rows[:1], np.zeros(1), t.tok.pad_id, 16, t.tok, t.vl)
    grids = np.asarray(vision.row_grids(host["image_grids"])[0])
    n = int(grids.prod(-1).sum())
    return host["prompts"], host["prompt_mask"], host["image_patches"][0, :n], grids


def _hf_logits(model, ids, mask, patches, grids, image_id):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids, dtype=torch.long),
                     attention_mask=torch.tensor(mask, dtype=torch.long),
                     pixel_values=torch.tensor(patches), image_grid_thw=torch.tensor(grids),
                     mm_token_type_ids=torch.tensor((ids == image_id).astype(np.int64))
                     ).logits.numpy()


@nnx.jit
def _forward(model, ids, mask, pixels, lay, pos):
    return model(ids, mask, pixels=pixels, layout=lay, positions=pos)


def _our_logits(lm, tower, cfg, ids, mask, patches, grids):
    model = vl.VisionLM(cfg, rngs=None, lm=lm, visual=tower)
    pos, _ = vl.mrope_positions(cfg, ids, mask, grids)
    with jax.transfer_guard("allow"):
        return np.asarray(_forward(model, ids, mask, patches,
                                   vision_model.layout(cfg.vision, grids), pos))


def _quietly(load):
    """(load(), the warnings and transformers/PEFT log lines it gave)."""
    import logging
    import warnings

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    loggers = [logging.getLogger(n) for n in ("transformers", "peft")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = load()
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
    return out, [str(w.message) for w in caught] + [r.getMessage() for r in records]


def _checkpoint(t, out):
    ckpt = RunCheckpointer(str(out / "checkpoints"), async_save=False)
    t.save(ckpt)
    ckpt.close()
    t._save_tokenizer(str(out))


def test_train_step_from_a_qwen2_5_vl_checkpoint_and_export(base, tmp_path):
    import transformers as tf

    hf = vl.load_hf(str(base / "base"))
    t = Trainer(_config(base, tmp_path / "run"))
    w = t.workers
    tower = nnx.merge(nnx.graphdef(hf.visual), t.actor.tower.frozen)
    with jax.transfer_guard("allow"):
        # The tower and merger are the checkpoint's, as is the language model.
        for name in ("patch_embed", "qkv", "merger_fc2"):
            np.testing.assert_array_equal(np.asarray(getattr(tower, name)[...]),
                                          np.asarray(getattr(hf.visual, name)[...]))
        q = np.asarray(nnx.state(hf.lm)["model"]["layers"]["q_proj"][...])
        np.testing.assert_array_equal(np.asarray(w.actor.params["model"]["layers"]["q_proj"]
                                                 [...]), q)
        metrics = t.train_step()
        assert np.isfinite(metrics["actor/pg_loss"])
        after = np.asarray(w.actor.params["model"]["layers"]["q_proj"][...])
        assert np.abs(after - q).max() > 0  # the language model trained
        for name in ("patch_embed", "qkv", "merger_fc2"):  # the frozen tower did not
            np.testing.assert_array_equal(np.asarray(getattr(tower, name)[...]),
                                          np.asarray(getattr(hf.visual, name)[...]))
    _checkpoint(t, tmp_path / "run")
    prompt = _prompt(t)
    want = _our_logits(w.actor.model(), tower, t.vl, *prompt)
    export_hf(str(tmp_path / "run"), str(tmp_path / "hf"))
    back = tf.Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tmp_path / "hf")).eval()
    got = _hf_logits(back, *prompt, t.vl.image_token_id)
    mask = prompt[1].astype(bool)
    np.testing.assert_allclose(got[mask], want[mask], atol=1e-4, rtol=0)
    t.close()


def test_lora_on_the_language_model_exports_for_peft(base, tmp_path):
    import peft
    import transformers as tf

    t = Trainer(_config(base, tmp_path / "run", lora_rank=4))
    w = t.workers
    rng = np.random.default_rng(0)
    with jax.transfer_guard("allow"):
        metrics = t.train_step()
        assert np.isfinite(metrics["actor/pg_loss"])
        # Random adapters (B starts at zero: the adapted model would equal the base).
        layers = w.actor.params["model"]["layers"]
        for k in list(layers.keys()):
            if k.endswith("_lora_b"):
                v = layers[k].get_value()
                layers[k].set_value(jax.device_put(
                    jnp.asarray(0.3 * rng.standard_normal(v.shape), v.dtype), v.sharding))
    _checkpoint(t, tmp_path / "run")
    prompt = _prompt(t)
    tower = nnx.merge(nnx.graphdef(vl.abstract(t.vl).visual), t.actor.tower.frozen)
    want = _our_logits(w.actor.model(), tower, t.vl, *prompt)
    export_hf(str(tmp_path / "run"), str(tmp_path / "adapter"), fmt="peft")
    hf_base = tf.Qwen2_5_VLForConditionalGeneration.from_pretrained(str(base / "base")).eval()
    plain = _hf_logits(hf_base, *prompt, t.vl.image_token_id)
    model, said = _quietly(lambda: peft.PeftModel.from_pretrained(hf_base,
                                                                  str(tmp_path / "adapter")))
    words = ("missing", "unexpected", "not initialized", "newly initialized", "key")
    assert not [s for s in said if any(w in s.lower() for w in words)], said
    got = _hf_logits(model.eval(), *prompt, t.vl.image_token_id)
    mask = prompt[1].astype(bool)
    assert np.abs(plain[mask] - want[mask]).max() > 1e-2  # the adapters matter
    np.testing.assert_allclose(got[mask], want[mask], atol=1e-4, rtol=0)
    t.close()


def test_a_tokenizer_with_other_vision_ids_is_refused(base):
    from hfjax.config.model_source import check_vision_tokens
    from hfjax.data import arith

    cfg = vl.read_config(str(base / "base"))
    check_vision_tokens(cfg, shapes.tokenizer())  # the model's own ids: accepted
    with pytest.raises(ValueError, match=r"the tokenizer's vision tokens .* are not the model's "
                                         r".*give the model's own tokenizer"):
        check_vision_tokens(cfg, arith.tokenizer())


def test_the_dry_run_builds_a_qwen2_5_vl_preset_with_its_frozen_tower():
    """`preset:qwen2.5-vl-3b` as model.path: the dry run's abstract actor is the preset's
    language model with its 32-block tower frozen beside it, sharded over the actor's mesh
    (the tower's 16 heads over tensor=2), nothing allocated."""
    from configs import grpo_arith
    from hfjax.run import dry_run

    c = grpo_arith.get_config()
    c.model.path = "preset:qwen2.5-vl-3b"
    c.actor.share_prompt, c.sft.steps = False, 0
    c.actor.mesh = "fsdp=4,tensor=2"
    w = dry_run.abstract_groups(c, platform="gpu")
    preset = vl.get_preset("qwen2.5-vl-3b")
    assert w.actor.vl.vision == dataclasses.replace(preset.vision, dtype="bfloat16")
    assert w.actor.config.num_layers == 36 and not w.actor.tower.trains
    leaves = jax.tree.leaves(w.actor.tower.frozen)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    # The published checkpoint's 3,754,622,976 parameters less Qwen2.5-3B's decoder
    # (3,085,938,688: 36 layers of 77,076,992, the tied 151,936 x 2,048 embedding, a norm).
    assert sum(int(np.prod(x.shape)) for x in leaves) == 3_754_622_976 - 3_085_938_688
    qkv = w.actor.tower.frozen["qkv"].get_value()
    assert qkv.sharding.shard_shape(qkv.shape)[3] == 8  # 16 heads over tensor=2
