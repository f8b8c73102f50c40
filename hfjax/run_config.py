"""The run config's checks: every name, mesh and batch split of a config is resolved here,
before anything is built, so that a bad setting stops the run before it compiles or writes."""

from __future__ import annotations

import os

import jax

from hfjax.algorithms.registry import Algorithm, get_algorithm
from hfjax.controller.placement import resolve_placement
from hfjax.engine.sampler import SamplingParams
from hfjax.engine.update import check_mini_batching
from hfjax.metrics import parse_sink_names
from hfjax.models.hf_io import check_score_checkpoint
from hfjax.numerics import core, losses
from hfjax.parallel.mesh import MeshSpec, ResourcePool, dp_size
from hfjax.workers.groups import needs_ref
from hfjax.workers.reward import parse_source_weights

# Roles whose model a config selects by a path (a trained score head).
MODEL_ROLES = ("reward_model", "cost_model")


def validate_config(cfg) -> tuple[Algorithm, dict[str, ResourcePool]]:
    """Checks names and batch arithmetic before anything is built; returns the Algorithm and
    the resource pool of every role."""
    algo = get_algorithm(cfg.algorithm)
    estimator = cfg.algo.adv_estimator
    roles = run_roles(algo, cfg)
    provided = set(algo.provides) | provided_by_roles(roles)
    missing = [k for k in core.ADV_ESTIMATORS.info(estimator).get("needs", ())
               if k not in provided]
    if missing:
        raise ValueError(f"algo.adv_estimator={estimator!r} needs {', '.join(missing)}, which "
                         f"algorithm {algo.name!r} does not produce; choose another estimator "
                         "or an algorithm that produces them")
    if core.ADV_ESTIMATORS.info(estimator).get("group") and cfg.rollout.n < 2:
        raise ValueError(f"algo.adv_estimator={estimator!r} compares the samples of each prompt, "
                         f"but rollout.n={cfg.rollout.n} draws one; set --config.rollout.n to 2 "
                         "or more (e.g. 8)")
    core.POLICY_LOSSES.get(cfg.actor.policy_loss)
    core.LOSS_AGG_MODES.get(cfg.actor.loss_agg_mode)
    losses.check_kl_name(cfg.algo.kl_penalty)
    if cfg.actor.use_kl_loss:
        losses.check_kl_name(cfg.actor.kl_loss_type)
    if algo.check is not None:
        algo.check(cfg)
    if "ref" not in roles and (cfg.actor.use_kl_loss or cfg.algo.use_kl_in_reward):
        raise ValueError(f"algorithm {algo.name!r} has no reference model, so it cannot take a "
                         "KL term; set --config.actor.use_kl_loss=False and "
                         "--config.algo.use_kl_in_reward=False")
    for role in MODEL_ROLES:
        if role in roles:
            check_score_checkpoint(cfg[role].path, f"{role}.path")
    parse_source_weights(cfg.reward.get("sources", ""))
    _check_run_keys(cfg.trainer)
    try:  # the validation sampling settings, checked like any request's
        SamplingParams(cfg.rollout.response_length, temperature=cfg.rollout.val_kwargs.temperature,
                       n=cfg.rollout.val_kwargs.n)
    except ValueError as err:
        raise ValueError(f"rollout.val_kwargs: {err}") from err
    n_seq = cfg.data.train_batch_size * cfg.rollout.n
    pools = resolve_placement(placement_of(cfg), active_roles(algo, cfg), jax.devices())
    dp = dp_size(MeshSpec.parse(cfg.actor.mesh).build(pools["actor"].devices, "actor"))
    check_mini_batching(n_seq, cfg.actor.ppo_mini_batch_size * cfg.rollout.n,
                        cfg.actor.ppo_micro_batch_size, dp, "actor")
    if needs_ref(cfg, roles):
        # Built only after the warm start, so a bad mesh must be caught here, not there.
        MeshSpec.parse(cfg.ref.mesh).build(pools["ref"].devices, "ref")
    for critic in ("critic", "cost_critic"):
        if critic in roles:
            c = cfg[critic]
            dpc = dp_size(MeshSpec.parse(c.mesh).build(pools[critic].devices, critic))
            check_mini_batching(n_seq, c.ppo_mini_batch_size * cfg.rollout.n,
                                c.ppo_micro_batch_size, dpc, critic)
    for role in MODEL_ROLES:
        if role in roles:
            MeshSpec.parse(cfg[role].mesh).build(pools[role].devices, role)
    return algo, pools


def run_roles(algo: Algorithm, cfg) -> tuple[str, ...]:
    """The algorithm's roles plus those the config selects: a reward model
    (`reward_model.path`) scores for any algorithm with a reward. A cost model is part of an
    algorithm that uses costs (Safe-RLHF); configuring one for another algorithm is an error,
    since nothing would read it."""
    roles = list(algo.roles)
    rm = cfg.get("reward_model")
    if rm is not None and rm.path and "reward" in roles and "reward_model" not in roles:
        roles.append("reward_model")
    cm = cfg.get("cost_model")
    if cm is not None and cm.path and "cost_model" not in roles:
        raise ValueError(f"cost_model.path is set but algorithm {algo.name!r} has no cost; "
                         "unset it, or use an algorithm with a cost model (safe_rlhf)")
    return tuple(roles)


def provided_by_roles(roles: tuple[str, ...]) -> set[str]:
    """Batch arrays the advantage stage gets from the run's roles themselves."""
    out = set()
    if "critic" in roles:
        out.add("values")
    if "cost_critic" in roles:
        out.add("cost_values")
    if "cost_model" in roles:
        out.add("token_level_costs")
    return out


def _check_run_keys(t) -> None:
    parse_sink_names(t.get("logger", ""))
    resume = str(t.get("resume", "auto"))
    if resume not in ("auto", "disable") and not os.path.isdir(resume):
        raise ValueError(f"trainer.resume={resume!r}: not auto, disable or an existing "
                         "checkpoint directory (a run's out_dir, checkpoint root or step dir)")


def placement_of(cfg):
    """The config's placement: a mode name or a plain {pool: {size, roles}} mapping."""
    p = cfg.placement
    return p.to_dict() if hasattr(p, "to_dict") else p


def active_roles(algo: Algorithm, cfg=None) -> tuple[str, ...]:
    """The roles that get a pool ("rollout" shares the actor's, through the hybrid engine)."""
    roles = algo.roles if cfg is None else run_roles(algo, cfg)
    return tuple(r for r in roles if r != "rollout")
