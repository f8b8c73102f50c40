"""LoRA in the RL loop on 8 CPU devices: GRPO through the 3D-HybridEngine trains the adapters
only, the reference is the actor's frozen base (no copy) and scores as a plain reference
built from the base weights would."""

import os

import jax
import numpy as np
import pytest
from flax import nnx
from support import host, tiny_rl_config

from hfjax.config import ConfigError, validate_config
from hfjax.controller.batch import Batch
from hfjax.data.batching import prompt_batch
from hfjax.rewards.registry import register_reward
from hfjax.run.trainer import Trainer
from hfjax.workers.actor import BaseReference, Reference

# A dense reward, so that a step from a randomly initialised model has non-zero advantages
# (the exact-answer rule scores such a model 0 everywhere).
SOURCE = "tests/lora_rl/digit_fraction"


@register_reward(SOURCE)
def digit_fraction(data_source, solution_str, ground_truth, extra_info):
    """The fraction of the response's characters that are digits."""
    return sum(ch.isdigit() for ch in solution_str) / max(len(solution_str), 1)


def make_trainer(cfg):
    trainer = Trainer(cfg)
    for row in trainer.train_data.rows:
        row["data_source"] = SOURCE
    return trainer


def lora_config(rank=4):
    c = tiny_rl_config(algorithm="grpo")
    c.data.train_batch_size = 4
    c.rollout.n = 4
    c.actor.ppo_mini_batch_size = 4
    c.actor.ppo_micro_batch_size = 8
    c.actor.use_kl_loss = True
    c.actor.lr = 1e-2
    c.algo.adv_estimator = "grpo"
    c.algo.use_kl_in_reward = False
    c.actor.mesh = "fsdp=4,tensor=2"
    c.rollout.mesh = "data=4,tensor=2"
    c.actor.lora.rank = rank
    c.actor.lora.alpha = 8.0
    return c


@pytest.mark.slow
def test_grpo_with_lora_trains_adapters_and_scores_the_reference_on_the_base():
    t = make_trainer(lora_config())
    w = t.workers
    assert t.actor.hybrid is not None
    assert isinstance(w.ref, BaseReference)
    # One copy of the base: the reference's arrays are the actor's.
    assert all(a is b for a, b in zip(jax.tree.leaves(w.ref.params),
                                      jax.tree.leaves(t.actor.base_params())))
    base = host(t.actor.base_params())
    adapters = host(t.actor.trainable_params())
    for _ in range(2):
        metrics = t.train_step()
    assert np.isfinite(metrics["actor/pg_loss"]) and metrics["actor/kl_loss"] > 0
    after = host(t.actor.base_params())
    assert base.keys() == after.keys()
    for k in base:
        np.testing.assert_array_equal(after[k], base[k], err_msg=k)  # the base is frozen
    moved = host(t.actor.trainable_params())
    assert any(not np.array_equal(moved[k], adapters[k]) for k in adapters)

    # The shared reference scores as a reference built from a copy of the base weights, and
    # unlike the adapted actor.
    rows = t.test_data.rows[:8]
    prompts = prompt_batch(rows, np.zeros(len(rows), np.int32), t.tok.pad_id,
                           t.cfg.data.max_prompt_length)
    batch = t.actor.generate(prompts, greedy=True, n=1)
    with jax.transfer_guard("allow"):
        base_model = nnx.merge(t.actor.base_graphdef,
                               jax.tree.map(lambda x: x.copy(), t.actor.base_params()))
    plain = Reference("plain_ref", t.actor.pool, t.cfg.actor.mesh, base_model,
                      spec=t.actor.spec, rollout=t.actor.rollout, home=t.actor.mesh)
    seqs = Batch({k: batch[k] for k in ("input_ids", "attention_mask", "responses")})
    shared = np.asarray(w.ref.compute_ref_log_prob(seqs)["ref_log_prob"])
    copied = np.asarray(plain.compute_ref_log_prob(seqs)["ref_log_prob"])
    policy = np.asarray(t.actor.compute_log_prob(seqs)["old_log_probs"])
    mask = np.asarray(batch["response_mask"]) > 0
    np.testing.assert_allclose(shared[mask], copied[mask], atol=1e-5)
    assert np.abs(shared[mask] - policy[mask]).max() > 1e-4
    # Generation decodes the adapted model (the adapters merged into the base), not the base:
    # the sampler's log-probs are the trainer's, and the base's differ by more than 1e-4.
    rollout = np.asarray(batch["rollout_log_probs"])
    np.testing.assert_allclose(rollout[mask], policy[mask], atol=1e-5)


def test_lora_reference_refuses_a_pool_of_its_own():
    c = lora_config()
    c.placement = {"gen": {"size": 4, "roles": ["actor", "reward"]},
                   "ref": {"size": 4, "roles": ["ref"]}}
    c.actor.mesh = c.ref.mesh = "fsdp=4"
    c.rollout.mesh = ""
    with pytest.raises(ConfigError, match="reference reads the actor's frozen base.*'ref'"):
        validate_config(c)


def _lowered(cfg) -> dict[str, str]:
    """{program name: its lowered text} of every device program of a step of `cfg`, built
    from abstract shapes (nothing is compiled or allocated), and the LoRA merge."""
    from hfjax.run import dry_run

    w = dry_run.abstract_groups(cfg)
    shape = dry_run.step_shape(w, cfg)
    out = {p.name: p.fn.lower(*p.args).as_text()
           for _, g in dry_run.device_groups(w) for p in g.programs(shape)}
    out["actor.merge"] = w.actor.merge_program().lower(w.actor.params).as_text()
    return out


def test_adapter_dropout_changes_the_update_only():
    """Scoring (old-policy and reference log-probs, critic values) and the merged decode copy
    lower to the same programs with and without adapter dropout; the updates differ."""
    def config(dropout, mode="padded"):
        c = tiny_rl_config(algorithm="ppo")
        c.actor.lora.rank, c.actor.lora.alpha, c.actor.lora.dropout = 4, 8.0, dropout
        c.critic.lora.rank, c.critic.lora.alpha, c.critic.lora.dropout = 4, 8.0, dropout
        c.actor.use_kl_loss = True
        c.actor.use_remove_padding = c.critic.use_remove_padding = mode == "packed"
        c.actor.group_by_length = c.critic.group_by_length = mode == "grouped"
        return c

    for mode in ("padded", "packed", "grouped"):
        plain, dropped = _lowered(config(0.0, mode)), _lowered(config(0.3, mode))
        assert plain.keys() == dropped.keys() >= {"actor.log_prob", "ref.log_prob",
                                                  "critic.values", "actor.update",
                                                  "critic.update", "actor.merge"}
        for name in plain:
            # A length-grouped update's optimizer step (`.update.apply`) has no forward pass.
            same = plain[name] == dropped[name]
            assert same == (not name.endswith(".update")), (name, mode)

    c = config(1.0)
    with pytest.raises(ConfigError, match=r"actor.lora.dropout.*\[0, 1\)"):
        validate_config(c)


@pytest.mark.slow
def test_lora_checkpoints_hold_adapters_and_resume_bitwise(tmp_path):
    import shutil

    from hfjax.run.checkpoint import RunCheckpointer
    from hfjax.workers import lora_state

    def config():
        c = lora_config()
        c.actor.lora.dropout = 0.25  # a resumed run draws the masks the first run drew
        c.rollout.mesh = ""  # decode in the training layout: a faster test
        c.trainer.total_steps, c.trainer.save_freq, c.trainer.test_freq = 4, 2, 0
        c.trainer.val_before_train = False
        return c

    a = make_trainer(config())
    a.fit(RunCheckpointer(str(tmp_path / "a"), async_save=False, max_to_keep=5))
    assert a.actor.dropout is not None and a.actor.dropout.rate == 0.25
    want = host((a.actor.params, a.actor.opt_state))
    saved = RunCheckpointer(str(tmp_path / "a"), read_only=True)
    state, _ = saved.read_json(2)
    # Adapters and their Adam state; the base only because this run's base has no path.
    assert set(os.listdir(saved.step_dir(2))) >= {"actor_params", "actor_opt_state",
                                                   "actor_base"}
    assert "ref_params" not in os.listdir(saved.step_dir(2))
    assert state["lora"]["spec"]["rank"] == 4 and state["lora"]["base"]["saved"]
    adapter_names = {k for k in host(a.actor.trainable_params())}
    assert adapter_names and all("_lora_" in k for k in adapter_names)

    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "4")
    b = make_trainer(config())
    result = b.fit(RunCheckpointer(str(tmp_path / "b"), async_save=False, max_to_keep=5))
    assert result.resumed_from == 2 and result.step == 4
    got = host((b.actor.params, b.actor.opt_state))
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)

    # A base named by a path whose weights changed since is refused.
    record = dict(state["lora"])
    record["base"] = {"path": "some/model", "saved": False,
                      "fingerprints": {"['model']['norm'].value": 1}}
    problem = lora_state.install(b.actor, {}, record, lambda named: {k: 0 for k in named})
    assert "not the one the adapters were trained on" in problem
    other = dict(record, spec=dict(record["spec"], rank=8))
    assert "same actor.lora settings" in lora_state.install(b.actor, {}, other, None)


@pytest.mark.slow
def test_ppo_critic_with_lora_trains_adapters_and_value_head_only():
    c = tiny_rl_config(algorithm="ppo")
    c.critic.lora.rank, c.critic.lora.alpha = 4, 8.0
    c.critic.lr = 1e-2
    # Adapter dropout through the length-grouped critic update and the packed actor update.
    c.critic.lora.dropout = 0.1
    c.critic.group_by_length = True
    c.actor.lora.rank, c.actor.lora.alpha, c.actor.lora.dropout = 4, 8.0, 0.1
    c.actor.use_remove_padding = True
    t = make_trainer(c)
    critic = t.workers.critic
    assert critic.dropout.rate == t.actor.dropout.rate == 0.1
    before = host(critic.params)
    metrics = t.train_step()
    assert np.isfinite(metrics["critic/vf_loss"]) and np.isfinite(metrics["actor/pg_loss"])
    after = host(critic.params)
    changed = {k for k in before if not np.array_equal(before[k], after[k])}
    assert changed and all("_lora_" in k or "score" in k for k in changed), changed
    assert any("score" in k for k in changed)
    # Adam state for the adapters and the head only.
    sizes = sorted(x.size for x in jax.tree.leaves(critic.opt_state) if x.ndim > 0)
    trained = sorted(x.size for x in jax.tree.leaves(critic.trainable_params()))
    assert sizes == sorted(trained * 2)
