"""Training a vision-language policy (hfjax.workers.vision) through the real worker groups: the
actor samples prompts with images on a 4-device mesh (fsdp=4, decoding on data=2 x tensor=2
through its hybrid engine), the batch carries the tower's features (computed once per prompt)
and M-RoPE positions, and the actor's log-probs, its update, the reference and a critic see
them. A tiny Qwen2.5-VL-shaped model,
built natively; prompts with images of two sizes (4 and 6 image tokens) and one without."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image

from configs import ppo_arith
from hfjax.controller.batch import Batch
from hfjax.engine import update
from hfjax.engine.continuous import rollout_sampler
from hfjax.engine.layout_choice import actor_rules_and_engine
from hfjax.engine.spec import RolloutSpec
from hfjax.models import qwen2_5_vl as vl
from hfjax.models import transformer, vision
from hfjax.models.config import ModelConfig
from hfjax.parallel.mesh import ResourcePool
from hfjax.workers import vision as wv
from hfjax.workers.actor import ActorRollout, Reference
from hfjax.workers.critic import Critic
from hfjax.workers.spec import ActorSpec, CriticSpec

IMAGE, START, END = 120, 118, 119
PROMPTS, N, P, R = 4, 2, 20, 8
TEXT = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2,
                   num_heads=4, num_kv_heads=4, head_dim=8, mrope_section=(2, 1, 1),
                   max_position_embeddings=256, model_type="qwen2", attention_bias=True)
VL = vl.VLConfig(TEXT, vision.VisionConfig(depth=2, hidden_size=16, intermediate_size=32,
                                           num_heads=2, out_hidden_size=32, window_size=56,
                                           fullatt_block_indexes=(1,)),
                 image_token_id=IMAGE, video_token_id=121, vision_start_token_id=START,
                 vision_end_token_id=END)
MESH = "fsdp=4"


def _pool():
    return ResourcePool("devices0-4", tuple(jax.devices()[:4]))


def _config():
    c = ppo_arith.get_config()
    c.actor.share_prompt = False
    c.actor.ppo_mini_batch_size, c.actor.ppo_micro_batch_size = PROMPTS, PROMPTS * N
    c.rollout.n, c.rollout.response_length = N, R
    c.rollout.mesh = "data=2,tensor=2"
    return c


def _actor(freeze=True, lm_only=False, mesh=MESH, lr=1e-2):
    """The actor of a fresh tiny VLM (seed 0): its language model with the tower frozen
    beside it, or holding it (it trains); `lm_only`: the language model alone, text only."""
    c = _config()
    lm, tower = vl.policy(vl.VisionLM(VL, rngs=nnx.Rngs(0)), freeze_vision=freeze)
    tower = None if lm_only else tower
    rollout = RolloutSpec.of(c.rollout)
    pool = _pool()
    rules, engine = actor_rules_and_engine(pool.mesh(mesh), "auto", rollout.decode_mesh,
                                           nnx.state(lm))
    sampler = rollout_sampler(lm, rollout, mesh=engine.decode_mesh, max_prompt_len=P,
                              pad_id=0, rules=None, param_rules=engine.decode_rules)
    return ActorRollout("actor", pool, mesh, lm, rules=rules, sampler=sampler,
                        spec=ActorSpec.of(c.actor), rollout=rollout, eos_ids=(1,),
                        optimizer=update.make_optimizer(lr, grad_clip=0.0), hybrid=engine,
                        tower=tower, vl=None if lm_only else VL)


def _prompts():
    """A host prompt batch: images of 56x56 (4 tokens) and 56x84 (6 tokens) pixels, one
    prompt with both and one without."""
    rng = np.random.default_rng(0)
    pic = lambda h, w: Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    pictures = [[pic(56, 56)], [pic(56, 84)], [], [pic(56, 56), pic(56, 84)]]
    ids, mask = np.zeros((PROMPTS, P), np.int32), np.zeros((PROMPTS, P), np.int32)
    for b, row in enumerate(pictures):
        toks = [3 + b]
        for k in ((56 // 14) * (w // 14) // 4 for w in (p.width for p in row)):
            toks += [START, *[IMAGE] * k, END]
        toks += [5, 6]
        ids[b, P - len(toks):], mask[b, P - len(toks):] = toks, 1
    return Batch({"prompts": ids, "prompt_mask": mask,
                  "seeds": np.arange(PROMPTS, dtype=np.uint32),
                  **wv.prompt_images(VL, pictures)})


@pytest.fixture(scope="module")
def sampled():
    actor = _actor()
    return actor, actor.generate(_prompts())


def _text_only(batch):
    return batch.select([k for k in batch.arrays if k not in wv.IMAGES])


def _masked(x, mask):
    return np.asarray(x)[np.asarray(mask) > 0]


def test_log_probs_with_images_equal_the_samplers(sampled):
    """The actor's log-prob pass over the sampled batch gives the sampler's log-probs (the
    features carried, not recomputed); without the images it does not."""
    actor, batch = sampled
    assert batch["image_features"].shape == (PROMPTS * N, 10, TEXT.hidden_size)  # 4 + 6
    assert batch["mrope_positions"].shape == (PROMPTS * N, 3, batch["input_ids"].shape[1])
    mask = batch["response_mask"]
    lp = actor.compute_log_prob(batch)["old_log_probs"]
    np.testing.assert_allclose(_masked(lp, mask), _masked(batch["rollout_log_probs"], mask),
                               atol=2e-4)
    blind = actor.compute_log_prob(_text_only(batch))["old_log_probs"]
    assert np.abs(_masked(blind, mask) - _masked(lp, mask)).max() > 1e-2


def test_reference_and_critic_see_the_images(sampled):
    """A reference (a copy of the policy) scores the actor's log-probs; a critic's values
    equal its backbone run on the embeddings with the features placed by hand."""
    actor, batch = sampled
    c = _config()
    ref = Reference("ref", _pool(), MESH, actor.model(), spec=actor.spec,
                    rollout=actor.rollout, vl=VL, home=actor.mesh)
    mask = batch["response_mask"]
    np.testing.assert_allclose(_masked(ref.compute_ref_log_prob(batch)["ref_log_prob"], mask),
                               _masked(actor.compute_log_prob(batch)["old_log_probs"], mask),
                               atol=1e-5)
    value = transformer.build(TEXT, "value", seed=1)
    value.score[...] = jax.random.normal(jax.random.key(0), value.score[...].shape)
    critic = Critic("critic", _pool(), MESH, value, spec=CriticSpec.of(c.critic, "critic"),
                    rollout=actor.rollout, vl=VL, home=actor.mesh,
                    optimizer=update.make_optimizer(1e-3, grad_clip=0.0))
    got = np.asarray(critic.compute_values(batch)["values"])
    ids = np.asarray(batch["input_ids"])
    feats = np.asarray(batch["image_features"])
    flat = np.concatenate([feats[b, :(ids[b] == IMAGE).sum()] for b in range(len(ids))])
    h = vl.place_images(value.model.embed(jnp.asarray(ids)), jnp.asarray(ids == IMAGE),
                        jnp.asarray(flat))
    pos = jnp.moveaxis(jnp.asarray(batch["mrope_positions"]), 1, 0)
    hidden, _ = value.model(jnp.asarray(ids), jnp.asarray(batch["attention_mask"]), embeds=h,
                            positions=pos)
    want = np.asarray(hidden @ value.score[...])[:, -R - 1:-1, 0]
    np.testing.assert_allclose(_masked(got, mask), _masked(want, mask), atol=1e-4)
    blind = np.asarray(critic.compute_values(_text_only(batch))["values"])
    assert np.abs(_masked(blind, mask) - _masked(got, mask)).max() > 1e-3


def _one_update(actor, batch):
    adv = np.where(np.asarray(batch["response_mask"]) > 0,
                   np.random.default_rng(1).normal(size=batch["response_mask"].shape), 0)
    with jax.transfer_guard("allow"):
        batch = batch.union(Batch({"advantages": jnp.asarray(adv, jnp.float32)}).to(actor.mesh))
    return actor.update_actor(batch)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_update_trains_the_language_model_and_not_a_frozen_tower(sampled):
    """With freeze_vision (the default) the tower is outside the actor's params: no optimizer
    state, bit-identical after an update that changes the language model; the hybrid engine
    moves the language model's bytes only, the same as a text-only actor's."""
    actor, batch = sampled
    tower0, lm0 = _leaves(actor.tower.state(actor.params)), _leaves(actor.params)
    n_opt = len(jax.tree.leaves(actor.opt_state))
    _one_update(actor, batch)
    tower1 = _leaves(actor.tower.state(actor.params))
    assert all(np.array_equal(a, b) for a, b in zip(tower0, tower1))
    assert any(not np.array_equal(a, b) for a, b in zip(lm0, _leaves(actor.params)))
    assert n_opt == len(jax.tree.leaves(actor.opt_state))
    assert not any("visual" in str(p) for p, _ in jax.tree_util.tree_leaves_with_path(
        actor.opt_state))
    text = _actor(lm_only=True)
    moved = sum(actor.hybrid.bytes_to_decode().values())
    assert moved == sum(text.hybrid.bytes_to_decode().values()) > 0


def test_freeze_vision_false_trains_the_tower():
    """With the tower in the actor's params, the update recomputes the features from the
    patches the batch carries and the tower changes; the engine then moves its bytes too."""
    actor = _actor(freeze=False)
    batch = actor.generate(_prompts())
    assert "image_patches" in batch
    mask = batch["response_mask"]
    np.testing.assert_allclose(_masked(actor.compute_log_prob(batch)["old_log_probs"], mask),
                               _masked(batch["rollout_log_probs"], mask), atol=2e-4)
    tower0 = _leaves(actor.tower.state(actor.params))
    _one_update(actor, batch)
    tower1 = _leaves(actor.tower.state(actor.params))
    assert all(not np.array_equal(a, b) for a, b in zip(tower0, tower1) if a.ndim > 1)
    frozen = _actor()
    assert (sum(actor.hybrid.bytes_to_decode().values())
            > sum(frozen.hybrid.bytes_to_decode().values()))


def test_bad_settings_refused(sampled):
    actor, batch = sampled
    text = _actor(lm_only=True)
    with pytest.raises(ValueError, match="prompts with images for a text-only model"):
        text.generate(_prompts())
    with pytest.raises(ValueError, match="a batch with images for a text-only model"):
        text.compute_log_prob(batch)
    from hfjax.models.lora import LoraSpec

    with pytest.raises(ValueError, match="freeze_vision=False with LoRA trains no vision tower"):
        _actor(freeze=False).add_adapters(LoraSpec(rank=2, alpha=4.0))
    with pytest.raises(ValueError, match="'vision_heads'=2"):
        _actor(mesh="tensor=4")
