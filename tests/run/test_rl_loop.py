"""The RL loop end to end on 8 CPU devices: placements agree, edges between worker groups stay
on device, bad configs fail before compiling, GRPO runs, and micro-batching is exact.

Models are tiny (one layer, hidden 32) and batches small, so every step is dominated by
compilation; the three-placement run is shared by the tests that need a warm trainer.
"""

import contextlib

import chex
import jax
import numpy as np
import optax
import pytest
from support import host, tiny_rl_config

from hfjax.config import validate_config
from hfjax.controller.batch import Batch
from hfjax.rewards.registry import register_reward
from hfjax.run import metrics as metrics_lib
from hfjax.run.trainer import Trainer

# A dense test reward, so that one step from a randomly initialised model already has non-zero
# advantages, returns and gradients (the exact-answer rule scores such a model 0 everywhere).
SOURCE = "tests/rl_loop/digit_fraction"


@register_reward(SOURCE)
def digit_fraction(data_source, solution_str, ground_truth, extra_info):
    """The fraction of the response's characters that are digits."""
    return sum(ch.isdigit() for ch in solution_str) / max(len(solution_str), 1)


def tiny_config(placement="colocate", algorithm="ppo"):
    return tiny_rl_config(placement=placement, algorithm=algorithm)


def with_placement(cfg, mapping):
    cfg.placement = mapping
    return cfg


def make_trainer(cfg):
    trainer = Trainer(cfg)
    for row in trainer.train_data.rows:
        row["data_source"] = SOURCE
    return trainer


def numeric(metrics):
    return {k: v for k, v in metrics.items() if not k.startswith(("timing_s/", "perf/"))}


@contextlib.contextmanager
def no_host_transfers(monkeypatch):
    """Bans every host<->device copy, explicit or implicit, except inside named `allow` blocks."""
    if jax.default_backend() == "cpu":
        _emulate_fetch_guard_on_cpu(monkeypatch)
    with (
        jax.transfer_guard_host_to_device("disallow_explicit"),
        jax.transfer_guard_device_to_host("disallow_explicit"),
    ):
        yield


def _emulate_fetch_guard_on_cpu(monkeypatch):
    # On CPU a device buffer is read on the host as a zero-copy view, so jax's device-to-host
    # guard never fires there. Every fetch (np.asarray, float(), .item(), jax.device_get) reads
    # the array's `_value`, so guard that instead. It is private API: skip if it moves.
    from jax._src import array as jax_array
    from jax._src import config as jax_config

    fetch = getattr(jax_array.ArrayImpl, "_value", None)
    guard = getattr(jax_config, "transfer_guard_device_to_host", None)
    if not isinstance(fetch, property) or guard is None:
        pytest.skip("jax internals changed: cannot emulate the device-to-host guard on CPU")

    def guarded(self):
        if guard.value == "disallow_explicit":
            raise AssertionError(
                f"device-to-host fetch of {self.aval} outside a named transfer_guard('allow')"
            )
        return fetch.fget(self)

    monkeypatch.setattr(jax_array.ArrayImpl, "_value", property(guarded))


# ----------------------------------------------------------------------------------- placements

# The last is the command-line spelling of a mapping (--config.placement=...): split's pools.
MAPPING = "gen=4:actor+ref;score=4:critic+reward"
PLACEMENTS = {"colocate": [8, 8, 8, 8], "split": [4, 4, 4, 4], "standalone": [2, 2, 2, 2],
              MAPPING: [4, 4, 4, 4]}
ROLES = ("actor", "ref", "critic", "reward")


@pytest.fixture(scope="module")
def placement_runs():
    """One PPO step from the same seeds under each placement: trainer, metrics, params."""
    runs = {}
    before = None
    for placement in PLACEMENTS:
        trainer = make_trainer(tiny_config(placement))
        if before is None:
            before = host(trainer.actor.params)
        metrics = trainer.train_step()
        runs[placement] = dict(
            trainer=trainer,
            metrics=metrics,
            actor=host(trainer.actor.params),
            critic=host(trainer.workers.critic.params),
        )
    runs["actor_before"] = before
    return runs


@pytest.mark.slow
def test_placements_give_the_same_step(placement_runs):
    for placement, sizes in PLACEMENTS.items():
        pools = placement_runs[placement]["trainer"].pools
        assert [pools[r].size for r in ROLES] == sizes, placement
    standalone = placement_runs["standalone"]["trainer"].pools
    ids = [set(standalone[r].device_ids) for r in ROLES]
    assert set().union(*ids) == set(range(8))  # four disjoint pools of two

    base = placement_runs["colocate"]
    m = numeric(base["metrics"])
    # The step must have done something, or agreement would be vacuous.
    assert m["actor/grad_norm"] > 1e-2 and m["critic/grad_norm"] > 1e-2
    assert abs(m["actor/pg_loss"]) > 1e-5 and m["critic/vf_loss"] > 1e-3
    before = placement_runs["actor_before"]
    moved = max(np.abs(base["actor"][k] - v).max() for k, v in before.items())
    assert moved > 5e-5

    for placement in ("split", "standalone", MAPPING):
        run = placement_runs[placement]
        other = numeric(run["metrics"])
        assert other.keys() == m.keys()
        for k in m:
            assert other[k] == pytest.approx(m[k], abs=1e-5), (placement, k)
        for role in ("actor", "critic"):
            chex.assert_trees_all_close(run[role], base[role], rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["split", "standalone"])
def test_step_moves_nothing_through_the_host(placement_runs, placement, monkeypatch):
    """A whole warm PPO step with host copies banned: the prompt upload, the rule reward's
    response fetch, the mini-batch index vectors, the KL-coefficient scalar and the metrics fetch
    are the named exceptions; the edges between worker groups (actor -> ref and critic dispatch,
    ref log-probs and critic values back to the actor's mesh, mini-batches to the critic's
    mesh) must all go device to device."""
    trainer = placement_runs[placement]["trainer"]
    sharding = jax.sharding.NamedSharding(trainer.actor.mesh, jax.sharding.PartitionSpec())
    probe = jax.device_put(np.ones(2, np.float32), sharding)
    with no_host_transfers(monkeypatch):
        # Both guards are live: an upload and a fetch outside an `allow` block fail.
        with pytest.raises(jax.errors.JaxRuntimeError, match="Disallowed host-to-device"):
            jax.device_put(np.ones(2, np.float32), sharding)
        with pytest.raises((AssertionError, jax.errors.JaxRuntimeError), match="device-to-host"):
            np.asarray(probe)
        metrics = trainer.train_step()
    assert trainer.step == 2
    assert np.isfinite(list(numeric(metrics).values())).all()


# ------------------------------------------------------------------------------------ bad input


def _ppo_mapping(**changes):
    pools = {
        "gen": {"size": 4, "roles": ["actor", "ref"]},
        "score": {"size": 4, "roles": ["critic", "reward"]},
    }
    pools.update(changes)
    return {k: v for k, v in pools.items() if v is not None}


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: setattr(c.actor, "mesh", "fsdp=16"),
         r"mesh 'fsdp=16' needs 16 devices, pool 'actor' has 8"),
        (lambda c: (setattr(c, "placement", "split"), setattr(c.critic, "mesh", "fsdp=8")),
         r"mesh 'fsdp=8' needs 8 devices, pool 'critic' has 4"),
        (lambda c: setattr(c.ref, "mesh", "data=3,fsdp=-1"),
         r"mesh 'data=3,fsdp=-1': the fixed axes need a multiple of 3 devices, pool 'ref' has 8"),
        (lambda c: with_placement(c, _ppo_mapping(
            gen={"devices": [0, 1, 2, 3], "roles": ["actor", "ref"]},
            score={"devices": [3, 4, 5, 6], "roles": ["critic", "reward"]})),
         r"pools 'gen' and 'score' overlap on device 3; pools must be disjoint"),
        (lambda c: with_placement(c, _ppo_mapping(
            score={"size": 4, "roles": ["critic", "reward", "actor"]})),
         r"role 'actor' is on two pools, 'gen' and 'score'"),
        (lambda c: with_placement(c, _ppo_mapping(
            score={"size": 4, "roles": ["reward"]})),
         r"role 'critic' has no pool in placement .*; add it to a pool"),
        (lambda c: with_placement(c, _ppo_mapping(
            score={"size": 6, "roles": ["critic", "reward"]})),
         r"needs 10 devices, only 8 are available"),
        (lambda c: setattr(c.actor, "ppo_mini_batch_size", 6),
         r"actor: mini-batch of 6 sequences does not divide the batch of 16"),
        (lambda c: setattr(c.critic, "ppo_micro_batch_size", 4),
         r"critic: micro-batch of 4 sequences does not split over 8 data-parallel devices"),
        (lambda c: setattr(c, "algorithm", "ppo2"),
         r"algorithm='ppo2': unknown algorithm 'ppo2'; known: .*ppo"),
        (lambda c: setattr(c.algo, "adv_estimator", "gea"),
         r"algo.adv_estimator='gea': needs one of .*gae"),
        (lambda c: setattr(c.rollout.val_kwargs, "n", 0),
         r"rollout.val_kwargs.n=0: needs an int >= 1"),
        (lambda c: setattr(c.algo, "adv_estimator", "remax"),
         r"adv_estimator='remax' needs reward_baselines, which algorithm 'ppo' does not"),
        (lambda c: (setattr(c, "algorithm", "grpo"), setattr(c.algo, "adv_estimator", "gae")),
         r"adv_estimator='gae' needs values, which algorithm 'grpo' does not produce"),
        (lambda c: (setattr(c.model, "num_experts", 4),
                    setattr(c.model, "num_experts_per_tok", 5)),
         r"model: num_experts_per_tok=5 with num_experts=4: each token needs between 1 and 4"),
        (lambda c: (setattr(c.model, "num_experts", 8), setattr(c.actor, "mesh", "expert=3"),
                    setattr(c, "placement", "split")),
         r"actor.mesh='expert=3': expert=3 does not divide the model's 8 experts"),
    ],
    ids=["mesh-too-big", "mesh-too-big-split", "mesh-indivisible-ref", "device-overlap",
         "role-twice", "role-without-pool", "pools-too-big", "mini-batch", "micro-batch",
         "algorithm", "estimator", "val-samples", "estimator-input", "estimator-critic",
         "moe-top-k", "moe-expert-axis"],
)
def test_bad_config_fails_before_building(change, message):
    cfg = tiny_config()
    change(cfg)
    with pytest.raises(ValueError, match=message):
        validate_config(cfg)
    with pytest.raises(ValueError, match=message):
        Trainer(cfg)  # raised before any model is built or program compiled


# ----------------------------------------------------------------------------------------- GRPO


@pytest.mark.slow
def test_grpo_step_centres_advantages_per_group(monkeypatch):
    cfg = tiny_config(algorithm="grpo")
    cfg.data.train_batch_size = 4
    cfg.rollout.n = 4
    cfg.actor.ppo_mini_batch_size = 4  # prompts: 16 sequences, all in one update
    cfg.actor.ppo_micro_batch_size = 8
    cfg.actor.use_kl_loss = True
    cfg.algo.adv_estimator = "grpo"
    cfg.algo.use_kl_in_reward = False
    trainer = make_trainer(cfg)
    seen = []
    update = trainer.actor.update_actor
    monkeypatch.setattr(trainer.actor, "update_actor", lambda b: seen.append(b) or update(b))
    metrics = trainer.train_step()

    assert trainer.workers.critic is None and trainer.workers.ref is not None
    assert "actor/kl_loss" in metrics and not any(k.startswith("critic/vf") for k in metrics)
    assert np.isfinite(list(numeric(metrics).values())).all()
    got = seen[0].fetch(["prompts", "advantages", "response_mask", "token_level_scores",
                         "responses", "truncated"])
    # Truncated: responses that reached response_length without a stop token.
    length = got["response_mask"].sum(axis=1)
    limit, eos = cfg.rollout.response_length, trainer.actor.eos_ids
    cut = [int(length[i] >= limit and got["responses"][i, length[i] - 1] not in eos)
           for i in range(len(length))]
    np.testing.assert_array_equal(got["truncated"], cut)
    assert metrics["response_length/clip_ratio"] == pytest.approx(np.mean(cut))
    assert metrics["response_length/min"] == length.min()
    assert metrics["response_length/max"] == length.max()
    n, groups = 4, 4
    assert got["advantages"].shape[0] == n * groups
    mask = got["response_mask"] > 0
    scores = got["token_level_scores"].sum(axis=1)
    assert np.ptp(scores) > 0  # some group has something to normalise
    for g in range(groups):
        rows = range(g * n, (g + 1) * n)
        for i in rows:  # the n samples of a group answer the same prompt
            np.testing.assert_array_equal(got["prompts"][i], got["prompts"][g * n])
        group = [float(scores[i]) for i in rows]
        mean = sum(group) / n
        std = (sum((s - mean) ** 2 for s in group) / (n - 1)) ** 0.5
        per_row = []
        for i in rows:
            adv = got["advantages"][i]
            assert np.all(adv[~mask[i]] == 0)
            expected = (float(scores[i]) - mean) / (std + 1e-6)
            np.testing.assert_allclose(adv[mask[i]], expected, rtol=1e-4, atol=1e-5)
            per_row.append(adv[mask[i]][0] if mask[i].any() else expected)
        assert abs(sum(per_row) / n) < 1e-5


# ------------------------------------------------------------------------------ micro-batching


def _update_batch(trainer, n, rng):
    """A host batch of n sequences with ragged prompts and responses, scored by the actor."""
    cfg = trainer.cfg
    p, r = cfg.data.max_prompt_length, cfg.rollout.response_length
    vocab = trainer.model_cfg.vocab_size
    prompt_len = rng.integers(2, p + 1, n)
    resp_len = rng.integers(1, r + 1, n)
    prompts = np.full((n, p), trainer.tok.pad_id, np.int32)
    pmask = np.zeros((n, p), np.int32)
    resp = np.full((n, r), trainer.tok.pad_id, np.int32)
    rmask = np.zeros((n, r), np.int32)
    for i in range(n):
        prompts[i, p - prompt_len[i]:] = rng.integers(3, vocab, prompt_len[i])
        pmask[i, p - prompt_len[i]:] = 1
        resp[i, : resp_len[i]] = rng.integers(3, vocab, resp_len[i])
        rmask[i, : resp_len[i]] = 1
    batch = Batch({
        "input_ids": np.concatenate([prompts, resp], 1),
        "attention_mask": np.concatenate([pmask, rmask], 1),
        "responses": resp,
        "response_mask": rmask,
    })
    with jax.transfer_guard("allow"):
        lp = np.asarray(trainer.actor.compute_log_prob(batch)["old_log_probs"])
    # Near the policy, so the ratios straddle the clip range rather than all being clipped.
    old = (lp + 0.3 * rng.standard_normal(lp.shape)).astype(np.float32)
    ref = (lp + 0.3 * rng.standard_normal(lp.shape)).astype(np.float32)
    adv = rng.standard_normal((n, r)).astype(np.float32) * rmask
    return batch.union(Batch({"old_log_probs": old, "ref_log_prob": ref, "advantages": adv}))


@pytest.mark.slow
def test_micro_batching_does_not_change_the_update():
    """Token-mean over the mini-batch is exact whatever the micro-batch size: two mini-batches
    of 32 sequences, taken whole or as 4 micro-batches of 8, give the same update."""
    results = {}
    batch = None
    for micro in (32, 8):
        cfg = tiny_config()
        cfg.data.train_batch_size = 64
        cfg.actor.ppo_mini_batch_size = 32
        cfg.actor.ppo_micro_batch_size = micro
        cfg.actor.entropy_coeff = 0.01
        cfg.actor.use_kl_loss = True
        trainer = Trainer(cfg)
        if batch is None:
            batch = _update_batch(trainer, 64, np.random.default_rng(0))
            before = host(trainer.actor.params)
        # Plain SGD: the parameter change is the gradient itself, so any error in how micro-batch
        # losses are weighted shows up in full (Adam's first step is about lr * sign(grad)).
        trainer.actor.set_optimizer(optax.sgd(1.0))
        metrics = trainer.actor.update_actor(batch)
        with jax.transfer_guard("allow"):
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        results[micro] = metrics, host(trainer.actor.params)

    (m_whole, p_whole), (m_micro, p_micro) = results[32], results[8]
    assert m_whole.keys() == m_micro.keys()
    for k in m_whole:
        assert m_micro[k] == pytest.approx(m_whole[k], rel=1e-5, abs=1e-6), k
    assert m_whole["actor/pg_clipfrac"] > 0  # clipping is exercised
    moved = max(np.abs(p_whole[k] - v).max() for k, v in before.items())
    assert moved > 1e-3
    chex.assert_trees_all_close(p_micro, p_whole, rtol=0, atol=1e-5)


def test_trim_responses_keeps_a_power_of_two_width():
    from hfjax.engine.sampler import GenerateOutput
    from hfjax.workers.responses import trim as trim_responses

    def out(lengths, width):
        mask = (np.arange(width)[None, :] < np.asarray(lengths)[:, None]).astype(np.int32)
        tokens = np.where(mask > 0, 7, 0).astype(np.int32)
        return GenerateOutput(jax.numpy.asarray(tokens), jax.numpy.asarray(mask),
                              jax.numpy.asarray(mask * -0.5, dtype=np.float32))

    for lengths, width, keep in [([3, 20, 0], 64, 32), ([5, 1], 64, 16), ([64, 2], 64, 64),
                                 ([3], 10, 10), ([0, 0], 48, 16), ([17], 24, 24)]:
        full = out(lengths, width)
        cut = trim_responses(full)
        assert cut.tokens.shape == (len(lengths), keep), (lengths, width)
        for a, b in zip(cut[:3], full[:3]):  # only all-padding columns were dropped
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b)[:, :keep])
            assert not np.asarray(b)[:, keep:].any()


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_trimmed_padding_leaves_the_losses_unchanged(mode):
    from hfjax.numerics import losses
    from hfjax.numerics.losses import PolicyLossInputs

    rng = np.random.default_rng(3)
    b, full, keep = 6, 64, 16
    mask = (np.arange(full)[None, :] < rng.integers(1, keep + 1, b)[:, None]).astype(np.float32)
    old, new, adv, vals, ret = (rng.normal(size=(b, full)).astype(np.float32) for _ in range(5))
    for policy_loss in (losses.compute_policy_loss, losses.compute_policy_loss_gspo):
        a = policy_loss(PolicyLossInputs(old, new, adv, mask, loss_agg_mode=mode,
                                         loss_scale_factor=full))
        c = policy_loss(PolicyLossInputs(old[:, :keep], new[:, :keep], adv[:, :keep],
                                         mask[:, :keep], loss_agg_mode=mode,
                                         loss_scale_factor=full))
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-6, atol=1e-7)
    a = losses.compute_value_loss(new, ret, vals, mask, 0.2, mode, full)
    c = losses.compute_value_loss(new[:, :keep], ret[:, :keep], vals[:, :keep], mask[:, :keep],
                                  0.2, mode, full)
    np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-6, atol=1e-7)


def test_sampled_validation_reports_mean_and_best_at_n():
    cfg = tiny_config()
    cfg.rollout.response_length = 4
    cfg.rollout.val_kwargs.n, cfg.rollout.val_kwargs.temperature = 4, 1.0
    trainer = Trainer(cfg)
    first, again = trainer.validate(), trainer.validate()
    assert first == again  # fixed per-prompt seeds
    sources = {k[len("val-core/"):-len("/acc/mean@4")] for k in first
               if k.startswith("val-core/")}
    assert sources and all(
        0.0 <= first[f"val-core/{s}/acc/mean@4"] <= first[f"val-aux/{s}/acc/best@4"] <= 1.0
        for s in sources)
    assert metrics_lib.val_accuracy(first) == np.mean(
        [first[f"val-core/{s}/acc/mean@4"] for s in sources])
