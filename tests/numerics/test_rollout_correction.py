"""Rollout correction (`algo.rollout_correction`): every setting's weights, rejection mask and
metrics against a loop over tokens written here; every registered policy loss applying the
per-token weights; rejected tokens leaving the advantages and their whitening (GAE and GRPO,
against loops); bypass mode's rejection inside the policy loss against a loop; "auto" resolving
to token-level weights exactly in asynchronous runs; bad settings refused in one line; and a
training step that applies them (decoupled) or skips the old-policy pass (bypass)."""

import dataclasses
import math

import numpy as np
import pytest
from support import tiny_rl_config

from hfjax.config import validate_config
from hfjax.numerics import core
from hfjax.numerics import rollout_correction as rc
from hfjax.numerics.losses import PolicyLossInputs

BOUND = 20.0


def _batch(seed=0, b=5, t=9):
    """Old and rollout log-probs close to each other, a few far apart; a response mask with a
    gap (a tool result) and padding; one row empty."""
    rng = np.random.default_rng(seed)
    roll = -rng.uniform(0.05, 3.0, (b, t))
    old = roll + rng.normal(0.0, 0.4, (b, t))
    old[1, 2] = roll[1, 2] - 9.0  # a token the trainer finds ~8000x less likely
    mask = np.ones((b, t))
    mask[0, 6:] = 0
    mask[2, 3:5] = 0  # tool tokens inside the response
    mask[3, 4:] = 0
    mask[4] = 0  # batch padding
    return old.astype(np.float32), roll.astype(np.float32), mask.astype(np.float32)


def loop_correction(old, roll, mask, c):
    """The correction, token by token (float64)."""
    b, t = mask.shape
    weights, keep = np.zeros((b, t)), np.zeros((b, t))
    ratios, highs, vetoed_rows, rows = [], [], 0, 0
    kl, k3 = [], []
    rejected_tok, rejected_rows = 0, 0
    for i in range(b):
        toks = [j for j in range(t) if mask[i, j] > 0]
        if not toks:
            continue
        rows += 1
        raw = {j: float(old[i, j]) - float(roll[i, j]) for j in toks}
        seq_raw = sum(raw.values())
        seq = min(max(seq_raw, -BOUND), BOUND)
        geo = min(max(seq_raw / len(toks), -BOUND), BOUND)
        vetoed = bool(c.veto_threshold) and any(v < math.log(c.veto_threshold)
                                                for v in raw.values())
        vetoed_rows += vetoed
        any_rejected = False
        for j in toks:
            tok = min(max(raw[j], -BOUND), BOUND)
            ratio = math.exp(seq if c.rollout_is == "sequence" else tok)
            ratios.append(ratio)
            if c.rollout_is:
                weights[i, j] = min(ratio, c.is_threshold)
                highs.append(ratio > c.is_threshold)
            else:
                weights[i, j] = 1.0
                highs.append(False)
            ok = True
            if c.rollout_rs:
                x = {"token": tok, "sequence": seq, "geometric": geo}[c.rollout_rs]
                ok = math.log(c.rs_lower) <= x <= math.log(c.rs_upper)
            keep[i, j] = float(ok and not vetoed)
            rejected_tok += 1 - keep[i, j]
            any_rejected |= keep[i, j] == 0
            kl.append(-raw[j])
            k3.append(math.exp(tok) - tok - 1)
        rejected_rows += any_rejected
    n = len(ratios)
    w = [weights[i, j] for i in range(b) for j in range(t) if mask[i, j] > 0]
    metrics = {
        "rollout_is_mean": sum(ratios) / n,
        "rollout_is_max": max(ratios),
        "rollout_is_ratio_fraction_high": sum(highs) / n,
        "rollout_is_eff_sample_size": (sum(w) / n) ** 2 / (sum(x * x for x in w) / n),
        "rollout_rs_masked_fraction": rejected_tok / n,
        "rollout_rs_seq_masked_fraction": rejected_rows / rows,
        "rollout_is_veto_fraction": vetoed_rows / rows,
        "kl": sum(kl) / n,
        "k3_kl": sum(k3) / n,
    }
    return weights, keep, metrics


SETTINGS = {
    # (rollout_is, threshold, rollout_rs, rs upper, rs lower, veto); 0 thresholds: defaults
    "token-is": ("token", 1.5, "", 0.0, 0.0, 0.0),
    "sequence-is": ("sequence", 2.0, "", 0.0, 0.0, 0.0),
    "token-rs": ("", 2.0, "token", 1.2, 0.0, 0.0),
    "sequence-rs": ("", 2.0, "sequence", 0.0, 0.0, 0.0),
    "geometric-rs": ("token", 2.0, "geometric", 1.05, 0.97, 0.0),
    "veto": ("", 2.0, "", 0.0, 0.0, 1e-3),
    "sequence-is-token-rs-veto": ("sequence", 3.0, "token", 0.0, 0.0, 1e-3),
}


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_each_setting_against_a_loop(name):
    c = rc.resolve(*SETTINGS[name])
    old, roll, mask = _batch()
    w, keep, metrics = rc.correct(old, roll, mask, c)
    want_w, want_keep, want_m = loop_correction(old, roll, mask, c)
    np.testing.assert_allclose(np.asarray(w), want_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(keep), want_keep)
    for k, v in want_m.items():
        assert float(metrics[f"rollout_corr/{k}"]) == pytest.approx(v, rel=1e-4, abs=1e-6), k
    assert c.active


def test_defaults_and_the_cases_that_bite():
    c = rc.resolve("", 2.5, "token", 0.0, 0.0, 0.0)
    assert (c.rs_upper, c.rs_lower) == (2.5, 0.4)  # verl's nulls: the IS threshold, 1 / it
    assert not rc.resolve("", 2.0, "", 0.0, 0.0, 0.0).active
    old, roll, mask = _batch()
    # The far-off token: a token-level rejection and the veto both remove it (the veto its
    # whole row); truncation leaves its tiny weight alone (only the upper side is cut).
    _, keep, _ = rc.correct(old, roll, mask, rc.resolve("", 2.0, "token", 0.0, 0.0, 0.0))
    assert keep[1, 2] == 0 and keep[1, 3] == 1
    _, keep, _ = rc.correct(old, roll, mask, rc.resolve("", 2.0, "", 0.0, 0.0, 1e-3))
    assert np.asarray(keep)[1].sum() == 0 and np.asarray(keep)[0].sum() == 6
    w, _, _ = rc.correct(old, roll, mask, rc.resolve("token", 2.0, "", 0.0, 0.0, 0.0))
    assert 0 < w[1, 2] < 1e-3
    # Nothing outside the response: tool tokens and padding weigh 0 and are never kept.
    assert np.all(np.asarray(w)[mask == 0] == 0) and np.all(np.asarray(keep)[mask == 0] == 0)
    with pytest.raises(ValueError, match=r"rejection interval \[3, 2\] is empty"):
        rc.resolve("", 2.0, "token", 2.0, 3.0, 0.0)


# ------------------------------------------------------------------- every loss applies weights


def _agg(loss, mask, mode, horizon):
    """verl's aggregations, by loops."""
    b, t = mask.shape
    if mode == "token-mean":
        n = sum(mask[i, j] for i in range(b) for j in range(t))
        return sum(loss[i, j] * mask[i, j] for i in range(b) for j in range(t)) / n
    rows = [i for i in range(b) if mask[i].sum() > 0]
    if mode == "seq-mean-token-sum-norm":
        return sum(loss[i, j] * mask[i, j] for i in range(b) for j in range(t)) / horizon
    per = []
    for i in rows:
        s = sum(loss[i, j] * mask[i, j] for j in range(t))
        per.append(s / mask[i].sum() if mode == "seq-mean-token-mean" else s)
    return sum(per) / len(per)


def _vanilla(x):
    old, lp, adv, m = (np.asarray(a, np.float64) for a in (x.old_log_prob, x.log_prob,
                                                           x.advantages, x.response_mask))
    out = np.zeros(m.shape)
    for i in range(m.shape[0]):
        for j in range(m.shape[1]):
            r = math.exp(lp[i, j] - old[i, j])
            a = adv[i, j]
            loss = max(-a * r, -a * min(max(r, 1 - x.clip_low), 1 + x.clip_high))
            if a < 0:
                loss = min(loss, -a * x.clip_ratio_c)
            out[i, j] = loss
    return out


def _gspo(x):
    old, lp, adv, m = (np.asarray(a, np.float64) for a in (x.old_log_prob, x.log_prob,
                                                           x.advantages, x.response_mask))
    out = np.zeros(m.shape)
    for i in range(m.shape[0]):
        n = max(m[i].sum(), 1.0)
        s = math.exp(min(sum((lp[i, j] - old[i, j]) * m[i, j] for j in range(m.shape[1])) / n,
                         10.0))
        for j in range(m.shape[1]):
            a = adv[i, j]
            out[i, j] = max(-a * s, -a * min(max(s, 1 - x.clip_low), 1 + x.clip_high))
    return out


PER_TOKEN = {"vanilla": _vanilla, "gspo": _gspo}


def test_every_registered_policy_loss_has_a_reference_here():
    # A new loss must show here that it applies the weights.
    assert set(core.POLICY_LOSSES.names()) <= set(PER_TOKEN)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                  "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("name", sorted(core.POLICY_LOSSES.names()))
def test_every_policy_loss_applies_the_weights(name, mode):
    rng = np.random.default_rng(3)
    old, roll, mask = _batch()
    lp = old + rng.normal(0.0, 0.3, old.shape).astype(np.float32)
    adv = rng.normal(0.0, 1.0, old.shape).astype(np.float32)
    weights, keep, _ = rc.correct(old, roll, mask,
                                  rc.resolve("token", 1.5, "token", 0.0, 0.0, 0.0))
    loss_mask = np.asarray(mask * keep, np.float32)  # rejected tokens leave the mask
    x = PolicyLossInputs(old, lp, adv, loss_mask, cliprange=0.2, clip_ratio_c=3.0,
                         loss_agg_mode=mode, loss_scale_factor=9.0,
                         rollout_is_weights=np.asarray(weights))
    got = float(core.POLICY_LOSSES.get(name)(x)[0])
    per_token = PER_TOKEN[name](x) * np.asarray(weights, np.float64)
    want = _agg(per_token, loss_mask, mode, 9.0)
    assert got == pytest.approx(want, rel=1e-4, abs=1e-6)
    # Without weights the loss differs: the weights did something.
    plain = float(core.POLICY_LOSSES.get(name)(dataclasses.replace(x, rollout_is_weights=None))[0])
    assert abs(plain - got) > 1e-4


# --------------------------------------------------------------------------------- bad settings


BAD = {
    "level": ({"rollout_is": "tokens"},
              r"rollout_is='tokens': needs one of token, sequence, auto, or none \(off\)"),
    "rs-level": ({"rollout_rs": "seq"},
                 r"rollout_rs='seq': needs one of token, sequence, geometric, or none"),
    "rs-auto": ({"rollout_rs": "auto"},
                r"rollout_rs='auto': needs one of token, sequence, geometric, or none"),
    "threshold": ({"rollout_is_threshold": 0.0}, r"rollout_is_threshold=0.0: needs a float > 0"),
    "veto": ({"rollout_token_veto_threshold": 2.0}, r"veto_threshold=2.0: needs a float in"),
    "bypass-with-is": ({"bypass_mode": True, "rollout_is": "token"},
                       r"bypass_mode=True with rollout_is='token': the clipped ratio is taken "
                       r"against the sampler's log-probs, so it already is the importance "
                       r"ratio .* set rollout_is=none \(rejection, rollout_rs, still works\)"),
    "bypass-with-sequence-is": ({"bypass_mode": True, "rollout_is": "sequence",
                                 "rollout_rs": "token"},
                                r"bypass_mode=True with rollout_is='sequence'"),
    "empty-interval": ({"rollout_rs": "token", "rollout_rs_threshold": 1.5,
                        "rollout_rs_threshold_lower": 2.0},
                       r"the rejection interval \[2, 1.5\] is empty"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_settings_are_refused_in_one_line(name):
    keys, message = BAD[name]
    cfg = tiny_rl_config()
    for k, v in keys.items():
        cfg.algo.rollout_correction[k] = v
    with pytest.raises(ValueError, match=message) as e:
        validate_config(cfg)
    assert "\n" not in str(e.value)


def test_bypass_with_rejection_and_auto_are_accepted():
    for keys in ({"bypass_mode": True, "rollout_rs": "token"},  # verl's bypass + rejection
                 {"bypass_mode": True, "rollout_token_veto_threshold": 1e-3},
                 {"bypass_mode": True},  # "auto" is off in bypass mode
                 {"rollout_is": "none", "rollout_rs": "none"}):
        cfg = tiny_rl_config()
        for k, v in keys.items():
            cfg.algo.rollout_correction[k] = v
        validate_config(cfg)


# ------------------------------------------------------------------- the default: "auto"


@pytest.mark.parametrize("rollout_is,k,bypass,want", [
    ("auto", 0, False, ""), ("auto", 1, False, "token"), ("auto", 4, False, "token"),
    ("auto", 1, True, ""), ("none", 2, False, ""), ("", 2, False, ""),
    ("sequence", 0, False, "sequence"), ("token", 3, False, "token")])
def test_auto_is_token_level_exactly_when_asynchronous(rollout_is, k, bypass, want):
    from hfjax.algorithms.spec import StepSpec

    assert rc.level_in_force(rollout_is, k, bypass) == want
    cfg = tiny_rl_config()
    assert cfg.algo.rollout_correction.rollout_is == "auto"  # the shipped default
    r = cfg.algo.rollout_correction
    r.rollout_is, r.bypass_mode = rollout_is, bypass
    cfg.async_rollout.max_staleness = k
    spec = StepSpec.of(cfg).algo.rollout_correction
    assert spec.rollout_is == want and spec.resolved.rollout_is == want
    line = rc.describe(spec.resolved, bypass)
    if want:
        assert line.startswith(f"{want}-level truncated importance weights pi_old / pi_rollout "
                               "(threshold 2)")
    else:
        assert line == ("none" if not bypass else
                        "bypass mode (the sampler's log-probs are pi_old; PPO clips against them)")


# ------------------------------------------- rejected tokens leave the advantages (decoupled)


def loop_gae(rewards, values, keep, gamma, lam):
    """GAE row by row, over the kept tokens only (a rejected token is skipped as a tool token
    is: no TD-error of its own, the next kept token's value and advantage pass through it),
    then whitened over the kept tokens with the unbiased variance."""
    b, t = keep.shape
    adv, ret = np.zeros((b, t)), np.zeros((b, t))
    for i in range(b):
        next_v, last = 0.0, 0.0
        for j in reversed(range(t)):
            if keep[i, j]:
                last = rewards[i, j] + gamma * next_v - values[i, j] + gamma * lam * last
                next_v = values[i, j]
                adv[i, j] = last
                ret[i, j] = last + values[i, j]
    kept = [adv[i, j] for i in range(b) for j in range(t) if keep[i, j]]
    mean = sum(kept) / len(kept)
    var = sum((a - mean) ** 2 for a in kept) / (len(kept) - 1)
    for i in range(b):
        for j in range(t):
            adv[i, j] = (adv[i, j] - mean) / math.sqrt(var + 1e-8) if keep[i, j] else 0.0
    return adv, ret


def loop_grpo(scores, keep, n):
    """GRPO's advantage by groups of n rows: (score - mean) / (std + 1e-6), on kept tokens."""
    b, t = keep.shape
    adv = np.zeros((b, t))
    for g in range(0, b, n):
        group = [float(scores[i].sum()) for i in range(g, g + n)]
        mean = sum(group) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (n - 1))
        for i in range(g, g + n):
            for j in range(t):
                adv[i, j] = (group[i - g] - mean) / (std + 1e-6) if keep[i, j] else 0.0
    return adv


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_rejected_tokens_leave_the_advantages_and_their_whitening(estimator):
    import jax.numpy as jnp

    from hfjax.algorithms import dataflow
    from hfjax.algorithms.spec import StepSpec
    from hfjax.controller.batch import Batch

    old, roll, mask = _batch(seed=5, b=6, t=9)
    mask[4] = 1.0  # six live rows (three groups of two)
    rng = np.random.default_rng(7)
    scores = np.zeros_like(old)
    for i in range(6):  # an outcome score on each row's last token, and a step reward
        last = int(np.nonzero(mask[i])[0][-1])
        scores[i, last] = rng.normal()
        scores[i, 1] += 0.5 * rng.normal()
    values = rng.normal(0.0, 1.0, old.shape).astype(np.float32)
    cfg = tiny_rl_config()
    cfg.algo.adv_estimator, cfg.rollout.n = estimator, 2
    cfg.algo.use_kl_in_reward = False
    cfg.algo.gamma, cfg.algo.lam = 0.9, 0.8
    r = cfg.algo.rollout_correction
    r.rollout_is, r.rollout_rs, r.rollout_rs_threshold = "token", "token", 1.5
    spec = StepSpec.of(cfg)
    c = spec.algo.rollout_correction.resolved
    arrays = {"response_mask": mask, "token_level_scores": scores, "old_log_probs": old,
              "rollout_log_probs": roll}
    if estimator == "gae":
        arrays["values"] = values
    out, metrics = dataflow.compute_advantage(
        Batch({k: jnp.asarray(v) for k, v in arrays.items()}), spec, 0.0)
    _, keep, want_m = loop_correction(old, roll, mask, c)
    assert 0 < keep.sum() < mask.sum()  # some tokens rejected, some kept
    if estimator == "gae":
        want, want_ret = loop_gae(scores * keep, values * keep, keep, 0.9, 0.8)
        np.testing.assert_allclose(np.asarray(out["returns"]), want_ret, rtol=1e-4, atol=1e-5)
    else:
        want = loop_grpo(scores, keep, 2)
    np.testing.assert_allclose(np.asarray(out["advantages"]), want, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out["rollout_rs_mask"]), keep)
    assert float(metrics["rollout_corr/rollout_rs_masked_fraction"]) == pytest.approx(
        want_m["rollout_rs_masked_fraction"], rel=1e-5)


# ------------------------------------------------------ bypass mode: rejection in the loss


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_bypass_rejection_in_the_policy_loss_against_a_loop(level, mode):
    """The policy loss as the actor aggregates it in bypass mode (`bypass_keep`, the kept
    tokens' share of the batch normaliser), against a loop: the ratio judged is
    pi_theta / pi_rollout, rejected tokens add nothing, the denominator is the batch's."""
    from hfjax.engine.update import share_of_normaliser

    rng = np.random.default_rng(11)
    _, roll, mask = _batch(seed=2)
    lp = (roll + rng.normal(0.0, 0.5, roll.shape)).astype(np.float32)  # pi_theta drifted
    adv = rng.normal(0.0, 1.0, roll.shape).astype(np.float32)
    upper = {"token": 1.5, "sequence": 4.0, "geometric": 1.2}[level]
    c = rc.resolve("", 2.0, level, upper, 0.0, 0.0)
    keep = np.asarray(rc.bypass_keep(lp, roll, mask, c))
    totals = {"tokens": float(mask.sum()), "seqs": float((mask.sum(-1) > 0).sum())}
    x = PolicyLossInputs(roll, lp, adv, keep.astype(np.float32), cliprange=0.2, clip_ratio_c=3.0,
                         loss_agg_mode=mode, loss_scale_factor=9.0)
    got = float(core.POLICY_LOSSES.get("vanilla")(x)[0]) * float(
        share_of_normaliser(keep, totals, mode))
    # The loop: which tokens a ratio pi_theta / pi_rollout keeps, and the aggregation.
    _, want_keep, _ = loop_correction(lp, roll, mask, c)
    np.testing.assert_array_equal(keep, want_keep)
    assert 0 < want_keep.sum() < mask.sum()
    per = _vanilla(x)
    if mode == "token-mean":
        want = sum(per[i, j] for i in range(5) for j in range(9) if want_keep[i, j]) / mask.sum()
    else:
        rows = [i for i in range(5) if want_keep[i].sum() > 0]
        want = sum(sum(per[i, j] for j in range(9) if want_keep[i, j]) / want_keep[i].sum()
                   for i in rows) / totals["seqs"]
    assert got == pytest.approx(want, rel=1e-4, abs=1e-6)


# ------------------------------------------------------------------------------ in a real step


@pytest.mark.slow
def test_a_grpo_step_applies_the_correction_and_bypass_skips_the_old_pass():
    from hfjax.run.trainer import Trainer

    cfg = tiny_rl_config(algorithm="grpo")
    cfg.algo.adv_estimator = "grpo"
    cfg.rollout.n, cfg.data.train_batch_size = 4, 4
    cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_micro_batch_size = 4, 16
    # Top-k sampling: the sampler's distribution is renormalised over 3 tokens, so
    # pi_rollout >= pi_old token by token and the weights are not all 1 (for this untrained,
    # near-uniform policy they lie near 0.22, and the lower bound splits them).
    cfg.rollout.top_k = 3
    r = cfg.algo.rollout_correction
    r.rollout_is, r.rollout_is_threshold, r.rollout_rs = "token", 2.0, "token"
    r.rollout_rs_threshold_lower = 0.22
    trainer = Trainer(cfg)
    actor = trainer.actor
    seen, scored, trained = [], [], []
    update, score, train = actor.update_actor, actor.compute_log_prob, actor.train
    actor.update_actor = lambda b: seen.append(b) or update(b)
    actor.compute_log_prob = lambda b: scored.append(b) or score(b)
    actor.train = lambda fn, b, keys, **kw: trained.append((b, keys)) or train(fn, b, keys, **kw)
    # One mini-batch, one epoch: on-policy, yet the correction needs pi_old, so it is scored.
    assert actor.single_update(16)
    m = trainer.train_step()
    assert len(scored) == 1
    got = {k: np.asarray(v, np.float64) for k, v in seen[0].fetch(
        ["old_log_probs", "rollout_log_probs", "response_mask", "rollout_is_weights",
         "rollout_rs_mask"]).items()}
    c = trainer.spec.algo.rollout_correction.resolved
    want_w, want_keep, want_m = loop_correction(got["old_log_probs"], got["rollout_log_probs"],
                                                got["response_mask"], c)
    np.testing.assert_allclose(got["rollout_is_weights"], want_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got["rollout_rs_mask"], want_keep)
    for k in ("rollout_is_mean", "kl", "rollout_rs_masked_fraction"):
        assert m[f"rollout_corr/{k}"] == pytest.approx(want_m[k], rel=1e-4, abs=1e-6), k
    assert m["rollout_corr/rollout_is_mean"] < 1.0 and m["rollout_corr/kl"] > 0
    assert 0 < m["rollout_corr/rollout_rs_masked_fraction"] < 1
    # The update trains on the kept tokens only, with the weights in its loss's inputs.
    b, keys = trained[0]
    np.testing.assert_array_equal(np.asarray(b["response_mask"]),
                                  got["response_mask"] * want_keep)
    assert "rollout_is_weights" in keys

    # Bypass: the sampler's log-probs are the old ones; no scoring pass, no correction.
    algo = trainer.spec.algo
    bypass = dataclasses.replace(algo.rollout_correction, rollout_is="", rollout_rs="",
                                 bypass_mode=True)
    trainer.spec = dataclasses.replace(trainer.spec, algo=dataclasses.replace(
        algo, rollout_correction=bypass))
    seen.clear(), scored.clear(), trained.clear()
    m = trainer.train_step()
    assert not scored and not any(k.startswith("rollout_corr/") for k in m)
    got = seen[0].fetch(["old_log_probs", "rollout_log_probs"])
    np.testing.assert_array_equal(got["old_log_probs"], got["rollout_log_probs"])
    assert "rollout_is_weights" not in seen[0] and np.isfinite(m["actor/pg_loss"])


@pytest.mark.slow
def test_ppo_steps_reject_from_the_critic_and_bypass_rejects_in_the_loss(caplog):
    """PPO with a critic, decoupled: the critic trains on the kept tokens only; an
    asynchronous-looking run's first lines name the correction; bypass mode with rejection:
    no scoring pass, and the actor's policy loss drops the tokens whose pi_theta / pi_rollout
    leaves the interval."""
    import logging

    from hfjax.run.trainer import Trainer

    cfg = tiny_rl_config()
    cfg.rollout.top_k = 3  # pi_rollout renormalised over 3 tokens: ratios near 0.22 (above)
    r = cfg.algo.rollout_correction
    r.rollout_is, r.rollout_rs, r.rollout_rs_threshold_lower = "none", "token", 0.22
    with caplog.at_level(logging.INFO):
        trainer = Trainer(cfg)
    assert any("rollout correction: token-level rejection outside [0.22, 2] of the ratio"
               in rec.getMessage() for rec in caplog.records)
    seen = []
    train = trainer.workers.critic.train
    trainer.workers.critic.train = lambda fn, b, keys, **kw: seen.append(b) or train(
        fn, b, keys, **kw)
    actor_seen = []
    update = trainer.actor.update_actor
    trainer.actor.update_actor = lambda b: actor_seen.append(b) or update(b)
    m = trainer.train_step()
    got = {k: np.asarray(v) for k, v in actor_seen[0].fetch(
        ["response_mask", "rollout_rs_mask"]).items()}
    assert 0 < got["rollout_rs_mask"].sum() < got["response_mask"].sum()
    np.testing.assert_array_equal(np.asarray(seen[0]["response_mask"]),
                                  got["response_mask"] * got["rollout_rs_mask"])
    assert 0 < m["rollout_corr/rollout_rs_masked_fraction"] < 1

    cfg = tiny_rl_config()
    cfg.rollout.top_k = 3
    r = cfg.algo.rollout_correction
    r.bypass_mode, r.rollout_rs, r.rollout_rs_threshold_lower = True, "token", 0.22
    trainer = Trainer(cfg)
    actor = trainer.actor
    assert actor.bypass_rejection is not None
    scored, trained = [], []
    score, train = actor.compute_log_prob, actor.train
    actor.compute_log_prob = lambda b: scored.append(b) or score(b)
    actor.train = lambda fn, b, keys, **kw: trained.append((b, keys)) or train(fn, b, keys, **kw)
    m = trainer.train_step()
    assert not scored  # bypass: no old-policy pass
    frac = m["rollout_corr/rollout_rs_masked_fraction"]
    assert 0 < frac < 1
    b, keys = trained[0]
    mb = {k: b[k] for k in keys}
    mask = np.asarray(mb["response_mask"], np.float64)
    totals = {"tokens": mask.sum(), "seqs": float((mask.sum(-1) > 0).sum())}
    loss, metrics = actor._policy_loss(actor.params, mb, totals)
    lp = np.asarray(actor.compute_log_prob(b)["old_log_probs"], np.float64)
    _, keep, _ = loop_correction(lp, np.asarray(mb["old_log_probs"], np.float64), mask,
                                 actor.bypass_rejection)
    # The same tokens rejected as a loop over pi_theta / pi_rollout finds (up to one token at
    # the interval's edge, where the two programs' log-probs may round apart).
    assert float(metrics["rollout_corr/rollout_rs_masked_fraction"]) == pytest.approx(
        1 - keep.sum() / mask.sum(), abs=1.01 / mask.sum())
    actor.bypass_rejection = None
    plain, _ = actor._policy_loss(actor.params, mb, totals)
    assert abs(float(plain) - float(loss)) > 1e-6
