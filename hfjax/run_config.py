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
from hfjax.numerics import core, losses
from hfjax.parallel.mesh import MeshSpec, ResourcePool, dp_size
from hfjax.workers.groups import needs_ref


def validate_config(cfg) -> tuple[Algorithm, dict[str, ResourcePool]]:
    """Checks names and batch arithmetic before anything is built; returns the Algorithm and
    the resource pool of every role."""
    algo = get_algorithm(cfg.algorithm)
    estimator = cfg.algo.adv_estimator
    missing = [k for k in core.ADV_ESTIMATORS.info(estimator).get("needs", ())
               if k not in algo.provides]
    if missing:
        raise ValueError(f"algo.adv_estimator={estimator!r} needs {', '.join(missing)}, which "
                         f"algorithm {algo.name!r} does not produce; choose another estimator "
                         "or an algorithm that produces them")
    core.POLICY_LOSSES.get(cfg.actor.policy_loss)
    core.LOSS_AGG_MODES.get(cfg.actor.loss_agg_mode)
    losses.check_kl_name(cfg.algo.kl_penalty)
    if cfg.actor.use_kl_loss:
        losses.check_kl_name(cfg.actor.kl_loss_type)
    _check_run_keys(cfg.trainer)
    try:  # the validation sampling settings, checked like any request's
        SamplingParams(cfg.rollout.response_length, temperature=cfg.rollout.val_kwargs.temperature,
                       n=cfg.rollout.val_kwargs.n)
    except ValueError as err:
        raise ValueError(f"rollout.val_kwargs: {err}") from err
    n_seq = cfg.data.train_batch_size * cfg.rollout.n
    pools = resolve_placement(placement_of(cfg), active_roles(algo), jax.devices())
    dp = dp_size(MeshSpec.parse(cfg.actor.mesh).build(pools["actor"].devices, "actor"))
    check_mini_batching(n_seq, cfg.actor.ppo_mini_batch_size * cfg.rollout.n,
                        cfg.actor.ppo_micro_batch_size, dp, "actor")
    if needs_ref(cfg, algo.roles):
        # Built only after the warm start, so a bad mesh must be caught here, not there.
        MeshSpec.parse(cfg.ref.mesh).build(pools["ref"].devices, "ref")
    if "critic" in algo.roles:
        dpc = dp_size(MeshSpec.parse(cfg.critic.mesh).build(pools["critic"].devices, "critic"))
        check_mini_batching(n_seq, cfg.critic.ppo_mini_batch_size * cfg.rollout.n,
                            cfg.critic.ppo_micro_batch_size, dpc, "critic")
    return algo, pools


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


def active_roles(algo: Algorithm) -> tuple[str, ...]:
    """The roles that get a pool ("rollout" shares the actor's, through the hybrid engine)."""
    return tuple(r for r in algo.roles if r != "rollout")
