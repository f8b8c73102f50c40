"""The algorithm drivers beyond PPO and GRPO: every bad setting is refused before anything
compiles; a user algorithm with a role, a model and an estimator of its own runs from its own
file; DAPO's dynamic sampling when it cannot fill its batch; Safe-RLHF's step end to end with
tiny reward and cost models."""

import contextlib
import dataclasses
import os
import textwrap

import jax
import numpy as np
import pytest
from ml_collections import config_dict
from support import tiny_rl_config

from hfjax.algorithms import dapo
from hfjax.algorithms.registry import get_algorithm
from hfjax.config import check_config, validate_config
from hfjax.controller.batch import Batch
from hfjax.data import arith
from hfjax.models import save_hf, transformer
from hfjax.models.config import scratch_model_config
from hfjax.rewards.registry import register_reward
from hfjax.run.trainer import Trainer

HERE = os.path.dirname(os.path.abspath(__file__))
# The helper's module name, whole, ships its file with this test in the Bazel build.
USER_MODULE = "user_algo_module"
USER_ALGO = os.path.join(HERE, f"{USER_MODULE}.py") + ":step"
DIGITS = "tests/algorithms/digit_fraction"
CONSTANT = "tests/algorithms/constant"


@register_reward(DIGITS)
def digit_fraction(data_source, solution_str, ground_truth, extra_info):
    """A dense reward: the share of the response's characters that are digits."""
    return sum(ch.isdigit() for ch in solution_str) / max(len(solution_str), 1)


@register_reward(CONSTANT)
def constant(data_source, solution_str, ground_truth, extra_info):
    """Every response scores the same: every group is uniform."""
    return 1.0


_COMPILES = []
_WATCHING = [False]


def _on_event(name, *args, **kw):
    if _WATCHING[0] and name.endswith("backend_compile_duration"):
        _COMPILES.append(name)


jax.monitoring.register_event_duration_secs_listener(_on_event)


@contextlib.contextmanager
def no_compiles():
    """Fails if XLA compiles a program inside the block."""
    _COMPILES.clear()
    _WATCHING[0] = True
    try:
        yield
    finally:
        _WATCHING[0] = False
    assert not _COMPILES, f"{len(_COMPILES)} programs compiled before the error"


def grouped(cfg, n=4, prompts=4):
    cfg.rollout.n, cfg.data.train_batch_size = n, prompts
    cfg.actor.ppo_mini_batch_size = prompts
    cfg.actor.ppo_micro_batch_size = 8
    return cfg


def with_source(trainer, source):
    for rows in (trainer.train_data.rows, trainer.test_data.rows):
        for row in rows:
            row["data_source"] = source
    return trainer


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    """A tiny causal LM in HF format (no score head)."""
    cfg = tiny_rl_config()
    tok = arith.tokenizer()
    mcfg = scratch_model_config(cfg.model, tok.vocab_size, tok.pad_id, tok.eos_id, 32)
    return save_hf(transformer.build(mcfg, "causal_lm"), str(tmp_path_factory.mktemp("lm")))


@pytest.fixture(scope="module")
def score_dirs(tmp_path_factory):
    """Tiny reward and cost models in HF sequence-classification format."""
    cfg = tiny_rl_config()
    tok = arith.tokenizer()
    mcfg = scratch_model_config(cfg.model, tok.vocab_size, tok.pad_id, tok.eos_id, 32)
    return tuple(
        save_hf(transformer.build(mcfg, "score", seed=s), str(tmp_path_factory.mktemp(name)))
        for s, name in ((1, "rm"), (2, "cost")))


# ------------------------------------------------------------------------------------ bad input


def _set(**kw):
    def change(c, _lm, _dirs):
        for key, value in kw.items():
            *path, last = key.split("__")
            node = c
            for p in path:
                node = node[p]
            node[last] = value
    return change


BAD = {
    "unknown-algorithm": (_set(algorithm="ppo3"),
                          r"unknown algorithm 'ppo3'; known: .*, or a user algorithm as "
                          r"--config.algorithm=package.module:step"),
    "unknown-module": (_set(algorithm="no_such_pkg.algos:step"),
                       r"cannot import module 'no_such_pkg.algos' .*PYTHONPATH"),
    "missing-file": (_set(algorithm="/nonexistent/algo.py:step"),
                     r"file /nonexistent/algo.py does not exist"),
    "missing-function": (_set(algorithm="hfjax.algorithms.ppo:no_step"),
                         r"module hfjax.algorithms.ppo has no attribute 'no_step'"),
    "unregistered-function": (_set(algorithm="hfjax.algorithms.dataflow:sample"),
                              r"sample is not a registered driver; decorate it with"),
    "group-estimator-one-sample": (
        _set(algorithm="grpo", algo__adv_estimator="grpo"),
        r"adv_estimator='grpo' compares the samples of each prompt, but rollout.n=1"),
    "rloo-one-sample": (_set(algorithm="rloo", algo__adv_estimator="rloo"),
                        r"rollout.n=1 draws one; set --config.rollout.n to 2 or more"),
    "dapo-with-kl": (
        _set(algorithm="dapo", algo__adv_estimator="grpo", rollout__n=4,
             actor__ppo_micro_batch_size=16, actor__use_kl_loss=True),
        r"algorithm 'dapo' trains without a KL term; set --config.actor.use_kl_loss=False"),
    "dapo-kl-in-reward": (
        _set(algorithm="dapo", algo__adv_estimator="grpo", rollout__n=4,
             actor__ppo_micro_batch_size=16, algo__use_kl_in_reward=True),
        r"algorithm 'dapo' trains without a KL term"),
    "safe-rlhf-without-cost-model": (
        lambda c, lm, dirs: _set(algorithm="safe_rlhf", algo__adv_estimator="safe_rlhf",
                                 reward_model__path=dirs[0])(c, lm, dirs),
        r"algorithm 'safe_rlhf' needs a cost model: set --config.cost_model.path"),
    "cost-model-without-costs": (
        lambda c, lm, dirs: _set(cost_model__path=dirs[1])(c, lm, dirs),
        r"cost_model.path is set but algorithm 'ppo' has no cost"),
    "reward-model-without-score-head": (
        lambda c, lm, dirs: _set(reward_model__path=lm)(c, lm, dirs),
        r"reward_model.path=.* has no score head .*LlamaForCausalLM.*launch.train_rm"),
    "gspo-without-its-loss": (
        _set(algorithm="gspo", algo__adv_estimator="grpo", rollout__n=4,
             actor__ppo_micro_batch_size=16),
        r"algorithm 'gspo' runs with actor.policy_loss='gspo', the config has 'vanilla'"),
    "drgrpo-with-std": (
        _set(algorithm="drgrpo", algo__adv_estimator="grpo", rollout__n=4,
             actor__ppo_micro_batch_size=16),
        r"algorithm 'drgrpo' runs with algo.norm_adv_by_std_in_grpo=False"),
    "kl-without-reference": (_set(algorithm=USER_ALGO, algo__adv_estimator="user_centered",
                                  rollout__n=4, actor__ppo_micro_batch_size=16),
                             r"algorithm 'user_grpo_probe' has no reference policy, so it has "
                             r"no KL term"),
    "reward-sources": (_set(reward__sources="hfjax/arith=rules:1"),
                       r"reward.sources item 'hfjax/arith=rules:1': write"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_setting_fails_before_anything_compiles(name, lm_dir, score_dirs):
    change, message = BAD[name]
    cfg = tiny_rl_config()
    change(cfg, lm_dir, score_dirs)
    with no_compiles():
        with pytest.raises(ValueError, match=message):
            validate_config(cfg)
        with pytest.raises(ValueError, match=message):
            Trainer(cfg)


# ----------------------------------------------------------------------------- user algorithms


def test_user_algorithm_from_its_own_file():
    """A role, an NNX module and an estimator hfjax has never heard of: the role gets a pool of
    its own under `split` and a worker group from its builder, and the step runs."""
    cfg = grouped(tiny_rl_config(placement="split"))
    cfg.algorithm = USER_ALGO
    cfg.algo.adv_estimator = "user_centered"
    cfg.algo.use_kl_in_reward = False  # the algorithm has no reference model
    cfg.probe = config_dict.ConfigDict({"mesh": "fsdp=-1"})  # a key the module declares
    trainer = with_source(Trainer(cfg), DIGITS)
    assert trainer.algo.name == "user_grpo_probe"
    pools = trainer.pools
    assert pools["probe"].size == 4 and pools["actor"].size == 4
    assert not set(pools["probe"].device_ids) & set(pools["actor"].device_ids)
    metrics = trainer.train_step()
    w = trainer.workers
    assert "probe" in w.built_roles() and w.probe is w.roles["probe"]
    assert w.probe.mesh.devices.size == 4
    assert np.isfinite(metrics["probe/mean"]) and metrics["actor/grad_norm"] > 0
    # A key the module does not declare is refused like any unknown key.
    cfg.probe.meshh = "fsdp=-1"
    with pytest.raises(ValueError, match=r"unknown config key probe.meshh; did you mean "
                                         r"probe.mesh\?"):
        check_config(cfg)
    # The spelling with a module path finds the same kind of registration.
    with pytest.raises(ValueError, match="cannot import module"):
        get_algorithm("tests_no_such_module:step")


def test_user_algorithm_as_a_module_path(tmp_path, monkeypatch):
    pkg = tmp_path / "my_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "my_algo.py").write_text(textwrap.dedent('''
        from hfjax.algorithms.grpo import grpo_step
        from hfjax.algorithms.registry import register_algorithm

        @register_algorithm("my_grpo", roles=("actor", "ref", "reward"))
        def step(w, batch, spec):
            return grpo_step(w, batch, spec)
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    algo = get_algorithm("my_pkg.my_algo:step")
    assert algo.name == "my_grpo" and algo.roles == ("actor", "ref", "reward")
    assert get_algorithm("my_grpo") is algo


# ---------------------------------------------------------------------------------------- DAPO


def dapo_config(cap, on_exhausted):
    cfg = grouped(tiny_rl_config(algorithm="dapo"))
    cfg.algo.adv_estimator = "grpo"
    cfg.algo.use_kl_in_reward = False
    cfg.actor.clip_ratio_high = 0.28
    cfg.algo.filter_groups.enable = True
    cfg.algo.filter_groups.max_num_gen_batches = cap
    cfg.algo.filter_groups.on_exhausted = on_exhausted
    cfg.algo.overlong_buffer.enable = True
    cfg.algo.overlong_buffer.len = 4
    return cfg


@pytest.mark.slow
def test_dapo_dynamic_sampling_that_cannot_fill_its_batch():
    # Every response scores the same, except through the overlong penalty: turn that off, so
    # that every group is uniform and none can be kept.
    cfg = dapo_config(cap=2, on_exhausted="error")
    cfg.algo.overlong_buffer.enable = False
    trainer = with_source(Trainer(cfg), CONSTANT)
    with pytest.raises(dapo.DynamicSamplingExhausted,
                       match=r"kept 0 of 4 groups .* after 2 generation batches .*"
                             r"max_num_gen_batches=2\); raise the cap"):
        trainer.train_step()

    # The same trainer (its programs compiled) with the other behaviour: the steps read the
    # settings the trainer read once (its StepSpec), not the config.
    algo = trainer.spec.algo
    fill = dataclasses.replace(algo.filter_groups, on_exhausted="fill")
    trainer.spec = dataclasses.replace(trainer.spec,
                                       algo=dataclasses.replace(algo, filter_groups=fill))
    pulled = trainer.train_iter.state()["cursor"]
    m = trainer.train_step()
    assert m["dapo/gen_batches"] == 2 and m["dapo/filled_groups"] == 4
    # Two prompt batches were drawn for the one step, and the uniform groups train nothing.
    assert trainer.train_iter.state()["cursor"] == pulled + 8
    assert m["actor/pg_loss"] == 0.0 and m["critic/advantages/mean"] == 0.0


@pytest.mark.slow
def test_dapo_keeps_varied_groups_and_shapes_overlong_responses():
    trainer = with_source(Trainer(dapo_config(cap=3, on_exhausted="error")), DIGITS)
    seen = []
    update = trainer.actor.update_actor
    trainer.actor.update_actor = lambda b: seen.append(b) or update(b)
    m = trainer.train_step()
    assert m["dapo/filled_groups"] == 0 and 1 <= m["dapo/gen_batches"] <= 3
    got = seen[0].fetch(["token_level_scores", "response_mask", "overlong_penalty"])
    length = got["response_mask"].sum(1)
    # 8-token responses with a 4-token buffer: lengths 5..8 lose (L - 4) / 4.
    np.testing.assert_allclose(got["overlong_penalty"], -np.maximum(length - 4, 0) / 4.0,
                               atol=1e-6)
    scores = got["token_level_scores"].sum(1).reshape(-1, 4)
    assert np.all(scores.max(1) > scores.min(1))  # only groups with differing scores


def test_align_pads_batches_of_different_widths():
    def gen(p, r, value):
        prompts = np.full((2, p), value, np.int32)
        resp = np.full((2, r), value, np.int32)
        ones_p, ones_r = np.ones((2, p), np.int32), np.ones((2, r), np.int32)
        return Batch({"prompts": prompts, "prompt_mask": ones_p, "responses": resp,
                      "response_mask": ones_r, "input_ids": np.concatenate([prompts, resp], 1),
                      "attention_mask": np.ones((2, p + r), np.int32),
                      "token_level_scores": ones_r.astype(np.float32),
                      "seeds": np.arange(2, dtype=np.int32)})

    a, b = dapo.align([gen(4, 8, 1), gen(8, 16, 2)])
    for x in (a, b):
        assert x["prompts"].shape == (2, 8) and x["responses"].shape == (2, 16)
        assert x["input_ids"].shape == (2, 24)
    ids, mask = np.asarray(a["input_ids"]), np.asarray(a["attention_mask"])
    # Prompts pad on the left, responses on the right; masks say which tokens are real.
    np.testing.assert_array_equal(mask[0], [0] * 4 + [1] * 12 + [0] * 8)
    np.testing.assert_array_equal(ids[0][mask[0] > 0], [1] * 12)
    merged = Batch.concat([a, b])
    assert len(merged) == 4


# ----------------------------------------------------------------------------------- Safe-RLHF


def _loop_gae(rewards, values, mask, gamma, lam):
    """GAE per row, from the last response token back (0 off the mask)."""
    b, t = rewards.shape
    out = np.zeros((b, t))
    for i in range(b):
        next_value, running = 0.0, 0.0
        for j in range(t - 1, -1, -1):
            if mask[i, j]:
                delta = rewards[i, j] + gamma * next_value - values[i, j]
                running = delta + gamma * lam * running
                next_value = values[i, j]
                out[i, j] = running
    return out


def _loop_safe_rlhf_advantage(b, lam, gamma, gae_lam):
    """(A_r - lam A_c) / (1 + lam) token by token, whitened over the response tokens."""
    m = b["response_mask"]
    a_r = _loop_gae(b["token_level_rewards"], b["values"], m, gamma, gae_lam)
    a_c = _loop_gae(b["token_level_costs"], b["cost_values"], m, gamma, gae_lam)
    combined, vals = np.zeros(m.shape), []
    for i in range(m.shape[0]):
        for j in range(m.shape[1]):
            if m[i, j]:
                combined[i, j] = (a_r[i, j] - lam * a_c[i, j]) / (1.0 + lam)
                vals.append(combined[i, j])
    mean = sum(vals) / len(vals)
    std = (sum((v - mean) ** 2 for v in vals) / (len(vals) - 1) + 1e-8) ** 0.5
    return np.where(m > 0, (combined - mean) / std, 0.0), a_c


@pytest.mark.slow
def test_safe_rlhf_step(score_dirs):
    rm, cost = score_dirs
    cfg = tiny_rl_config(algorithm="safe_rlhf", placement="split")
    cfg.algo.adv_estimator = "safe_rlhf"
    cfg.reward_model.path, cfg.cost_model.path = rm, cost
    cfg.reward.rule_weight = 0.0
    cfg.cost_model.reference_fn = "hfjax.data.arith:forbidden_digit_cost"
    cfg.cost_model.use_remove_padding = True  # the cost model scores packed rows, the reward
    s = cfg.algo.safe_rlhf  # model padded ones
    # A threshold far below any mean cost the tiny cost model gives: lambda must grow.
    s.cost_threshold, s.lambda_init, s.lambda_lr = -50.0, 1.0, 0.02
    trainer = Trainer(cfg)
    assert trainer.pools["cost_critic"] is trainer.pools["critic"]  # the scoring side
    assert trainer.workers.cost_model.budget and trainer.workers.reward_model.budget is None
    m = trainer.train_step()
    w = trainer.workers
    assert {"critic", "cost_critic", "reward_model", "cost_model"} <= set(w.built_roles())
    for k in ("cost/mean", "cost_critic/vf_loss", "critic/vf_loss", "reward_model/score/mean"):
        assert np.isfinite(m[k]), k
    # The multiplier took one step on the batch's mean cost, upwards: the cost is above the
    # threshold.
    assert abs(m["cost/mean"]) < 50
    want = np.exp(0.02 * 1.0 * (m["cost/mean"] + 50.0))
    assert m["safe_rlhf/lambda"] == pytest.approx(want, rel=1e-6)
    assert m["safe_rlhf/lambda"] > 1.0
    # Below the threshold it shrinks (multiplicatively: it stays above 0).
    lam1 = m["safe_rlhf/lambda"]
    w.lagrange = dataclasses.replace(w.lagrange, threshold=50.0)
    m2 = trainer.train_step()
    assert abs(m2["cost/mean"]) < 50
    want = lam1 * np.exp(0.02 * lam1 * (m2["cost/mean"] - 50.0))
    assert m2["safe_rlhf/lambda"] == pytest.approx(want, rel=1e-6)
    assert 0.0 < m2["safe_rlhf/lambda"] < lam1
    # The actor's advantage: (A_r - lambda A_c) / (1 + lambda) over the two critics' GAE,
    # whitened, against a loop over the step's own batch.
    lam2 = w.lagrange.value
    out, _ = trainer.algo.step(w, trainer._prompts(next(trainer.train_iter)), trainer.spec)
    b = out.fetch(["response_mask", "token_level_rewards", "values", "token_level_costs",
                   "cost_values", "advantages"])
    b = {k: np.asarray(v, np.float64) for k, v in b.items()}
    want, a_c = _loop_safe_rlhf_advantage(b, lam2, cfg.algo.gamma, cfg.algo.lam)
    np.testing.assert_allclose(b["advantages"], want, rtol=1e-4, atol=1e-4)
    # The cost term moved it: without the multiplier's share the advantage differs.
    assert np.abs(a_c).max() > 1e-3
    assert np.abs(_loop_safe_rlhf_advantage(b, 0.0, cfg.algo.gamma, cfg.algo.lam)[0]
                  - want).max() > 1e-3
    # No rule reward: the scores are the reward model's alone.
    assert m["critic/score/mean"] == pytest.approx(m["reward_model/score/mean"], abs=1e-6)
    val = trainer.validate()
    assert {"val-aux/rm_scores/mean", "val-aux/cost_scores/mean",
            "val-aux/cost_reference/mean"} <= set(val)
    assert {"cost_critic_params", "cost_critic_opt_state"} <= set(trainer.checkpoint_items())
    # Rule and model rewards combined per data_source: this source takes rule + 0.5 * model.
    from hfjax.algorithms.dataflow import reward

    with_source(trainer, DIGITS)
    trainer.reward.sources = {DIGITS: (1.0, 0.5, 0.0)}
    gen = w.actor.generate(trainer._prompts(next(trainer.train_iter)))
    mixed = reward(w, gen, cfg).fetch(["token_level_scores", "rm_scores"])
    rule = trainer.reward.compute_reward(gen).fetch(["token_level_scores"])
    np.testing.assert_allclose(
        mixed["token_level_scores"].sum(1),
        rule["token_level_scores"].sum(1) + 0.5 * mixed["rm_scores"], rtol=1e-6, atol=1e-6)
    assert np.abs(rule["token_level_scores"]).sum() > 0 and np.abs(mixed["rm_scores"]).sum() > 0
    assert trainer.state_dict()["lagrange"]["log_lambda"] == pytest.approx(
        np.log(m2["safe_rlhf/lambda"]))
