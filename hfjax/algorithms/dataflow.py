"""What the algorithm drivers share: the opening stages (`sample`), the reward stage (rule and
model rewards combined per data_source: `reward`), the cost stage (`cost`), the advantage
stage (KL-in-reward plus a registered estimator, jitted once per shape), the step's batch
metrics and the updates of the host-side controllers (KL coefficient, Lagrange multiplier).

A driver receives `WorkerGroups` (one typed handle per role), a host batch of prompts and its
settings (`hfjax.algorithms.spec.StepSpec`), and calls worker-group methods in order. Each
method's transfer protocol moves its inputs onto the group's mesh and its results back onto
the dataflow's, so a driver never places data itself.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hfjax.algorithms.spec import StepSpec
from hfjax.controller.batch import Batch
from hfjax.numerics import core, losses, shaping
from hfjax.numerics import rollout_correction as rc_numerics
from hfjax.numerics.advantages import AdvantageInputs
from hfjax.numerics.distill import reverse_kl_advantage
from hfjax.numerics.losses import KLController, LagrangeMultiplier
from hfjax.numerics.rollout_correction import RolloutCorrection
from hfjax.parallel.transfer import mesh_scalar
from hfjax.workers.groups import WorkerGroups


def sample(w: WorkerGroups, batch: Batch, spec: StepSpec) -> Batch:
    """The stages every algorithm starts with: generate the responses, score them under the
    pre-update policy when the update needs it, and under the reference policy when there is
    one. Returns the batch with responses, old_log_probs and ref_log_prob as applicable."""
    gen = w.actor.generate if w.rollout_source is None else w.rollout_source
    return log_probs(w, w.run("gen", gen, batch), spec)


def log_probs(w: WorkerGroups, batch: Batch, spec: StepSpec) -> Batch:
    """The scoring half of `sample`, for a batch already generated: old_log_probs when the
    update needs them, ref_log_prob when there is a reference, teacher_log_prob when there is
    a teacher (on-policy distillation)."""
    if spec.algo.rollout_correction.bypass_mode:
        # verl's bypass mode: the sampler's log-probs stand for the old policy's, so PPO's
        # ratio is taken against the policy that sampled, and no scoring pass runs.
        batch = batch.union(Batch({"old_log_probs": batch["rollout_log_probs"]}))
    elif needs_old_log_prob(w, batch, spec):
        batch = batch.union(w.run("old_log_prob", w.actor.compute_log_prob, batch))
    if w.ref is not None:
        batch = batch.union(w.run("ref", w.ref.compute_ref_log_prob, batch))
    teacher = w.roles.get("teacher")
    if teacher is not None:
        batch = batch.union(w.run("teacher", teacher.compute_teacher_log_prob, batch))
    return batch


def reward(w: WorkerGroups, batch: Batch, spec: StepSpec, name: str = "reward") -> Batch:
    """The reward stage: `token_level_scores` [B, R], each sequence's score on its last
    response token.

    Without a reward model or a judge these are the rule rewards. With them
    (`reward_model.path`, `reward.judge.path`), each row's score is rule_weight * rule score
    + model_weight * reward-model score + judge_weight * judge score, the weights by
    data_source (`reward.rule_weight`, `reward.model_weight`, `reward.judge_weight`,
    `reward.sources`); the rule rewards are not computed at all when every row weighs them 0.
    The raw scores stay in the batch as `rm_scores` and `judge_scores`. Stages are timed as
    `name` (rules), `name`_model and `name`_judge.
    """
    del spec  # the weights live with the rule reward; the signature matches the other stages
    judge = w.roles.get("judge")
    if w.reward_model is None and judge is None:
        return batch.union(w.run(name, w.reward.compute_reward, batch))
    weights = w.reward.source_weights(batch)
    learned = {}  # raw scores [B] of each learned scorer, and their weights [B]
    verdicts = None
    if w.reward_model is not None:
        rm = w.run(f"{name}_model", w.reward_model.compute_score, batch)
        learned["rm_scores"] = (rm["rm_scores"], weights["model_weight"])
    if judge is not None:
        verdicts = w.run(f"{name}_judge", judge.compute_judge_scores, batch)
        learned["judge_scores"] = (verdicts["judge_scores"], weights["judge_weight"])
    rule = None
    if w.reward.needs_rules(batch.meta["data_source"]):
        rule = w.run(name, w.reward.compute_reward, batch)
    scores = _combine(None if rule is None else rule["token_level_scores"],
                      list(learned.values()), batch["response_mask"], weights["rule_weight"])
    out = Batch({"token_level_scores": scores} | {k: v[0] for k, v in learned.items()})
    # The host stages' meta (response texts, the judge's verdicts) and counts come along.
    for host in (rule, verdicts):
        if host is not None:
            out = out.union(host.select([]))
    return batch.union(out)


@jax.jit
def _combine(rule_scores, learned, mask, rule_weight):
    model = shaping.scores_on_last_token(sum(s * wt for s, wt in learned), mask)
    if rule_scores is None:
        return model
    return rule_scores * rule_weight[:, None] + model


def cost(w: WorkerGroups, batch: Batch) -> Batch:
    """The cost stage (Safe-RLHF): the cost model's `cost_scores` [B] and the same scores on
    each sequence's last response token, `token_level_costs` [B, R]."""
    out = w.run("cost", w.cost_model.compute_score, batch)
    return batch.union(out.union(Batch(
        {"token_level_costs": _on_last_token(out["cost_scores"], batch["response_mask"])})))


_on_last_token = jax.jit(shaping.scores_on_last_token)


def needs_old_log_prob(w: WorkerGroups, batch: Batch, spec: StepSpec) -> bool:
    """Whether a step must score its samples under the pre-update policy (`old_log_probs`).

    Not when the actor takes a single update on the batch and no KL penalty goes into the
    reward: the samples' policy is then the current one, and the actor's loss uses its own
    detached log-probs (as TRL and Tunix do), saving a forward pass over the batch.
    """
    StepSpec.require(spec, "needs_old_log_prob")
    rc = spec.algo.rollout_correction
    # A rollout correction compares the sampler's log-probs with the old policy's, so it needs
    # them even on-policy; bypass mode reads the sampler's as the old ones.
    # Distillation's advantage compares the student's log-probs with the teacher's.
    return (spec.algo.use_kl_in_reward or not w.actor.single_update(len(batch))
            or rc.bypass_mode or rc.resolved.active or spec.algo.distill.coef > 0)


# Batch arrays an estimator may read, beyond the rewards and the mask (AdvantageInputs fields).
_OPTIONAL_INPUTS = ("values", "reward_baselines", "token_level_costs", "cost_values")


@functools.partial(jax.jit, static_argnames=("estimator", "kl_penalty", "use_kl", "n", "opts",
                                             "distill"))
def _advantage(arrays, kl_coef, scalars, *, estimator, kl_penalty, use_kl, n, opts, distill):
    mask = arrays["response_mask"].astype(jnp.float32)
    scores = arrays["token_level_scores"]
    metrics = {}
    if use_kl:
        rewards, kl = losses.apply_kl_penalty(
            scores, arrays["old_log_probs"], arrays["ref_log_prob"], mask, kl_coef, kl_penalty
        )
        metrics["actor/reward_kl_penalty"] = kl
    else:
        rewards = scores
    b = scores.shape[0]
    # Rejected tokens leave the estimator's mask (verl rewrites the response mask before its
    # advantages): GAE skips them as it skips tool tokens, whitening is over the kept ones.
    if "rollout_rs_mask" in arrays:
        mask = mask * arrays["rollout_rs_mask"].astype(jnp.float32)
    inputs = AdvantageInputs(
        token_level_rewards=rewards,
        response_mask=mask,
        index=jnp.arange(b) // n,
        num_groups=b // n,
        **{k: arrays.get(k) for k in _OPTIONAL_INPUTS},
        **scalars,
        **dict(opts),
    )
    adv, ret, *extra = core.ADV_ESTIMATORS.get(estimator)(inputs)
    if distill is not None:  # on-policy distillation's term: (coef, discount)
        term = reverse_kl_advantage(arrays["old_log_probs"], arrays["teacher_log_prob"], mask,
                                    distill[1])
        adv = adv + distill[0] * term
        metrics["actor/distill_reverse_kl"] = core.masked_mean(
            arrays["old_log_probs"] - arrays["teacher_log_prob"], mask)
    out = {"token_level_rewards": rewards, "advantages": adv, "returns": ret}
    return out | (extra[0] if extra else {}), metrics


def compute_advantage(batch: Batch, spec: StepSpec, kl_coef: float,
                      lagrange: LagrangeMultiplier | None = None) -> tuple[Batch, dict]:
    """Adds token_level_rewards, advantages and returns (and whatever else the estimator
    hands on, e.g. Safe-RLHF's cost_returns); rows come in groups of `spec.rollout.n` samples.
    With `algo.distill.coef` > 0 the teacher's reverse-KL advantage, times the coefficient, is
    added to the estimator's (`hfjax.numerics.distill`).
    Every input an estimator may read that the batch holds is passed (`AdvantageInputs`), and
    the Lagrange multiplier's current value when there is one."""
    StepSpec.require(spec, "compute_advantage")
    a = spec.algo
    use_kl = a.use_kl_in_reward
    keys = ["response_mask", "token_level_scores"] + (["old_log_probs", "ref_log_prob"]
                                                      if use_kl else [])
    keys += [k for k in _OPTIONAL_INPUTS if k in batch]
    distill = (a.distill.coef, a.distill.discount) if a.distill.coef > 0 else None
    if distill is not None:
        keys += [k for k in ("old_log_probs", "teacher_log_prob") if k not in keys]
    # The correction comes first, so that its rejected tokens leave the advantages too.
    rc = a.rollout_correction.resolved
    rc_metrics = {}
    if rc.active and not a.rollout_correction.bypass_mode:
        batch, rc_metrics = rollout_correction(batch, rc)
        keys += [k for k in ("rollout_rs_mask",) if k in batch]
    opts = (("gamma", a.gamma), ("lam", a.lam),
            ("norm_adv_by_std_in_grpo", a.norm_adv_by_std_in_grpo))
    # The KL coefficient is host-side controller state (the adaptive controller updates it from
    # the fetched metrics): one deliberate scalar upload per step, placed on the batch's mesh.
    # Left on this process's default device (uncommitted), it segfaults a process that holds
    # none of the batch's devices from the second call on (see `mesh_scalar`).
    like = batch["response_mask"]
    coef = mesh_scalar(kl_coef if use_kl else 0.0, like)
    # The multiplier, likewise host state, is uploaded the same way when there is one.
    scalars = {} if lagrange is None else {"lagrange_lambda": mesh_scalar(lagrange.value, like)}
    out, metrics = _advantage(
        {k: batch[k] for k in keys},
        coef,
        scalars,
        estimator=a.adv_estimator,
        kl_penalty=a.kl_penalty,
        use_kl=use_kl,
        n=spec.rollout.n,
        opts=opts,
        distill=distill,
    )
    return batch.union(Batch(out)), metrics | rc_metrics


def rollout_correction(batch: Batch, c: RolloutCorrection) -> tuple[Batch, dict]:
    """The rollout correction's stage: adds `rollout_is_weights` [B, R] (with `rollout_is`)
    and `rollout_rs_mask` [B, R] (with rejection or a veto), which the actor's update applies
    (`hfjax.workers.actor`), and returns its rollout_corr/ metrics. Reads `old_log_probs`
    (pi_old) and `rollout_log_probs` (the sampler's pi_rollout). It runs before the
    advantages (`compute_advantage`): a rejected token leaves the estimator, its whitening,
    the critic's loss and the policy loss, as in verl."""
    weights, keep, metrics = _correct(batch["old_log_probs"], batch["rollout_log_probs"],
                                      batch["response_mask"], c=c)
    out = {}
    if c.rollout_is:
        out["rollout_is_weights"] = weights
    if c.rollout_rs or c.veto_threshold:
        out["rollout_rs_mask"] = keep
    return batch.union(Batch(out)), metrics


_correct = jax.jit(rc_numerics.correct, static_argnames=("c",))


@functools.partial(jax.jit, static_argnames=("response_length",))
def step_metrics(a: dict, response_length: int) -> dict:
    """verl's batch metrics of one step (device scalars): scores, rewards, advantages, returns,
    values, response lengths and the share of responses cut off at `response_length`; plus
    `_tokens`, the step's real tokens, for throughput, and `_response_tokens`, its real
    response tokens, for MFU."""
    mask = a["response_mask"].astype(jnp.float32)
    score = jnp.sum(a["token_level_scores"], axis=1)
    length = jnp.sum(mask, axis=1)
    out = {
        "critic/score/mean": jnp.mean(score),
        "critic/score/max": jnp.max(score),
        "critic/score/min": jnp.min(score),
        "critic/rewards/mean": jnp.mean(jnp.sum(a["token_level_rewards"], axis=1)),
        "critic/advantages/mean": core.masked_mean(a["advantages"], mask),
        "critic/returns/mean": core.masked_mean(a["returns"], mask),
        "response_length/mean": jnp.mean(length),
        "response_length/max": jnp.max(length),
        "response_length/min": jnp.min(length),
        # Responses cut off at the limit (not finished): those the rollout marked truncated,
        # else (a batch built without `generate`) those that used every allowed token.
        "response_length/clip_ratio": jnp.mean(
            a["truncated"] > 0 if "truncated" in a
            # The budget counts tool results too (multi-turn rows: policy tokens with gaps).
            else shaping.response_extent(a["attention_mask"], mask.shape[1])
            >= response_length),
        "_tokens": jnp.sum(a["attention_mask"]).astype(jnp.float32),
        "_response_tokens": jnp.sum(mask),
    }
    # Multi-turn trajectories (hfjax.agents): policy turns, tool calls and the
    # calls that came back as errors, per trajectory.
    for key in ("num_turns", "tool_calls", "tool_errors"):
        if key in a:
            out[f"{key}/mean"] = jnp.mean(a[key].astype(jnp.float32))
    if "values" in a:
        out["critic/values/mean"] = core.masked_mean(a["values"], mask)
    if "rm_scores" in a:
        out["reward_model/score/mean"] = jnp.mean(a["rm_scores"])
    if "judge_scores" in a:
        out["reward/judge_score/mean"] = jnp.mean(a["judge_scores"])
    if "cost_scores" in a:
        # The mean episode cost the Lagrange multiplier steers below its threshold, and the
        # share of responses the cost model calls costly (a score above 0).
        out["cost/mean"] = jnp.mean(a["cost_scores"])
        out["cost/costly_frac"] = jnp.mean((a["cost_scores"] > 0).astype(jnp.float32))
    if "cost_values" in a:
        out["cost_critic/values/mean"] = core.masked_mean(a["cost_values"], mask)
    return out


def update_kl_controller(ctrl: KLController, host_metrics: dict[str, float],
                         n_prompts: int) -> KLController:
    """The controller after a step: the adaptive one moves toward its target KL, measured as
    the step's `actor/reward_kl_penalty`; without a KL-in-reward term it stays."""
    kl = host_metrics.get("actor/reward_kl_penalty")
    return ctrl if kl is None else ctrl.update(kl, n_prompts)


def update_lagrange(lagrange: LagrangeMultiplier | None,
                    host_metrics: dict[str, float]) -> LagrangeMultiplier | None:
    """The multiplier after a step, moved by the step's mean episode cost (`cost/mean`, from
    the host metrics fetched once per step); None stays None."""
    if lagrange is None or "cost/mean" not in host_metrics:
        return lagrange
    return lagrange.update(host_metrics["cost/mean"])
