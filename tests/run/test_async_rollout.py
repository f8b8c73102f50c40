"""Asynchronous rollout (hfjax.run.async_loop): refused where it cannot run, the version
schedule against a loop that enumerates it, the rollout pool's devices, and end to end on 8
CPU devices: the synchronous loop on two pools (through the rollout thread and the
double-buffered push) and K = 1 on a staleness-0 schedule equal today's split run, K = 1
bounds every token's staleness, pushes the parameters' bytes, reruns identically and rewinds
the data cursor over batches issued ahead."""

import threading

import jax
import numpy as np
import pytest
from support import tiny_rl_config

from hfjax.config import check_config
from hfjax.controller.async_pools import resolve_pools
from hfjax.run import async_loop
from hfjax.run.async_loop import AsyncRollout, version_of
from hfjax.run.checkpoint import RunCheckpointer
from hfjax.run.trainer import Trainer
from hfjax.settings.values import ConfigError
from hfjax.workers.rollout import param_bytes

POOLS = "gen=4:rollout;train=4:actor+ref+reward"


def grpo_config(placement="split", k=0, steps=3):
    c = tiny_rl_config(algorithm="grpo", placement=placement)
    c.algo.adv_estimator = "grpo"
    c.rollout.n = 2
    c.async_rollout.max_staleness = k
    c.trainer.total_steps = steps
    return c


@pytest.mark.parametrize("placement,k,every,needle", [
    ("colocate", 1, 1, "needs a rollout pool disjoint"),
    ("standalone", 2, 1, "needs a rollout pool disjoint"),
    ("gen=4:actor+rollout;train=4:ref+reward", 1, 1, "needs a rollout pool disjoint"),
    ("gen=4:rollout+ref;train=4:actor+reward", 1, 1, "holds the rollout alone"),
    ("split", -1, 1, "async_rollout.max_staleness=-1"),
    ("split", 1, 3, "push_every <= 2"),
])
def test_impossible_settings_are_refused_before_anything_runs(placement, k, every, needle):
    c = grpo_config(placement, k)
    c.async_rollout.push_every = every
    with pytest.raises(ConfigError, match=needle) as err:
        check_config(c)
    assert "\n" not in str(err.value) and "--config." in str(err.value)


def test_version_schedule_is_the_oldest_pushed_version_within_the_bound():
    for k in range(4):
        for every in range(1, k + 2):
            for start in (0, 3):
                for step in range(start, start + 12):
                    pushed = [v for v in range(start, step + 1) if v == start or v % every == 0]
                    want = min(v for v in pushed if v >= step - k)
                    got = version_of(step, k, every, start)
                    assert got == want, (k, every, start, step)
                    assert 0 <= step - got <= k


def test_rollout_pool_is_disjoint_from_the_trainers():
    devices = jax.devices()
    roles = ("actor", "ref", "reward")
    split = resolve_pools("split", roles, devices, 1)
    assert len(split["rollout"].devices) == 4
    assert not set(split["rollout"].devices) & set(split["actor"].devices)
    assert split["ref"] is split["actor"] or split["ref"].devices == split["actor"].devices
    mapped = resolve_pools("train=6:actor+ref+reward;gen=2:rollout", roles, devices, 0)
    assert len(mapped["rollout"].devices) == 2 and len(mapped["actor"].devices) == 6
    assert "rollout" not in resolve_pools("split", roles, devices, 0)  # K = 0: today's split


def _numeric(m):
    return {k: v for k, v in m.items()
            if not k.startswith(("timing_s/", "perf/", "compile/", "async/push_s"))}


def _run(cfg):
    trainer = Trainer(cfg)
    metrics = [trainer.train_step() for _ in range(cfg.trainer.total_steps)]
    return trainer, metrics


@pytest.mark.slow
def test_synchronous_loop_on_two_pools_equals_todays_split_run(monkeypatch):
    """K = 0 on two pools runs the machinery of K >= 1 with no overlap: the rollout thread
    generates each batch with the version pushed (double-buffered) after the previous update
    and swapped in at its job, the trainer cuts its padding columns and tags its tokens. So
    does K = 1 on a schedule that admits only the newest version (`version_of` replaced: each
    step's prompts are issued a step ahead, their batch made once the previous update's push
    lands). Both equal today's split run, every metric of three GRPO steps within 1e-6."""
    made = []  # (step, version, thread) of each batch the rollout group generates
    generate = AsyncRollout._generate

    def recording(self, job):
        made.append((job.step, job.version, threading.current_thread().name))
        return generate(self, job)

    monkeypatch.setattr(AsyncRollout, "_generate", recording)
    _, today = _run(grpo_config("split", 0))
    assert not made  # today's split: no rollout group
    trainer, two_pools = _run(grpo_config(POOLS, 0))
    trainer._async.close()
    assert made == [(s, s, "hfjax-rollout") for s in range(3)]
    assert two_pools[0]["async/push_bytes"] == param_bytes(trainer.actor.params)
    made.clear()
    monkeypatch.setattr(async_loop, "version_of", lambda step, *_args: step)
    trainer, newest = _run(grpo_config(POOLS, 1))
    trainer._async.close()  # step 3's batch, issued ahead, may or may not have been made
    assert made[:3] == [(s, s, "hfjax-rollout") for s in range(3)]
    for a, b, c in zip(today, two_pools, newest, strict=True):
        for key, value in _numeric(a).items():
            assert b[key] == pytest.approx(value, abs=1e-6), key
            assert c[key] == pytest.approx(value, abs=1e-6), key
        assert b["async/staleness/max"] == c["async/staleness/max"] == 0.0
        assert b["timing_s/idle/train"] >= 0 and b["timing_s/idle/rollout"] >= 0


@pytest.mark.slow
def test_staleness_one_is_bounded_reproducible_and_loses_no_prompt():
    cfg = grpo_config("split", 1, steps=3)
    trainer, first = _run(cfg)
    # Issued ahead: step 3's prompts are drawn, but the checkpoint's cursor is before them.
    sync_cursor = trainer.train_iter.state()["cursor"] - cfg.data.train_batch_size
    assert trainer.state_dict()["data"]["cursor"] == sync_cursor
    trainer._async.close()
    for step, m in enumerate(first):
        # Step 0 reads the initial weights (version 0); every later step's tokens are one
        # update old: exactly the bound.
        assert m["async/staleness/max"] == m["async/staleness/mean"] == min(step, 1)
        assert m["async/push_bytes"] == param_bytes(trainer.actor.params)
        assert m["timing_s/idle/train"] >= 0 and m["timing_s/idle/rollout"] >= 0
    again, second = _run(cfg)
    again._async.close()
    for a, b in zip(first, second, strict=True):
        assert _numeric(a) == _numeric(b)


@pytest.mark.slow
def test_a_resumed_run_trains_every_prompt_once_in_data_order(tmp_path, monkeypatch):
    """K = 1 with a checkpoint after every step: a run of 2 steps ends with the prompts of its
    third already issued to the rollout pool; a new trainer resumes from the checkpoint and
    trains to step 4. The prompts consumed at each step are the data order's, none skipped, none
    twice: the checkpoint's cursor goes back over the batch issued ahead."""
    consumed = {}
    take = AsyncRollout.take

    def recording(self, step):
        prompts, made = take(self, step)
        consumed.setdefault(step, []).append(np.asarray(prompts["prompts"]).copy())
        return prompts, made

    monkeypatch.setattr(AsyncRollout, "take", recording)
    cfg = grpo_config("split", 1, steps=2)
    cfg.trainer.save_freq, cfg.trainer.test_freq, cfg.trainer.val_before_train = 1, 0, False
    ckpt = RunCheckpointer(str(tmp_path / "ckpt"), async_save=False)
    assert Trainer(cfg).fit(ckpt).step == 2
    cfg.trainer.total_steps = 4
    result = Trainer(cfg).fit(RunCheckpointer(str(tmp_path / "ckpt"), async_save=False))
    assert result.resumed_from == 2 and result.step == 4
    # The data order: a fresh trainer's prompts of steps 0..3, drawn in turn.
    fresh = Trainer(cfg)
    for step in range(4):
        want = np.asarray(fresh._prompts(next(fresh.train_iter), step=step)["prompts"])
        assert len(consumed[step]) == 1, f"step {step} trained {len(consumed[step])} times"
        np.testing.assert_array_equal(consumed[step][0], want)


def test_cut_responses_drops_the_columns_every_row_pads():
    """A generated batch of 40 response columns whose longest response is 17 tokens keeps 32
    (the power-of-two bucket), prompt columns whole, its rows' meta as it is; one whose
    longest is 40 keeps all."""
    from hfjax.controller.batch import Batch
    from hfjax.run.async_loop import cut_responses

    rng = np.random.default_rng(0)
    rows, p, r = 4, 6, 40
    lengths = np.array([3, 17, 0, 9])
    rmask = (np.arange(r)[None] < lengths[:, None]).astype(np.int32)
    arrays = {"prompts": rng.integers(1, 9, (rows, p)), "prompt_mask": np.ones((rows, p)),
              "responses": rng.integers(1, 9, (rows, r)) * rmask, "response_mask": rmask,
              "rollout_log_probs": rng.normal(size=(rows, r)).astype(np.float32),
              "truncated": np.zeros(rows, np.int32)}
    arrays["input_ids"] = np.concatenate([arrays["prompts"], arrays["responses"]], 1)
    arrays["attention_mask"] = np.concatenate([arrays["prompt_mask"], rmask], 1)
    meta = {"data_source": ["arith"] * rows, "ground_truth": ["1", "2", "3", "4"]}
    batch = Batch({k: jax.numpy.asarray(v) for k, v in arrays.items()}, meta)
    out = cut_responses(batch)
    assert {k: list(v) for k, v in out.meta.items()} == meta
    for k, v in arrays.items():
        cols = {"responses": 32, "response_mask": 32, "rollout_log_probs": 32,
                "input_ids": p + 32, "attention_mask": p + 32}.get(k)
        want = v if cols is None else v[:, :cols]
        np.testing.assert_array_equal(np.asarray(out[k]), want, err_msg=k)
    arrays["response_mask"][0] = 1  # a response as long as the columns: nothing to cut
    full = cut_responses(batch.select([k for k in arrays if k != "response_mask"]).union(
        Batch({"response_mask": jax.numpy.asarray(arrays["response_mask"])})))
    assert full["responses"].shape == (rows, r)
