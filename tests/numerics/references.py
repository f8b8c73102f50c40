"""Independent references for tests/numerics/test_numerics.py: plain loops in NumPy, float64."""

import math

import numpy as np


def ref_masked_mean(x, mask):
    total, count = 0.0, 0.0
    for v, m in zip(x.ravel(), mask.ravel()):
        total += v * m
        count += m
    return total / count if count > 0 else 0.0


def ref_masked_var_unbiased(x, mask):
    mu = ref_masked_mean(x, mask)
    n = mask.sum()
    return sum(m * (v - mu) ** 2 for v, m in zip(x.ravel(), mask.ravel())) / (n - 1)


def ref_whiten(x, mask):
    mu = ref_masked_mean(x, mask)
    return (x - mu) / math.sqrt(ref_masked_var_unbiased(x, mask) + 1e-8)


def ref_gae_raw(rewards, values, mask, gamma, lam):
    """GAE advantages, not whitened, zero on masked tokens."""
    b, t = rewards.shape
    adv = np.zeros((b, t))
    for i in range(b):
        # Walk backwards over response tokens only; masked tokens are transparent.
        next_v, running = 0.0, 0.0
        for j in reversed(range(t)):
            if mask[i, j]:
                delta = rewards[i, j] + gamma * next_v - values[i, j]
                running = delta + gamma * lam * running
                next_v = values[i, j]
            adv[i, j] = running
    return adv * mask


def ref_gae(rewards, values, mask, gamma, lam):
    adv = ref_gae_raw(rewards, values, mask, gamma, lam)
    return ref_whiten(adv, mask) * mask, (adv + values) * mask


def ref_groups(index):
    groups = {}
    for i, g in enumerate(index):
        groups.setdefault(int(g), []).append(i)
    return groups


def ref_grpo(rewards, mask, index, norm_by_std, eps):
    scores = rewards.sum(-1)
    out = np.zeros(len(scores))
    for members in ref_groups(index).values():
        vals = [scores[i] for i in members]
        if len(vals) == 1:
            mu, sd = 0.0, 1.0
        else:
            mu = sum(vals) / len(vals)
            sd = math.sqrt(sum((v - mu) ** 2 for v in vals) / (len(vals) - 1))
        for i in members:
            out[i] = (scores[i] - mu) / (sd + eps) if norm_by_std else scores[i] - mu
    return out[:, None] * mask


def ref_rloo(rewards, mask, index):
    scores = rewards.sum(-1)
    out = np.zeros(len(scores))
    for members in ref_groups(index).values():
        for i in members:
            others = [scores[k] for k in members if k != i]
            out[i] = scores[i] - (sum(others) / len(others) if others else 0.0)
    return out[:, None] * mask


def ref_reinforce_pp(rewards, mask, gamma):
    b, t = rewards.shape
    returns = np.zeros((b, t))
    for i in range(b):
        running = 0.0
        for j in reversed(range(t)):
            running = rewards[i, j] + gamma * running
            returns[i, j] = running
            if not mask[i, j]:
                running = 0.0
    return ref_whiten(returns, mask) * mask, returns * mask


def ref_reinforce_pp_baseline(rewards, mask, index):
    scores = rewards.sum(-1)
    centred = np.zeros(len(scores))
    for members in ref_groups(index).values():
        mu = np.mean([scores[k] for k in members]) if len(members) > 1 else 0.0
        for i in members:
            centred[i] = scores[i] - mu
    tiled = centred[:, None] * mask
    return ref_whiten(tiled, mask) * mask


def ref_remax(rewards, mask, baselines):
    b, t = rewards.shape
    returns = np.zeros((b, t))
    adv = np.zeros((b, t))
    for i in range(b):
        for j in range(t):
            returns[i, j] = sum(rewards[i, k] * mask[i, k] for k in range(j, t))
            adv[i, j] = returns[i, j] - baselines[i] * mask[i, j]
    return adv, returns


def ref_agg(loss, mask, mode, scale=None):
    b, t = loss.shape
    if mode == "token-mean":
        return ref_masked_mean(loss, mask)
    per_seq = []
    for i in range(b):
        n = mask[i].sum()
        s = sum(loss[i, j] * mask[i, j] for j in range(t))
        if mode == "seq-mean-token-sum-norm":
            per_seq.append(s)
        elif n > 0:
            per_seq.append(s if mode == "seq-mean-token-sum" else s / n)
    if mode == "seq-mean-token-sum-norm":
        return sum(per_seq) / (t if scale is None else scale)
    return sum(per_seq) / len(per_seq)


def ref_ppo_token(adv, ratio, low, high, c):
    """One token's dual-clip PPO loss and which clips fired, by explicit case analysis."""
    unclipped = -adv * ratio
    clipped = -adv * min(max(ratio, 1 - low), 1 + high)
    loss = max(unclipped, clipped)
    clip_hit = clipped > unclipped
    lower_hit = False
    if adv < 0 and loss > -adv * c:
        loss = -adv * c
        lower_hit = True
    return loss, clip_hit, lower_hit


def ref_ppo(old_lp, lp, adv, mask, low, high, c, mode):
    b, t = lp.shape
    loss = np.zeros((b, t))
    clip = np.zeros((b, t))
    lower = np.zeros((b, t))
    for i in range(b):
        for j in range(t):
            ratio = math.exp(lp[i, j] - old_lp[i, j])
            loss[i, j], clip[i, j], lower[i, j] = ref_ppo_token(adv[i, j], ratio, low, high, c)
    return (
        ref_agg(loss, mask, mode),
        ref_masked_mean(clip, mask),
        ref_masked_mean(old_lp - lp, mask),
        ref_masked_mean(lower, mask),
    )


def ref_kl(lp, ref, name):
    out = np.zeros_like(lp)
    for idx in np.ndindex(lp.shape):
        x = lp[idx] - ref[idx]
        if name in ("kl", "k1"):
            out[idx] = x
        elif name == "abs":
            out[idx] = abs(x)
        elif name in ("mse", "k2"):
            out[idx] = 0.5 * x * x
        else:
            y = min(max(-x, -20.0), 20.0)
            out[idx] = min(max(math.exp(y) - y - 1.0, -10.0), 10.0)
    return out
