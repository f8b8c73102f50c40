"""The RLHF numerics (Safe-RLHF advantages, the Lagrange multiplier, the pairwise loss, DAPO's
overlong penalty and dynamic-sampling rule, scores on last tokens) against independent
loop-based NumPy references in float64, with their edge cases: groups of one, all-equal
rewards, fully masked rows and zero-length responses."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from references import ref_gae_raw

from hfjax.numerics import core, losses, shaping
from hfjax.numerics.advantages import AdvantageInputs

ATOL = 1e-6


def close(actual, expected, atol=ATOL):
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, atol=atol, rtol=1e-6)


def f32(x):
    return jnp.asarray(np.asarray(x, np.float32))


def mask_with_lengths(lengths, t):
    mask = np.zeros((len(lengths), t))
    for i, n in enumerate(lengths):
        mask[i, :n] = 1.0
    return mask


# ---------------------------------------------------------------------------- references


def ref_whiten(x, mask):
    vals = [x[i, j] for i in range(x.shape[0]) for j in range(x.shape[1]) if mask[i, j]]
    n = len(vals)
    mu = sum(vals) / n
    var = sum((v - mu) ** 2 for v in vals) / (n - 1) if n > 1 else 0.0
    return (x - mu) / math.sqrt(var + 1e-8) * mask


def ref_safe_rlhf(rewards, costs, values, cost_values, mask, lam, gamma, gae_lam):
    adv_r = ref_gae_raw(rewards * mask, values * mask, mask, gamma, gae_lam)
    adv_c = ref_gae_raw(costs * mask, cost_values * mask, mask, gamma, gae_lam)
    b, t = rewards.shape
    combined = np.zeros((b, t))
    for i in range(b):
        for j in range(t):
            combined[i, j] = (adv_r[i, j] - lam * adv_c[i, j]) / (1.0 + lam)
    return (ref_whiten(combined, mask), (adv_r + values) * mask,
            (adv_c + cost_values) * mask, adv_c)


def ref_overlong(lengths, max_len, buf, factor):
    out = []
    for n in lengths:
        start = max_len - buf
        out.append(0.0 if n <= start else -(n - start) / buf * factor)
    return np.array(out)


def ref_varied(scores, index):
    keep = np.zeros(len(scores), bool)
    for g in set(int(i) for i in index):
        members = [k for k in range(len(scores)) if index[k] == g]
        vals = [scores[k] for k in members]
        ok = len(vals) == 1 or any(v != vals[0] for v in vals)
        for k in members:
            keep[k] = ok
    return keep


def log_sigmoid(x):
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def ref_pairwise(c, r, cs=None, rs=None, sign_coef=0.0, center_coef=0.0):
    n = len(c)
    loss = acc = sign = center = 0.0
    for i in range(n):
        loss += -log_sigmoid(c[i] - r[i])
        acc += 1.0 if c[i] > r[i] else 0.0
        if sign_coef:
            sign += -log_sigmoid(cs[i] * c[i]) - log_sigmoid(rs[i] * r[i])
        center += c[i] ** 2 + r[i] ** 2
    total = loss / n + sign_coef * sign / (2 * n) + center_coef * center / (2 * n)
    return total, acc / n


# ---------------------------------------------------------------------------- Safe-RLHF


@pytest.mark.parametrize("lam", [0.0, 0.7, 3.0])
def test_safe_rlhf_advantage_matches_reference(lam):
    rng = np.random.default_rng(1)
    # Row 2 is fully masked (batch padding), row 4 a zero-length response: both stay 0.
    lengths = [5, 3, 0, 6, 0, 1]
    mask = mask_with_lengths(lengths, 6)
    rewards, costs = rng.normal(size=(6, 6)), rng.normal(size=(6, 6))
    values, cost_values = rng.normal(size=(6, 6)), rng.normal(size=(6, 6))
    adv, ret, extra = core.ADV_ESTIMATORS.get("safe_rlhf")(AdvantageInputs(
        token_level_rewards=f32(rewards), response_mask=f32(mask), values=f32(values),
        cost_values=f32(cost_values), token_level_costs=f32(costs), lagrange_lambda=lam,
        gamma=0.99, lam=0.9))
    want_adv, want_ret, want_cret, want_cadv = ref_safe_rlhf(
        rewards, costs, values, cost_values, mask, lam, 0.99, 0.9)
    close(adv, want_adv)
    close(ret, want_ret)
    close(extra["cost_returns"], want_cret)
    close(extra["cost_advantages"], want_cadv)
    assert np.all(np.asarray(adv)[[2, 4]] == 0)


def test_safe_rlhf_lambda_weighs_cost_against_reward():
    # One token per row; reward and cost both 1 and no values: A_r = A_c = 1 before whitening,
    # so the combination (1 - lambda) / (1 + lambda) changes sign at lambda = 1.
    mask = np.ones((2, 1))
    base = dict(token_level_rewards=f32([[1.0], [0.0]]), response_mask=f32(mask),
                values=f32(np.zeros((2, 1))), cost_values=f32(np.zeros((2, 1))),
                token_level_costs=f32([[1.0], [0.0]]))
    low, _, _ = core.ADV_ESTIMATORS.get("safe_rlhf")(AdvantageInputs(**base, lagrange_lambda=0.5))
    high, _, _ = core.ADV_ESTIMATORS.get("safe_rlhf")(AdvantageInputs(**base, lagrange_lambda=2))
    assert float(low[0, 0]) > 0 > float(high[0, 0])


def test_safe_rlhf_requires_its_inputs():
    x = dict(token_level_rewards=jnp.zeros((2, 3)), response_mask=jnp.ones((2, 3)),
             values=jnp.zeros((2, 3)), cost_values=jnp.zeros((2, 3)))
    with pytest.raises(ValueError, match="'safe_rlhf' needs token_level_costs"):
        core.ADV_ESTIMATORS.get("safe_rlhf")(AdvantageInputs(**x, lagrange_lambda=1.0))
    with pytest.raises(ValueError, match="'safe_rlhf' needs lagrange_lambda"):
        core.ADV_ESTIMATORS.get("safe_rlhf")(
            AdvantageInputs(**x, token_level_costs=jnp.zeros((2, 3))))
    info = core.ADV_ESTIMATORS.info("safe_rlhf")
    assert set(info["needs"]) == {"values", "cost_values", "token_level_costs"}


def test_lagrange_multiplier_matches_reference_loop():
    costs = [0.5, 0.4, 0.1, -0.3, 2.0, 0.0]
    got = losses.LagrangeMultiplier.create(init=1.0, lr=0.3, threshold=0.2, max_lambda=2.5)
    log_lam = 0.0
    for c in costs:
        got = got.update(c)
        lam = math.exp(log_lam)
        log_lam = min(log_lam + 0.3 * lam * (c - 0.2), math.log(2.5))
        assert got.value == pytest.approx(math.exp(log_lam), abs=1e-12)
    assert losses.LagrangeMultiplier.from_state(got.state()) == got
    # Above the threshold lambda grows, below it shrinks, and it never crosses 0.
    m = losses.LagrangeMultiplier.create(1.0, 0.5, 0.0)
    assert m.update(1.0).value > 1.0 > m.update(-1.0).value > 0.0
    with pytest.raises(ValueError, match="initial lambda must be > 0"):
        losses.LagrangeMultiplier.create(0.0, 0.1, 0.0)


# ---------------------------------------------------------------------------- pairwise loss


def test_pairwise_loss_matches_reference():
    rng = np.random.default_rng(2)
    c, r = rng.normal(size=9) * 3, rng.normal(size=9) * 3
    r[4] = c[4]  # a tie counts as a wrong ranking
    cs, rs = np.sign(rng.normal(size=9)), np.sign(rng.normal(size=9))
    for kw in (dict(), dict(sign_coef=0.5), dict(center_coef=0.01),
               dict(sign_coef=1.0, center_coef=0.1)):
        loss, acc = losses.pairwise_loss(f32(c), f32(r), chosen_sign=f32(cs),
                                         rejected_sign=f32(rs), **kw)
        want_loss, want_acc = ref_pairwise(c, r, cs, rs, **kw)
        close(loss, want_loss)
        close(acc, want_acc)


def test_pairwise_loss_gradient_pushes_chosen_up():
    g = jax.grad(lambda c, r: losses.pairwise_loss(c, r)[0], argnums=(0, 1))(
        jnp.zeros(3), jnp.zeros(3))
    # d/dc of -log sigmoid(c - r) at 0 is -1/2 per pair, over 3 pairs.
    close(g[0], np.full(3, -0.5 / 3))
    close(g[1], np.full(3, 0.5 / 3))
    with pytest.raises(ValueError, match="needs chosen_sign and rejected_sign"):
        losses.pairwise_loss(jnp.zeros(2), jnp.zeros(2), sign_coef=1.0)


# ---------------------------------------------------------------------------- DAPO shaping


def test_overlong_penalty_matches_reference():
    lengths = np.array([0, 1, 5, 6, 7, 9, 10, 12])
    got = shaping.overlong_penalty(jnp.asarray(lengths), 12, 4, 1.5)
    close(got, ref_overlong(lengths, 12, 4, 1.5))
    assert float(got[-1]) == pytest.approx(-1.5)  # the full penalty at the limit
    assert float(got[0]) == 0.0  # a zero-length response is not punished
    with pytest.raises(ValueError, match="buffer_length must be positive"):
        shaping.overlong_penalty(jnp.asarray(lengths), 12, 0, 1.0)
    with pytest.raises(ValueError, match="longer than the response length"):
        shaping.overlong_penalty(jnp.asarray(lengths), 4, 8, 1.0)


def test_scores_on_last_token():
    lengths = [3, 0, 5, 1]
    mask = mask_with_lengths(lengths, 5)
    scores = np.array([1.5, 7.0, -2.0, 0.25])
    want = np.zeros((4, 5))
    for i, n in enumerate(lengths):
        if n:
            want[i, n - 1] = scores[i]
    close(shaping.scores_on_last_token(f32(scores), f32(mask)), want)


def test_varied_groups_rule():
    scores = np.array([1.0, 1.0, 1.0,   # all equal: dropped
                       0.0, 1.0, 0.0,   # varied: kept
                       0.3,             # a group of one: kept
                       0.1, 0.1])       # all equal (identical floats): dropped
    index = np.array([0, 0, 0, 1, 1, 1, 2, 3, 3])
    got = np.asarray(shaping.varied_groups(f32(scores), jnp.asarray(index), 4))
    np.testing.assert_array_equal(got, ref_varied(scores, index))
    np.testing.assert_array_equal(got, [0, 0, 0, 1, 1, 1, 1, 0, 0])
    rng = np.random.default_rng(3)
    s = rng.integers(0, 2, size=24).astype(float)
    idx = np.repeat(np.arange(6), 4)
    np.testing.assert_array_equal(
        np.asarray(shaping.varied_groups(f32(s), jnp.asarray(idx), 6)), ref_varied(s, idx))


def test_group_estimators_are_flagged_and_all_equal_groups_get_zero():
    # The built-in estimators only: other tests register estimators of their own (a user
    # algorithm's) in the same process.
    builtin = ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
               "remax", "safe_rlhf")
    assert set(builtin) <= set(core.ADV_ESTIMATORS.names())
    flagged = {n for n in builtin if core.ADV_ESTIMATORS.info(n).get("group")}
    assert flagged == {"grpo", "rloo", "reinforce_plus_plus_baseline"}
    mask = mask_with_lengths([2, 3, 0, 1], 3)
    rewards = np.zeros((4, 3))
    for i, n in enumerate([2, 3, 0, 1]):
        if n:
            rewards[i, n - 1] = 1.0  # the fully masked row has no score to give
    index = jnp.asarray([0, 0, 1, 1])
    for name in sorted(flagged):
        for norm in (True, False):  # GRPO and Dr.GRPO
            adv, _ = core.ADV_ESTIMATORS.get(name)(AdvantageInputs(
                token_level_rewards=f32(rewards[:2]), response_mask=f32(mask[:2]),
                index=index[:2], num_groups=1, norm_adv_by_std_in_grpo=norm))
            close(adv, np.zeros((2, 3)))
