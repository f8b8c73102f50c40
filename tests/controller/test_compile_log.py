"""The compile log: each backend compile is filed under the stage running at the time, with the
program's name and integer/boolean argument shapes, and a trainer's first step reports what it
compiled (`timing_s/compile`, `compile_s/<stage>/<program>`)."""

import jax
import jax.numpy as jnp
import pytest
from support import tiny_rl_config

from hfjax.controller import compile_log
from hfjax.run.metrics import MetricsLogger
from hfjax.run.trainer import Trainer


def _double_ids(ids, mask):
    return ids * 2 + mask.astype(jnp.int32)


def test_compiles_are_filed_by_stage_with_their_shapes():
    log = compile_log.install()
    assert compile_log.install() is log  # one per process
    log.take()
    f = jax.jit(_double_ids)
    with compile_log.stage("gen"):
        f(jnp.ones((3, 5), jnp.int32), jnp.ones((3, 5), bool)).block_until_ready()
    f(jnp.ones((2, 7), jnp.int32), jnp.ones((2, 7), bool)).block_until_ready()  # no stage
    f(jnp.ones((2, 7), jnp.int32), jnp.ones((2, 7), bool)).block_until_ready()  # in memory
    records = log.take()
    mine = [c for c in records.compiles if "_double_ids" in c.name]
    assert [(c.stage, c.shapes) for c in mine] == [
        ("gen", "int32[3,5] bool[3,5]"), ("", "int32[2,7] bool[2,7]")]
    assert all(c.seconds > 0 for c in mine)
    m = compile_log.metrics(records)
    assert m["compile/programs"] == len(records.compiles)
    assert m["timing_s/compile"] >= sum(c.seconds for c in mine)
    assert m[f"compile_s/gen/{mine[0].name}"] == mine[0].seconds
    assert f"compile_s/other/{mine[1].name}" in m
    assert any("gen" in line and "int32[3,5]" in line for line in compile_log.summary(records))
    assert log.take().compiles == []  # taken


def test_first_step_reports_its_compiles():
    jax.clear_caches()  # so that this step compiles, whatever ran before in this process
    cfg = tiny_rl_config(algorithm="grpo")
    cfg.data.train_batch_size = 4
    cfg.rollout.n = 2
    cfg.actor.ppo_mini_batch_size = 4
    cfg.algo.adv_estimator = "grpo"
    cfg.algo.use_kl_in_reward = False
    cfg.trainer.total_steps = 1
    cfg.trainer.val_before_train = False
    cfg.trainer.test_freq = 0
    cfg.trainer.save_freq = 0
    logger = MetricsLogger()
    Trainer(cfg).fit(None, logger)
    (step,) = [r for r in logger.history if r["step"] == 1]
    stages = {k.split("/")[1] for k in step if k.startswith("compile_s/")}
    assert {"gen", "update_actor"} <= stages, sorted(step)
    assert step["compile/programs"] >= len(stages)
    assert step["timing_s/compile"] == pytest.approx(
        sum(v for k, v in step.items() if k.startswith("compile_s/")))


def test_cache_env_turns_auto_off(monkeypatch, tmp_path):
    from launch import compile_cache

    before = jax.config.jax_compilation_cache_dir
    try:
        monkeypatch.setenv(compile_cache.OFF_ENV, "off")
        assert compile_cache.enable("auto") is None
        assert not jax.config.jax_enable_compilation_cache
        # An explicit directory still wins over the environment.
        assert compile_cache.enable(str(tmp_path / "c")) == str(tmp_path / "c")
        monkeypatch.delenv(compile_cache.OFF_ENV)
        monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
        monkeypatch.setenv("HOME", str(tmp_path))
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
        assert compile_cache.default_dir() == str(tmp_path / ".cache" / "hfjax" / "xla")
    finally:
        compile_cache.enable(before)
