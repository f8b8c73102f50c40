"""Non-finite numbers never reach the parameters, a checkpoint or a strict JSON reader: the update
step refuses them on the device, the run stops (or skips, per `trainer.nonfinite`) naming the
stage and the step, and a collapsed policy is flagged."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from support import tiny_rl_config

from hfjax.engine.update import make_update_step
from hfjax.rewards.registry import register_reward
from hfjax.run import health
from hfjax.run import metrics as metrics_lib
from hfjax.run.checkpoint import RunCheckpointer
from hfjax.run.health import NonFiniteError
from hfjax.run.metrics import JsonlSink, MetricsLogger
from hfjax.run.trainer import Trainer


def _strict_records(path) -> list[dict]:
    """The file's lines read by a strict JSON parser (NaN and Infinity are not JSON)."""
    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")

    return [json.loads(line, parse_constant=refuse) for line in open(path) if line.strip()]


def _loss(params, mb, totals):
    del totals
    pred = mb["x"] @ params["w"]
    return jnp.mean((pred - mb["y"]) ** 2), {}


def _step(optimizer):
    return make_update_step(_loss, optimizer, n_micro=2)


def test_update_step_refuses_non_finite_loss_gradient_and_parameters():
    params = {"w": jnp.ones((3,), jnp.float32)}
    x = jnp.arange(12, dtype=jnp.float32).reshape(4, 3) / 10
    y = jnp.ones((4,), jnp.float32)
    opt = optax.adam(1e-2)
    step = _step(opt)
    state = opt.init(params)

    copy = lambda tree: jax.tree.map(jnp.copy, tree)  # noqa: E731  (the step donates)
    # A finite batch updates.
    p1, s1, m = step(copy(params), state, {"x": x, "y": y})
    assert float(m["nonfinite"]) == 0.0 and not np.allclose(p1["w"], 1.0)

    # A NaN in the batch makes the loss and gradient NaN: nothing changes, the count says so.
    p2, s2, m = step(copy(p1), copy(s1),
                     {"x": x.at[0, 0].set(jnp.nan), "y": y})
    assert float(m["nonfinite"]) == 1.0 and math.isnan(float(m["grad_norm"]))
    np.testing.assert_array_equal(p2["w"], p1["w"])
    for a, b in zip(jax.tree.leaves(s2), jax.tree.leaves(s1)):  # Adam's count and moments too
        np.testing.assert_array_equal(a, b)

    # A finite gradient whose update overflows the parameters: applied (taking it back would
    # cost a copy of the state), and flagged so that the run ends.
    sgd = optax.sgd(1e38)
    p3, _, m = _step(sgd)(copy(params), sgd.init(params), {"x": x * 100, "y": y})
    assert float(m["nonfinite"]) == 0.0 and math.isfinite(float(m["grad_norm"]))
    assert float(m["nonfinite_params"]) == 1.0 and not np.isfinite(np.asarray(p3["w"])).all()


SOURCE = "tests/nonfinite/digit_fraction"


@register_reward(SOURCE)
def digit_fraction(data_source, solution_str, ground_truth, extra_info):
    """Scores that vary between responses, so that the policy gets a gradient."""
    return sum(ch.isdigit() for ch in solution_str) / max(len(solution_str), 1)


def _blow_up_config(tmp_path, mode):
    c = tiny_rl_config(out_dir=tmp_path)
    # The first mini-batch's update is finite and enormous; the next one's gradient is NaN.
    c.actor.lr = 1e30
    c.trainer.total_steps = 4
    c.trainer.test_freq = 0
    c.trainer.val_before_train = False
    c.trainer.save_freq = 1
    c.trainer.async_save = False
    c.trainer.logger = "jsonl"
    c.trainer.nonfinite = mode
    return c


def _checkpoints_are_finite(trainer, ckpt):
    for step in ckpt.steps():
        restored = ckpt.restore(step, trainer.checkpoint_items())
        for item, tree in restored.items.items():
            for leaf in jax.tree.leaves(tree):
                if jnp.issubdtype(leaf.dtype, jnp.inexact):
                    assert bool(jnp.all(jnp.isfinite(leaf))), (step, item)


@pytest.mark.slow
def test_a_learning_rate_that_blows_up_stops_then_skips(tmp_path):
    c = _blow_up_config(tmp_path, "stop")
    trainer = Trainer(c)
    for row in trainer.train_data.rows:
        row["data_source"] = SOURCE
    ckpt = RunCheckpointer(str(tmp_path / "checkpoints"), max_to_keep=None, async_save=False)
    jsonl = tmp_path / metrics_lib.JSONL_NAME

    # stop: the run ends at the first step whose update went non-finite, naming it.
    with pytest.raises(NonFiniteError) as err:
        trainer.fit(ckpt, MetricsLogger([JsonlSink(str(jsonl))]))
    text = str(err.value)
    bad_step = int(text.split("at RL step ")[1].split(" ")[0])
    assert 1 <= bad_step < c.trainer.total_steps
    assert "update_" in text and "the update was not applied" in text
    assert "Lower " in text and "trainer.nonfinite=skip" in text and "\n" not in text
    assert max(ckpt.steps()) == bad_step - 1  # the refused step was never saved
    records = _strict_records(jsonl)
    assert records[-1]["step"] == bad_step
    assert records[-1]["actor/nonfinite_updates"] + records[-1]["critic/nonfinite_updates"] >= 1
    # Non-finite values are strings in the file and floats again through read_jsonl.
    assert any(v in ("NaN", "Infinity", "-Infinity") for v in records[-1].values())
    assert any(isinstance(v, float) and not math.isfinite(v)
               for v in metrics_lib.read_jsonl(str(jsonl))[-1].values())
    _checkpoints_are_finite(trainer, ckpt)

    # skip: rerun (it resumes from the last good checkpoint) and go on to the end, counting.
    c.trainer.nonfinite = "skip"
    result = trainer.fit(ckpt, MetricsLogger([JsonlSink(str(jsonl))]))
    assert result.step == c.trainer.total_steps and result.resumed_from == bad_step - 1
    records = _strict_records(jsonl)
    assert [r["step"] for r in records] == list(range(1, c.trainer.total_steps + 1))
    skipped = [r["actor/nonfinite_updates"] + r["critic/nonfinite_updates"] for r in records]
    assert sum(skipped[bad_step - 1:]) >= c.trainer.total_steps - bad_step + 1
    _checkpoints_are_finite(trainer, ckpt)
    ckpt.close()


def test_the_warm_start_stops_at_its_first_non_finite_step(tmp_path):
    c = tiny_rl_config(out_dir=tmp_path)
    c.sft.steps, c.sft.batch_size, c.sft.micro_batch_size, c.sft.lr = 4, 16, 8, 1e30
    trainer = Trainer(c)
    with pytest.raises(NonFiniteError, match=r"the warm start \(sft\) at warm-start step 2 "
                                             r"\(sft/loss=.*, sft/grad_norm=nan\).*Lower "
                                             r"sft.lr \(now 1e\+30\)"):
        trainer.warm_start()
    c.trainer.nonfinite = "skip"
    out = Trainer(c).warm_start()  # a fresh model: the same first step, then three refused
    assert out["sft/nonfinite_updates"] == 3.0


def test_near_uniform_policy_is_flagged():
    vocab = 100
    assert health.near_uniform({health.ENTROPY_KEY: 0.95 * math.log(vocab)}, vocab)
    assert not health.near_uniform({health.ENTROPY_KEY: 0.5 * math.log(vocab)}, vocab)
    assert not health.near_uniform({health.ENTROPY_KEY: float("nan")}, vocab)
    assert not health.near_uniform({}, vocab)


def test_check_nonfinite_stops_or_counts():
    c = tiny_rl_config()
    m = {"actor/nonfinite_updates": 2.0, "actor/pg_loss": float("inf"), "actor/grad_norm": 3.0}
    with pytest.raises(NonFiniteError, match=r"update_actor at RL step 5 \(actor/pg_loss=inf, "
                                             r"actor/grad_norm=3\)"):
        health.check_nonfinite(m, "RL step 5", c)
    c.trainer.nonfinite = "skip"
    assert health.check_nonfinite(m, "RL step 5", c) == 2
    assert health.check_nonfinite({"actor/nonfinite_updates": 0.0}, "RL step 5", c) == 0
    assert not health.must_stop(m, c)
    # Parameters an applied update made non-finite end the run even under skip.
    broke = {"critic/nonfinite_params": 1.0, "critic/grad_norm": 2.5}
    assert health.must_stop(broke, c)
    with pytest.raises(NonFiniteError, match=r"update in update_critic at RL step 3 made "
                                             r"parameters non-finite .*critic/grad_norm=2.5.*"
                                             r"whatever trainer.nonfinite says"):
        health.check_nonfinite(broke, "RL step 3", c)
