"""hfjax.numerics against independent loop-based NumPy references (float64, references.py)."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from references import (
    ref_agg,
    ref_gae,
    ref_grpo,
    ref_kl,
    ref_masked_mean,
    ref_masked_var_unbiased,
    ref_ppo,
    ref_ppo_token,
    ref_reinforce_pp,
    ref_reinforce_pp_baseline,
    ref_remax,
    ref_rloo,
    ref_whiten,
)

from hfjax.numerics import advantages, core, losses
from hfjax.numerics.advantages import AdvantageInputs
from hfjax.numerics.losses import PolicyLossInputs

ATOL = 1e-6
RTOL = 1e-6


def close(actual, expected, atol=ATOL):
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, atol=atol, rtol=RTOL)


def make_mask(rng, b, t, min_len=1):
    """Right-padded response mask with random lengths in [min_len, t]."""
    lengths = rng.integers(min_len, t + 1, size=b)
    mask = np.zeros((b, t))
    for i in range(b):
        mask[i, : lengths[i]] = 1.0
    return mask


def f32(x):
    return jnp.asarray(np.asarray(x, np.float32))


# ---------------------------------------------------------------------------------------------
# Masked statistics and logits
# ---------------------------------------------------------------------------------------------


def test_masked_stats_match_reference():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 7))
    mask = make_mask(rng, 4, 7, min_len=2)
    close(core.masked_sum(f32(x), f32(mask)), (x * mask).sum())
    close(core.masked_mean(f32(x), f32(mask)), ref_masked_mean(x, mask))
    close(
        core.masked_mean(f32(x), f32(mask), axis=-1),
        [ref_masked_mean(x[i], mask[i]) for i in range(4)],
    )
    close(core.masked_var(f32(x), f32(mask)), ref_masked_var_unbiased(x, mask))
    n = mask.sum()
    close(
        core.masked_var(f32(x), f32(mask), unbiased=False),
        ref_masked_var_unbiased(x, mask) * (n - 1) / n,
    )
    w = np.asarray(core.masked_whiten(f32(x), f32(mask)))
    close(w * mask, ref_whiten(x, mask) * mask)
    w_keep = core.masked_whiten(f32(x), f32(mask), shift_mean=False)
    close(np.asarray(w_keep) * mask, (ref_whiten(x, mask) + ref_masked_mean(x, mask)) * mask)
    # A bool mask is the same as its float version; an empty row gives 0, not nan.
    close(core.masked_mean(f32(x), jnp.asarray(mask > 0)), ref_masked_mean(x, mask))
    empty = mask.copy()
    empty[1] = 0
    close(core.masked_mean(f32(x), f32(empty), axis=-1)[1], 0.0)


def test_entropy_and_logprobs_match_reference():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(3, 5, 11)) * 3
    labels = rng.integers(0, 11, size=(3, 5))
    ent = np.zeros((3, 5))
    lps = np.zeros((3, 5))
    for i in range(3):
        for j in range(5):
            z = logits[i, j]
            zmax = max(z)
            lse = zmax + math.log(sum(math.exp(v - zmax) for v in z))
            ent[i, j] = -sum(math.exp(v - lse) * (v - lse) for v in z)
            lps[i, j] = z[labels[i, j]] - lse
    close(core.entropy_from_logits(f32(logits)), ent, atol=2e-6)
    close(core.logprobs_from_logits(f32(logits), jnp.asarray(labels)), lps, atol=2e-6)

    # Huge and -inf logits stay finite: uniform over the 3 finite entries.
    big = jnp.asarray([[1e4, 1e4, 1e4, -jnp.inf]], jnp.float32)
    close(core.entropy_from_logits(big), [math.log(3)])
    close(core.logprobs_from_logits(big, jnp.asarray([0])), [-math.log(3)])


def test_logprobs_and_entropy_gradients_match_the_softmax_forms():
    """One exponential for both (core.logprobs_and_entropy): the gradients of each half, the
    entropy's when an entropy bonus differentiates it, equal those of the textbook forms."""
    rng = np.random.default_rng(2)
    logits = f32(rng.normal(size=(4, 7, 13)) * 4)
    labels = jnp.asarray(rng.integers(0, 13, size=(4, 7)))
    w_lp, w_ent = f32(rng.normal(size=(4, 7))), f32(rng.normal(size=(4, 7)))

    def ours(x):
        lp, ent = core.logprobs_and_entropy(x, labels)
        return jnp.sum(lp * w_lp) + jnp.sum(ent * w_ent)

    def textbook(x):
        logp = jax.nn.log_softmax(x, axis=-1)
        lp = jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
        ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
        return jnp.sum(lp * w_lp) + jnp.sum(ent * w_ent)

    close(ours(logits), textbook(logits), atol=1e-4)
    close(jax.grad(ours)(logits), jax.grad(textbook)(logits), atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Advantage estimators
# ---------------------------------------------------------------------------------------------


def test_gae_with_padding_and_interior_masked_tokens():
    rng = np.random.default_rng(2)
    b, t = 5, 9
    rewards = rng.normal(size=(b, t))
    values = rng.normal(size=(b, t))
    mask = make_mask(rng, b, t, min_len=3)
    mask[0, 1] = 0.0  # an interior masked span (e.g. a tool observation)
    mask[2, 0:2] = 0.0
    adv, ret = core.ADV_ESTIMATORS.get("gae")(AdvantageInputs(
        token_level_rewards=f32(rewards),
        values=f32(values),
        response_mask=f32(mask),
        gamma=0.95,
        lam=0.9,
    ))
    ref_adv, ref_ret = ref_gae(rewards, values, mask, 0.95, 0.9)
    close(ret, ref_ret)
    close(adv, ref_adv)
    assert advantages.compute_gae_advantage_return is core.ADV_ESTIMATORS.get("gae")


def test_gae_requires_values():
    with pytest.raises(ValueError, match="'gae' needs values"):
        core.ADV_ESTIMATORS.get("gae")(
            AdvantageInputs(token_level_rewards=jnp.zeros((2, 3)), response_mask=None)
        )


def outcome_rewards(rng, mask):
    """Scores placed on each sequence's last response token."""
    rewards = np.zeros(mask.shape)
    for i in range(mask.shape[0]):
        rewards[i, int(mask[i].sum()) - 1] = rng.normal()
    return rewards


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_groups_including_a_group_of_one(norm_by_std):
    rng = np.random.default_rng(3)
    index = np.array([0, 0, 0, 1, 2, 2, 3, 3, 3, 3])  # group 1 has a single member
    mask = make_mask(rng, len(index), 6)
    rewards = outcome_rewards(rng, mask)
    adv, ret = core.ADV_ESTIMATORS.get("grpo")(AdvantageInputs(
        token_level_rewards=f32(rewards),
        response_mask=f32(mask),
        index=jnp.asarray(index),
        norm_adv_by_std_in_grpo=norm_by_std,
        epsilon=1e-6,
    ))
    expected = ref_grpo(rewards, mask, index, norm_by_std, 1e-6)
    close(adv, expected)
    close(ret, expected)
    # The group of one keeps its score (mean 0, std 1).
    close(np.asarray(adv)[3] * mask[3], rewards[3].sum() / (1 + 1e-6 * norm_by_std) * mask[3])


def test_grpo_with_explicit_num_groups_and_unordered_ids():
    rng = np.random.default_rng(4)
    index = np.array([2, 0, 2, 1, 0, 2])
    mask = make_mask(rng, 6, 4)
    rewards = rng.normal(size=(6, 4)) * mask
    adv, _ = advantages.compute_grpo_outcome_advantage(AdvantageInputs(
        token_level_rewards=f32(rewards), response_mask=f32(mask), index=index, num_groups=3
    ))
    close(adv, ref_grpo(rewards, mask, index, True, 1e-6))


def test_rloo_leave_one_out():
    rng = np.random.default_rng(5)
    index = np.array([0, 1, 1, 0, 2, 0, 1, 1])  # group 2 is a single sample
    mask = make_mask(rng, len(index), 5)
    rewards = outcome_rewards(rng, mask)
    adv, ret = core.ADV_ESTIMATORS.get("rloo")(AdvantageInputs(
        token_level_rewards=f32(rewards), response_mask=f32(mask), index=jnp.asarray(index)
    ))
    close(adv, ref_rloo(rewards, mask, index))
    close(ret, adv)


def test_reinforce_plus_plus_discounted_and_whitened():
    rng = np.random.default_rng(6)
    b, t = 4, 8
    mask = make_mask(rng, b, t, min_len=2)
    # Rewards beyond the mask must not leak back into the response.
    rewards = rng.normal(size=(b, t))
    adv, ret = core.ADV_ESTIMATORS.get("reinforce_plus_plus")(AdvantageInputs(
        token_level_rewards=f32(rewards), response_mask=f32(mask), gamma=0.9
    ))
    ref_adv, ref_ret = ref_reinforce_pp(rewards, mask, 0.9)
    close(ret, ref_ret)
    close(adv, ref_adv)


def test_reinforce_plus_plus_baseline():
    rng = np.random.default_rng(7)
    index = np.array([0, 0, 1, 1, 1, 2])
    mask = make_mask(rng, 6, 5)
    rewards = outcome_rewards(rng, mask)
    adv, ret = core.ADV_ESTIMATORS.get("reinforce_plus_plus_baseline")(AdvantageInputs(
        token_level_rewards=f32(rewards), response_mask=f32(mask), index=jnp.asarray(index)
    ))
    close(adv, ref_reinforce_pp_baseline(rewards, mask, index))
    close(ret, adv)


def test_remax_subtracts_baseline():
    rng = np.random.default_rng(8)
    mask = make_mask(rng, 4, 6)
    rewards = rng.normal(size=(4, 6))
    baselines = rng.normal(size=4)
    adv, ret = core.ADV_ESTIMATORS.get("remax")(AdvantageInputs(
        token_level_rewards=f32(rewards), response_mask=f32(mask), reward_baselines=f32(baselines)
    ))
    ref_adv, ref_ret = ref_remax(rewards, mask, baselines)
    close(ret, ref_ret)
    close(adv, ref_adv)


def edge_case_batch():
    """Outcome rewards for 11 samples of 4 prompts with every edge case at once: group 0 holds
    a zero-length response, group 1 is a group of one, group 2's rewards are all equal, and
    group 3 holds a fully masked (padding) row. Empty rows score 0, as the reward stage gives
    them (`scores_at_last_token`)."""
    index = np.array([0, 0, 0, 1, 2, 2, 2, 3, 3, 3, 3])
    lengths = [4, 0, 2, 3, 5, 1, 3, 2, 6, 0, 4]
    scores = [0.7, 0.0, -1.2, 0.4, 1.0, 1.0, 1.0, -0.3, 2.5, 0.0, 0.9]
    mask = np.zeros((len(index), 6))
    rewards = np.zeros((len(index), 6))
    for i, (n, sc) in enumerate(zip(lengths, scores)):
        mask[i, :n] = 1.0
        if n:
            rewards[i, n - 1] = sc
    return index, mask, rewards


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo", "reinforce_plus_plus",
                                  "reinforce_plus_plus_baseline", "remax"])
def test_estimators_on_edge_cases_match_references(name):
    """Each algorithm's estimator on groups of one, all-equal rewards, a fully masked row and a
    zero-length response, against its loop-based reference; empty rows get 0 everywhere."""
    index, mask, rewards = edge_case_batch()
    kw = dict(token_level_rewards=f32(rewards), response_mask=f32(mask))
    if name in ("grpo", "drgrpo"):
        norm = name == "grpo"
        adv, _ = core.ADV_ESTIMATORS.get("grpo")(AdvantageInputs(
            index=jnp.asarray(index), norm_adv_by_std_in_grpo=norm, epsilon=1e-6, **kw))
        want = ref_grpo(rewards, mask, index, norm, 1e-6)
        # The all-equal group has nothing to learn from.
        close(np.asarray(adv)[4:7], np.zeros((3, 6)))
    elif name == "rloo":
        adv, _ = core.ADV_ESTIMATORS.get(name)(AdvantageInputs(index=jnp.asarray(index), **kw))
        want = ref_rloo(rewards, mask, index)
        close(np.asarray(adv)[4:7], np.zeros((3, 6)))
    elif name == "reinforce_plus_plus":
        adv, _ = core.ADV_ESTIMATORS.get(name)(AdvantageInputs(gamma=1.0, **kw))
        want = ref_reinforce_pp(rewards, mask, 1.0)[0]
    elif name == "reinforce_plus_plus_baseline":
        adv, _ = core.ADV_ESTIMATORS.get(name)(AdvantageInputs(index=jnp.asarray(index), **kw))
        want = ref_reinforce_pp_baseline(rewards, mask, index)
    else:
        baselines = np.array([0.5, 0.5, 0.5, 0.4, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
        adv, _ = core.ADV_ESTIMATORS.get(name)(AdvantageInputs(
            reward_baselines=f32(baselines), **kw))
        want = ref_remax(rewards, mask, baselines)[0]
    close(adv, want)
    assert np.all(np.asarray(adv)[[1, 9]] == 0) and np.all(np.isfinite(np.asarray(adv)))


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_group_estimators_require_index(name):
    with pytest.raises(ValueError, match=f"'{name}' needs index"):
        core.ADV_ESTIMATORS.get(name)(AdvantageInputs(
            token_level_rewards=jnp.zeros((2, 3)), response_mask=jnp.ones((2, 3))
        ))


# ---------------------------------------------------------------------------------------------
# Aggregation, policy loss, value loss
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_agg_loss_modes(mode):
    rng = np.random.default_rng(9)
    loss = rng.normal(size=(5, 6))
    mask = make_mask(rng, 5, 6)
    mask[3] = 0.0  # a fully padded row is left out of sequence means
    close(core.agg_loss(f32(loss), f32(mask), mode), ref_agg(loss, mask, mode))
    if mode == "seq-mean-token-sum-norm":
        close(core.agg_loss(f32(loss), f32(mask), mode, 4.0), ref_agg(loss, mask, mode, 4.0))


def ppo_case():
    """Tokens chosen so every branch of dual-clip PPO is taken (cliprange 0.2 / 0.28, c = 3)."""
    ratios = np.array(
        [
            [1.05, 1.5, 0.5, 0.9, 1.1],  # A > 0: inside; above 1+high (clipped); below 1-low
            [0.95, 0.5, 2.0, 5.0, 1.1],  # A < 0: inside; below 1-low (clipped); between; > c
            [1.0, 1.0, 4.0, 0.3, 1.0],  # row with padding; masked extreme ratios
        ]
    )
    adv = np.array(
        [
            [1.0, 0.8, 1.2, 0.5, -0.3],
            [-1.0, -0.7, -1.3, -0.6, 0.4],
            [0.2, -0.2, -2.0, 1.0, 0.0],
        ]
    )
    mask = np.ones_like(adv)
    mask[2, 2:] = 0.0
    rng = np.random.default_rng(10)
    old_lp = -rng.uniform(0.1, 3.0, size=adv.shape)
    return old_lp, old_lp + np.log(ratios), adv, mask


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_ppo_clip_and_dual_clip(mode):
    old_lp, lp, adv, mask = ppo_case()
    out = core.POLICY_LOSSES.get("vanilla")(PolicyLossInputs(
        f32(old_lp),
        f32(lp),
        f32(adv),
        f32(mask),
        cliprange=0.2,
        cliprange_low=0.2,
        cliprange_high=0.28,
        clip_ratio_c=3.0,
        loss_agg_mode=mode,
    ))
    expected = ref_ppo(old_lp, lp, adv, mask, 0.2, 0.28, 3.0, mode)
    for got, want in zip(out, expected):
        close(got, want)
    if mode == "token-mean":
        # Clipped: ratio 1.5 with A > 0 and ratio 0.5 with A < 0; dual-clip: only ratio 5.0.
        # The masked ratios 4.0 and 0.3 in row 2 must not count.
        close(out[1], 2 / mask.sum())
        close(out[3], 1 / mask.sum())


def test_ppo_cliprange_defaults_to_symmetric():
    old_lp, lp, adv, mask = ppo_case()
    x = PolicyLossInputs(f32(old_lp), f32(lp), f32(adv), f32(mask), cliprange=0.1)
    out = losses.compute_policy_loss(x)
    expected = ref_ppo(old_lp, lp, adv, mask, 0.1, 0.1, 3.0, "token-mean")
    for got, want in zip(out, expected):
        close(got, want)
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1.0"):
        losses.compute_policy_loss(dataclasses.replace(x, clip_ratio_c=1.0))


def test_gspo_sequence_ratio_and_gradient():
    rng = np.random.default_rng(11)
    b, t = 3, 5
    mask = make_mask(rng, b, t, min_len=2)
    old_lp = -rng.uniform(0.1, 2.0, size=(b, t))
    lp = old_lp + rng.normal(scale=0.3, size=(b, t))
    adv = np.repeat(rng.normal(size=(b, 1)), t, axis=1)
    loss_mat = np.zeros((b, t))
    clip = np.zeros((b, t))
    for i in range(b):
        n = mask[i].sum()
        s_ratio = math.exp(sum((lp[i, j] - old_lp[i, j]) * mask[i, j] for j in range(t)) / n)
        for j in range(t):
            loss_mat[i, j], clip[i, j], _ = ref_ppo_token(adv[i, j], s_ratio, 0.2, 0.2, 1e9)
    seq_mean = "seq-mean-token-mean"  # what GSPO recipes use
    pg_loss, clipfrac, ppo_kl, lower = core.POLICY_LOSSES.get("gspo")(PolicyLossInputs(
        f32(old_lp), f32(lp), f32(adv), f32(mask), cliprange=0.2, loss_agg_mode=seq_mean
    ))
    close(pg_loss, ref_agg(loss_mat, mask, "seq-mean-token-mean"))
    close(clipfrac, ref_masked_mean(clip, mask))
    close(ppo_kl, ref_masked_mean(old_lp - lp, mask))
    assert float(lower) == 0.0

    # Straight-through: d loss / d log_prob[i, j] = -A_i * s_i / (n_i * B) on unclipped tokens.
    grad = jax.grad(
        lambda x: losses.compute_policy_loss_gspo(
            PolicyLossInputs(f32(old_lp), x, f32(adv), f32(mask), 10.0, loss_agg_mode=seq_mean)
        )[0]
    )(f32(lp))
    want = np.zeros((b, t))
    for i in range(b):
        n = mask[i].sum()
        s_ratio = math.exp(sum((lp[i, j] - old_lp[i, j]) * mask[i, j] for j in range(t)) / n)
        for j in range(t):
            want[i, j] = -adv[i, j] * s_ratio * mask[i, j] / (n * b)
    close(grad, want)


def test_value_loss_clipped():
    rng = np.random.default_rng(12)
    b, t = 4, 6
    mask = make_mask(rng, b, t)
    values = rng.normal(size=(b, t))
    vpreds = values + rng.normal(scale=0.5, size=(b, t))
    returns = rng.normal(size=(b, t))
    c = 0.2
    want_loss = np.zeros((b, t))
    clipped = np.zeros((b, t))
    for i in range(b):
        for j in range(t):
            vc = min(max(vpreds[i, j], values[i, j] - c), values[i, j] + c)
            e1 = (vpreds[i, j] - returns[i, j]) ** 2
            e2 = (vc - returns[i, j]) ** 2
            want_loss[i, j] = max(e1, e2)
            clipped[i, j] = e2 > e1
    for mode in ["token-mean", "seq-mean-token-sum"]:
        vf_loss, vf_clipfrac = losses.compute_value_loss(
            f32(vpreds), f32(returns), f32(values), f32(mask), c, mode
        )
        close(vf_loss, 0.5 * ref_agg(want_loss, mask, mode), atol=4e-6)
        close(vf_clipfrac, ref_masked_mean(clipped, mask))
    assert 0 < float(vf_clipfrac) < 1


# ---------------------------------------------------------------------------------------------
# KL penalties and controllers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"])
def test_kl_penalties(name):
    rng = np.random.default_rng(13)
    lp = -rng.uniform(0.05, 3.0, size=(3, 7))
    ref = -rng.uniform(0.05, 3.0, size=(3, 7))
    ref[0, 0] = lp[0, 0] + 15.0  # k3 would be ~3.3e6 here: must be clamped to 10
    got = losses.kl_penalty(f32(lp), f32(ref), name)
    expected = ref_kl(lp, ref, name)
    close(np.asarray(got)[:, 1:], expected[:, 1:], atol=2e-6)
    close(np.asarray(got)[1:], expected[1:], atol=2e-6)
    if name in ("low_var_kl", "k3"):
        assert float(got[0, 0]) == 10.0


def test_kl_straight_through_gradient():
    lp = jnp.asarray([-1.0, -2.0, -0.5])
    ref = jnp.asarray([-1.5, -1.0, -0.5])
    val = losses.kl_penalty(lp, ref, "k3+")
    close(val, ref_kl(np.asarray(lp, np.float64), np.asarray(ref, np.float64), "k3"))
    grad = jax.grad(lambda x: jnp.sum(losses.kl_penalty(x, ref, "k3+")))(lp)
    close(grad, np.asarray(lp - ref, np.float64))  # gradient of 0.5 * (lp - ref)^2


def test_apply_kl_penalty():
    rng = np.random.default_rng(14)
    b, t = 4, 5
    mask = make_mask(rng, b, t)
    scores = outcome_rewards(rng, mask)
    old_lp = -rng.uniform(0.1, 2.0, size=(b, t))
    ref_lp = -rng.uniform(0.1, 2.0, size=(b, t))
    rewards, kl = losses.apply_kl_penalty(
        f32(scores), f32(old_lp), f32(ref_lp), f32(mask), kl_coef=0.05, kl_penalty="k3"
    )
    kld = ref_kl(old_lp, ref_lp, "k3") * mask
    close(rewards, scores - 0.05 * kld)
    close(kl, np.mean([ref_masked_mean(kld[i], mask[i]) for i in range(b)]))


def test_adaptive_kl_controller_sequence():
    ctrl = losses.get_kl_controller("adaptive", kl_coef=0.2, target_kl=0.1, horizon=1000)
    value = 0.2
    for kl in [0.5, 0.12, 0.1, 0.05, 0.0, 0.2]:
        error = kl / 0.1 - 1
        error = 0.2 if error > 0.2 else (-0.2 if error < -0.2 else error)
        value = value * (1 + error * 64 / 1000)
        ctrl = ctrl.update(jnp.float32(kl), n_steps=64)
        assert math.isclose(ctrl.value, value, rel_tol=1e-6)
    assert isinstance(ctrl, losses.AdaptiveKLController)
    fixed = losses.get_kl_controller("fixed", kl_coef=0.3)
    assert fixed.update(5.0, 64).value == 0.3
    with pytest.raises(ValueError, match="unknown kl_ctrl type 'pid'; known: adaptive, fixed"):
        losses.get_kl_controller("pid")


# ---------------------------------------------------------------------------------------------
# Registries and jit
# ---------------------------------------------------------------------------------------------


def test_kl_controller_state_round_trips():
    for ctrl in (losses.get_kl_controller("adaptive", kl_coef=0.2, target_kl=0.1, horizon=50),
                 losses.get_kl_controller("fixed", kl_coef=0.3)):
        moved = ctrl.update(0.5, 10)
        state = losses.kl_controller_state(moved)
        assert json.loads(json.dumps(state)) == state  # plain JSON for the checkpoint
        assert losses.kl_controller_from_state(state) == moved
    with pytest.raises(ValueError, match="unknown kl_ctrl type 'pid' in saved state"):
        losses.kl_controller_from_state({"type": "pid", "value": 1.0})
    with pytest.raises(ValueError, match="needs horizon > 0"):
        losses.get_kl_controller("adaptive", horizon=0)


def test_estimators_declare_the_batch_arrays_they_need():
    needs = {name: core.ADV_ESTIMATORS.info(name).get("needs", ())
             for name in core.ADV_ESTIMATORS.names()}
    assert needs["gae"] == ("values",) and needs["remax"] == ("reward_baselines",)
    assert needs["grpo"] == needs["rloo"] == ()


def test_registry_unknown_names_list_known():
    with pytest.raises(ValueError, match=r"unknown adv_estimator 'foo'; known: distill, gae, grpo"):
        core.ADV_ESTIMATORS.get("foo")
    with pytest.raises(ValueError, match=r"unknown policy_loss 'x'; known: gspo, vanilla"):
        core.POLICY_LOSSES.get("x")
    with pytest.raises(ValueError, match=r"unknown kl_penalty 'k9\+'; known: abs, k1"):
        losses.kl_penalty(jnp.zeros(2), jnp.zeros(2), "k9+")
    with pytest.raises(ValueError, match=r"unknown loss_agg_mode 'sum'; known: seq-mean"):
        core.agg_loss(jnp.zeros((2, 2)), jnp.ones((2, 2)), "sum")
    reg = core.Registry("thing")
    reg.register("a", "b")(len)
    assert reg.get("b") is len and "a" in reg and reg.names() == ("a", "b")
    with pytest.raises(ValueError, match="thing 'a' is already registered"):
        reg.register("a")(abs)


def test_everything_runs_under_jit():
    rng = np.random.default_rng(15)
    b, t = 6, 5
    index = np.array([0, 0, 1, 1, 1, 2])
    mask = make_mask(rng, b, t, min_len=2)
    rewards = outcome_rewards(rng, mask)
    values = rng.normal(size=(b, t))
    baselines = rng.normal(size=b)

    ADV = core.ADV_ESTIMATORS.get

    @jax.jit
    def all_advantages(rewards, values, mask, index, baselines):
        kw = dict(token_level_rewards=rewards, response_mask=mask, gamma=1.0, lam=0.95)
        return {
            "gae": core.ADV_ESTIMATORS.get("gae")(AdvantageInputs(values=values, **kw)),
            "grpo": ADV("grpo")(AdvantageInputs(index=index, num_groups=3, **kw)),
            "rloo": core.ADV_ESTIMATORS.get("rloo")(AdvantageInputs(index=index, **kw)),
            "rpp": core.ADV_ESTIMATORS.get("reinforce_plus_plus")(AdvantageInputs(**kw)),
            "remax": ADV("remax")(AdvantageInputs(reward_baselines=baselines, **kw)),
        }

    out = all_advantages(f32(rewards), f32(values), jnp.asarray(mask > 0), index, f32(baselines))
    close(out["gae"][0], ref_gae(rewards, values, mask, 1.0, 0.95)[0])
    close(out["grpo"][0], ref_grpo(rewards, mask, index, True, 1e-6))
    close(out["rloo"][0], ref_rloo(rewards, mask, index))
    close(out["rpp"][0], ref_reinforce_pp(rewards, mask, 1.0)[0])
    close(out["remax"][0], ref_remax(rewards, mask, baselines)[0])

    old_lp, lp, adv, pmask = ppo_case()

    @jax.jit
    def all_losses(old_lp, lp, adv, mask):
        pg = losses.compute_policy_loss(
            PolicyLossInputs(old_lp, lp, adv, mask, 0.2, 0.2, 0.28, 3.0, "token-mean")
        )
        vf = losses.compute_value_loss(lp, adv, old_lp, mask, 0.2, "seq-mean-token-mean")
        kl = losses.apply_kl_penalty(adv, lp, old_lp, mask, 0.1, "low_var_kl")
        ent = core.entropy_from_logits(jnp.stack([lp, adv], -1))
        return pg, vf, kl, ent

    pg, _, kl, ent = all_losses(f32(old_lp), f32(lp), f32(adv), f32(pmask))
    for got, want in zip(pg, ref_ppo(old_lp, lp, adv, pmask, 0.2, 0.28, 3.0, "token-mean")):
        close(got, want)
    close(kl[0], adv - 0.1 * ref_kl(lp, old_lp, "k3") * pmask)
    assert np.all(np.isfinite(np.asarray(ent)))
