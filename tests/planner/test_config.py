"""A run config as the planner sees it: models, host roles and the step's shape, and a plan as
the flagfile launch.train reads."""

import pytest

from configs import grpo_arith, opd_arith, ppo_arith
from hfjax.planner import search
from hfjax.planner.config import flagfile_lines, plan_inputs


def test_ppo_default_inputs():
    cfg = ppo_arith.get_config()
    models, host, w = plan_inputs(cfg)
    assert [(m.role, m.head, m.trainable) for m in models] == [
        ("actor", "causal_lm", True), ("critic", "value", True), ("ref", "causal_lm", False)]
    assert host == ("reward",)  # the rule reward
    # 8-token prompts and 10-token responses run in the sampler's 16-token buckets.
    assert (w.prompts, w.n, w.prompt_len, w.response_len) == (128, 1, 16, 16)
    assert (w.actor_mini, w.actor_micro, w.critic_mini, w.critic_micro) == (64, 64, 64, 64)
    assert w.old_log_prob  # KL in the reward reads the old log-probs
    cfg.algo.use_kl_in_reward = False
    models, host, w = plan_inputs(cfg)
    assert [m.role for m in models] == ["actor", "critic"] and host == ("ref", "reward")
    assert w.old_log_prob  # two mini-batches: the second is off-policy
    cfg.actor.ppo_mini_batch_size = 128
    assert not plan_inputs(cfg)[2].old_log_prob  # one update on its own samples


def test_grpo_inputs_and_a_reward_model():
    cfg = grpo_arith.get_config()
    models, host, w = plan_inputs(cfg, reward_model="preset:tiny")
    assert [m.role for m in models] == ["actor", "ref", "reward"] and host == ()
    assert models[-1].head == "score" and not models[-1].trainable
    assert (w.prompts, w.n, w.actor_mini, w.critic_mini) == (32, 8, 128, 0)


def test_flagfile_puts_the_plan_after_the_users_overrides():
    cfg = ppo_arith.get_config()
    models, host, w = plan_inputs(cfg)
    result = search.plan(models, w, "cpu", 8, host_roles=host)
    argv = ["launch.plan", "--target=cpu", "--config.trainer.total_steps=2",
            "--config.actor.mesh=data=8"]
    lines, missing = flagfile_lines(result.best, cfg, "configs/ppo_arith.py", argv)
    assert lines[1] == "--config=configs/ppo_arith.py"
    assert lines[2:4] == argv[2:]  # the user's overrides, in order, before the plan's
    assert lines[-1] == "--config.rollout.hybrid_engine=true"
    assert f"--config.actor.mesh={result.best.meshes()['actor']}" in lines[4:]
    assert missing == []


def test_a_reward_model_is_planned_as_the_reward_model_role():
    cfg = ppo_arith.get_config()
    cfg.reward_model.path = "preset:tiny"  # the config's reward model, as launch.train reads it
    models, host, w = plan_inputs(cfg, platform="cpu")
    assert [m.role for m in models] == ["actor", "critic", "ref", "reward"] and host == ()
    assert models[-1].config.param_dtype == cfg.reward_model.dtype
    result = search.plan(models, w, "cpu", 8, host_roles=host)
    lines, missing = flagfile_lines(result.best, cfg, "configs/ppo_arith.py", ["launch.plan"],
                                    reward_model="preset:tiny")
    assert missing == []
    assert "--config.reward_model.path=preset:tiny" in lines
    assert f"--config.reward_model.mesh={result.best.meshes()['reward']}" in lines
    placement = next(x for x in lines if x.startswith("--config.placement="))
    pools = [p.split(":", 1)[1].split("+") for p in placement.split("=", 1)[1].split(";")]
    holder = next(roles for roles in pools if "reward" in roles)
    assert "reward_model" in holder  # placed with the reward it feeds
    assert sum("reward_model" in roles for roles in pools) == 1


def test_the_config_says_how_the_programs_batch_and_flags_override_it():
    from hfjax.config import ConfigError, check_config

    cfg = ppo_arith.get_config()
    w = plan_inputs(cfg)[2]
    assert (w.score_micro, w.gen_rows) == (0, 0)  # as hfjax's runs do
    cfg.plan.score_micro, cfg.plan.gen_rows = 32, -1
    w = plan_inputs(cfg)[2]
    assert (w.score_micro, w.gen_rows) == (32, -1)
    w = plan_inputs(cfg, score_micro=0, gen_rows=0)[2]  # launch.plan --score_micro, --gen_rows
    assert (w.score_micro, w.gen_rows) == (0, 0)
    # Only the planner reads them: a train config without the section is complete.
    del cfg["plan"]
    check_config(cfg)
    assert plan_inputs(cfg)[2].gen_rows == 0
    cfg = ppo_arith.get_config()
    cfg.plan.gen_rows = -2
    with pytest.raises(ConfigError, match="plan.gen_rows=-2: needs an int >= -1"):
        check_config(cfg)


def test_opd_plans_the_teacher_as_a_role_of_its_own():
    """OPD (configs/opd_arith.py) with a teacher twice the student's size: the teacher is a
    frozen model of its own, scored after generation, and a placement is found for it."""
    cfg = opd_arith.get_config()
    cfg.teacher.path = "preset:tiny"
    models, host, w = plan_inputs(cfg)
    by_role = {m.role: m for m in models}
    assert set(by_role) == {"actor", "teacher"} and host == ("reward",)
    assert not by_role["teacher"].trainable
    assert by_role["teacher"].config.hidden_size != by_role["actor"].config.hidden_size
    assert w.old_log_prob  # the term compares the student's log-probs with the teacher's
    result = search.plan(models, w, "cpu", 8, host_roles=host)
    assert "teacher" in result.best.meshes()
    assert [s.name for s in search.rlhf_dataflow(("actor", "teacher", "reward"))] == [
        "gen", "old_log_prob", "teacher", "reward", "update_actor"]
