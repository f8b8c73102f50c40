"""Routing replay (hfjax.workers.routing, `actor.router_replay`) through the real actor: the
sampler records each token's experts, they travel with the batch, the old-policy pass (r2) and
the update (r3) replay them, and `actor/router_mismatch` is logged.

The sampler decodes with the actor's weights rounded to bfloat16 and the trainer scores with
its float32 master weights, as a rollout engine fed bfloat16 weights does: the router then
picks other experts on some tokens. The experts' weights are scaled up so that a token routed
elsewhere gets a visibly different log-prob. One batch, sampled once on a 2-device mesh with
4 samples per prompt (so the scoring pass runs on shared-prompt rows), serves every test.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import ppo_arith
from hfjax.controller.batch import Batch
from hfjax.engine import update
from hfjax.engine.continuous import rollout_sampler
from hfjax.engine.spec import RolloutSpec
from hfjax.models import moe, transformer
from hfjax.models.config import ModelConfig
from hfjax.parallel.mesh import ResourcePool
from hfjax.workers.actor import ActorRollout
from hfjax.workers.spec import ActorSpec

PROMPTS, N, P, R = 8, 4, 12, 32
CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, model_type="qwen3_moe",
                  qk_norm=True, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=16, norm_topk_prob=True, max_position_embeddings=128)
MESH = "fsdp=2"


def _actor(model, replay="none", **actor_keys):
    c = ppo_arith.get_config()
    c.actor.router_replay = replay
    c.actor.ppo_mini_batch_size, c.actor.ppo_micro_batch_size = PROMPTS, PROMPTS * N
    for k, v in actor_keys.items():
        setattr(c.actor, k, v)
    c.rollout.n, c.rollout.response_length = N, R
    rollout = RolloutSpec.of(c.rollout)
    pool = ResourcePool("devices0-2", tuple(jax.devices()[:2]))
    sampler = rollout_sampler(model, rollout, mesh=pool.mesh(MESH), max_prompt_len=P,
                              pad_id=0, rules=None, param_rules="train")
    return ActorRollout("actor", pool, MESH, model, rules="train", sampler=sampler,
                        spec=ActorSpec.of(c.actor), rollout=rollout, eos_ids=(1,),
                        optimizer=update.make_optimizer(1e-2, grad_clip=0.0))


@pytest.fixture(scope="module")
def sampled():
    """(actor, batch, master params): a batch sampled with bfloat16-rounded weights."""
    model = transformer.build(CFG, "causal_lm", seed=0)
    layers = model.model.layers
    for name in ("expert_gate", "expert_up", "expert_down"):
        getattr(layers, name)[...] = getattr(layers, name)[...] * 4
    actor = _actor(model)
    master = actor.params
    actor.params = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(x.dtype), master)
    rng = np.random.default_rng(0)
    prompts = rng.integers(2, CFG.vocab_size, (PROMPTS, P)).astype(np.int32)
    mask = np.ones_like(prompts)
    mask[0, :5], prompts[0, :5] = 0, 0  # one left-padded prompt
    batch = actor.generate(Batch({"prompts": prompts, "prompt_mask": mask,
                                  "seeds": np.arange(PROMPTS, dtype=np.uint32)}))
    rounded, actor.params = actor.params, master
    return actor, batch, rounded


def _mismatch(actor, params, batch):
    """[rows, R] bool: response tokens whose predicting position routes, in some layer, to
    another top-k set than the batch's recorded one, under `params` (the model's own pass)."""
    def fn(params, ids, mask, recorded):
        with moe.collecting() as found, moe.given_routing(recorded, replay=False):
            actor.model(params).model(ids, mask)
        return jnp.any(found[0].mismatch, axis=0)

    m = np.asarray(jax.jit(fn)(params, batch["input_ids"], batch["attention_mask"],
                               batch["routed_experts"]))
    width = batch["responses"].shape[1]
    cols = batch["input_ids"].shape[1] - width
    return m[:, cols - 1: cols + width - 1] & (np.asarray(batch["response_mask"]) > 0)


def test_the_sampler_records_the_experts_it_used(sampled):
    """Compact ids, column for column with input_ids, and the ones the sampling weights route
    to when the whole sequence is run again (decode and full pass agree in float32)."""
    actor, batch, rounded = sampled
    rec = batch["routed_experts"]
    assert rec.dtype == jnp.uint8
    assert rec.shape == (*batch["input_ids"].shape, 2, CFG.num_experts_per_tok)
    assert int(jnp.max(rec)) < CFG.num_experts
    assert not _mismatch(actor, rounded, batch).any()


def test_replay_gives_the_samplers_log_probs_where_routing_differs(sampled):
    """Without replay the trainer routes some tokens elsewhere and their log-probs move far
    from the sampler's; with r2 every token's old log-prob is the sampler's within the
    bfloat16 rounding of the weights, so the ratio to the rollout policy is 1 there."""
    actor, batch, _ = sampled
    differs = _mismatch(actor, actor.params, batch)
    assert differs.sum() >= 3
    real = np.asarray(batch["response_mask"]) > 0
    gaps = {}
    for mode in ("none", "r2"):
        actor.spec = dataclasses.replace(actor.spec, router_replay=mode)
        old = np.asarray(actor.compute_log_prob(batch)["old_log_probs"])
        gaps[mode] = np.abs(old - np.asarray(batch["rollout_log_probs"]))
    assert gaps["r2"][real].max() < 5e-3
    assert gaps["none"][differs].max() > 10 * gaps["r2"][real].max()
    ratio = np.exp(-gaps["r2"][differs])
    np.testing.assert_allclose(ratio, 1.0, atol=5e-3)


@pytest.mark.slow  # two update programs compiled: 26 s on the shared machine (load 22)
def test_update_logs_router_mismatch_and_r3_keeps_the_ratio(sampled):
    """One update each way on old log-probs scored with r2: r3 replays in the update too, so
    its ratio is 1 on every token (ppo_kl ~ 0, nothing clipped); r2's update routes by itself
    and its ratio moves where routing differs. `actor/router_mismatch` is the share of
    response tokens whose routing differs, in both."""
    actor, batch, _ = sampled
    actor.spec = dataclasses.replace(actor.spec, router_replay="r2")
    scored = batch.union(actor.compute_log_prob(batch).select(["old_log_probs"]))
    rows = len(batch)
    scored = scored.union(Batch({"advantages": jnp.ones((rows, R), jnp.float32)}))
    want = _mismatch(actor, actor.params, batch).sum() / np.asarray(batch["response_mask"]).sum()
    got = {}
    for mode in ("r2", "r3"):  # an actor each: the update program is traced once per actor
        learner = _actor(actor.model(jax.tree.map(jnp.copy, actor.params)), mode)
        got[mode] = {k: float(v) for k, v in learner.update_actor(scored).items()}
    assert got["r2"]["actor/router_mismatch"] == pytest.approx(want, rel=1e-5)
    assert abs(got["r3"]["actor/ppo_kl"]) < 1e-7  # measured: 3e-10 (r2: 1.2e-4)
    assert abs(got["r2"]["actor/ppo_kl"]) > 1000 * abs(got["r3"]["actor/ppo_kl"])
    # r3: the router's own choice against the replayed one (given replayed layers below).
    assert 0 < got["r3"]["actor/router_mismatch"] <= 2 * want


@pytest.mark.parametrize("keys, message", [
    (dict(use_remove_padding=True), "with actor.use_remove_padding=True"),
    (dict(group_by_length=True), "with actor.group_by_length=True"),
])
def test_replay_on_paths_that_do_not_carry_routing_refused(sampled, keys, message):
    actor = sampled[0]
    with pytest.raises(ValueError, match="router_replay=r3") as err:
        _actor(actor.model(actor.params), "r3", **keys)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_replay_on_a_dense_actor_refused():
    dense = transformer.build(dataclasses.replace(CFG, model_type="qwen3", num_experts=0,
                                                  num_experts_per_tok=0), "causal_lm", seed=0)
    with pytest.raises(ValueError, match="router_replay=r2 needs a mixture-of-experts model"):
        _actor(dense, "r2")


def test_a_warm_start_learns_with_every_expert_in_use(sampled):
    """A mixture of experts from scratch learns in the warm start (`update_sft`): its loss falls
    over a few steps on one batch, the load-balancing loss is added and logged, and every
    expert of every layer keeps receiving tokens (the least loaded at least a quarter of the
    mean load, the acceptance bar of the MoE learning runs, docs/architecture.md)."""
    _, batch, _ = sampled
    learner = _actor(transformer.build(CFG, "causal_lm", seed=1), moe_aux_loss_coef=0.01)
    sft = batch.select(["input_ids", "attention_mask", "responses", "response_mask"])
    logs = [{k: float(v) for k, v in learner.update_sft(sft, PROMPTS * N).items()}
            for _ in range(6)]
    assert logs[-1]["sft/loss"] < 0.9 * logs[0]["sft/loss"]  # measured: 4.18 -> 3.55
    assert all(m["sft/expert_load_min"] >= 0.25 for m in logs)
    assert logs[-1]["sft/expert_load_max"] > 1.0
    assert logs[0]["sft/moe_aux_loss"] == pytest.approx(CFG.num_experts_per_tok, rel=0.5)
