"""A run config as the planner sees it, and a plan as config overrides.

`plan_inputs` reads the models (the actor from `model.*`, the critic and the reference where the
algorithm and its KL terms need them, a reward model when one is named), the roles scored on the
host, and the step's shape (`hfjax.planner.simulator.Workload`, with the sampler's buckets)
from a config, without loading any weights. `flagfile_lines` writes a plan as an absl flagfile
that `launch.train --flagfile=...` runs unchanged.
"""

from __future__ import annotations

from hfjax.algorithms.registry import get_algorithm
from hfjax.config import model_source, run_roles
from hfjax.data import arith
from hfjax.engine.buckets import MIN_NEW_TOKENS_BUCKET, bucket_size, prompt_bucket
from hfjax.models import backend, lora
from hfjax.models.config import ModelConfig
from hfjax.models.hf_io import read_model_config
from hfjax.numerics import rollout_correction
from hfjax.planner.pricing import ModelSpec
from hfjax.planner.simulator import Workload
from hfjax.workers.groups import needs_ref
from hfjax.workers.spec import ActorSpec


def planned_model_config(cfg, platform: str = "gpu") -> ModelConfig:
    """The actor's ModelConfig as the trainer builds it on `platform` (where `model.dtype=auto`
    resolves), without loading weights (`hfjax.config.model_source.model_config`)."""
    compute = model_source.compute_dtype(cfg, platform)
    # A run resolves auto from its own dry run; a plan compiles no run, and
    # `backend.remat_policy` without a dry run's peak gives the policy auto falls back to.
    policy = backend.remat_policy(cfg.model.remat_policy)
    if policy != cfg.model.remat_policy:
        cfg = cfg.copy_and_resolve_references()
        cfg.model.remat_policy = policy
    return model_source.model_config(cfg, arith.tokenizer(), compute)


def reward_model_path(cfg, flag: str = "") -> str:
    """The reward model a plan places: `launch.plan --reward_model`, else the config's
    `reward_model.path` (empty: the rule reward, scored on the host)."""
    return flag or (cfg.get("reward_model") or {}).get("path", "")


def plan_inputs(cfg, reward_model: str = "", score_micro: int | None = None,
                gen_rows: int | None = None, platform: str = "gpu"):
    """(models, host roles, workload) of the run a config describes on `platform`; the reward
    model is `reward_model_path(cfg, reward_model)`; `score_micro` and `gen_rows` (None: the
    config's `plan.score_micro` and `plan.gen_rows`, 0 where it has none) say how the
    workload's scoring passes and decode batch their rows (`Workload`)."""
    plan = cfg.get("plan") or {}
    if score_micro is None:
        score_micro = plan.get("score_micro", 0)
    if gen_rows is None:
        gen_rows = plan.get("gen_rows", 0)
    algo = get_algorithm(cfg.algorithm)
    actor_cfg = planned_model_config(cfg, platform)
    reward_model = reward_model_path(cfg, reward_model)
    name = cfg.model.path or "scratch model"
    spec = lora.spec_from_config(cfg.actor)
    models = [ModelSpec("actor", actor_cfg, "causal_lm", True, f"actor {name}", lora=spec)]
    if "critic" in algo.roles:
        models.append(ModelSpec("critic", actor_cfg, "value", True, f"critic {name}",
                                lora=lora.spec_from_config(cfg.get("critic"))))
    host = []
    if needs_ref(cfg, algo.roles):
        # With LoRA on the actor the reference is its frozen base: no state of its own.
        models.append(ModelSpec("ref", actor_cfg, "causal_lm", False, f"ref {name}",
                                shares_base_of="actor" if spec is not None else ""))
    elif "ref" in algo.roles:
        # No KL term reads it, so the run builds no reference; the placement still names the
        # role, on the actor's pool.
        host.append("ref")
    if "judge" in run_roles(algo, cfg):
        # Its work is a generation of its own (verdicts over prompt + response rows), which the
        # simulator does not price yet; a plan without it would leave it no pool.
        raise ValueError("launch.plan does not place a generative judge yet "
                         "(reward.judge.path): plan without it, then give the judge a pool in "
                         "--config.placement (its programs' memory: launch.train --dry_run)")
    teacher = cfg.get("teacher")
    if "teacher" in run_roles(algo, cfg):
        # Scoring as the trainer builds it (`hfjax.workers.groups`): teacher.dtype throughout.
        m = cfg.model
        tcfg = read_model_config(teacher.path, dtype=teacher.dtype, scan_layers=m.scan_layers,
                                 remat_policy=actor_cfg.remat_policy,
                                 attention_impl=m.attention_impl)
        models.append(ModelSpec("teacher", tcfg, "causal_lm", False, f"teacher {teacher.path}"))
    if "reward" in algo.roles:
        if reward_model:
            # Built as the trainer builds it: `reward_model.dtype` for weights and compute.
            m, dtype = cfg.model, (cfg.get("reward_model") or {}).get("dtype", "float32")
            rcfg = read_model_config(reward_model, dtype=dtype, scan_layers=m.scan_layers,
                                     remat_policy=actor_cfg.remat_policy,
                                     attention_impl=m.attention_impl)
            models.append(ModelSpec("reward", rcfg, "score", False, f"reward {reward_model}"))
        else:
            host.append("reward")
    a, c, r, n = cfg.actor, cfg.get("critic"), cfg.rollout, cfg.rollout.n
    s = cfg.data.train_batch_size * n
    single = a.ppo_epochs == 1 and a.ppo_mini_batch_size * n == s
    workload = Workload(
        prompts=cfg.data.train_batch_size, n=n,
        prompt_len=prompt_bucket(cfg.data.max_prompt_length),
        response_len=bucket_size(r.response_length, MIN_NEW_TOKENS_BUCKET),
        actor_mini=a.ppo_mini_batch_size * n, actor_micro=a.ppo_micro_batch_size,
        actor_epochs=a.ppo_epochs,
        critic_mini=c.ppo_mini_batch_size * n if "critic" in algo.roles else 0,
        critic_micro=c.ppo_micro_batch_size if "critic" in algo.roles else 0,
        critic_epochs=c.ppo_epochs if "critic" in algo.roles else 1,
        old_log_prob=_scores_old_policy(cfg, single),
        score_micro=score_micro, gen_rows=gen_rows, shared=ActorSpec.of(a).samples_per_row(n),
    )
    return models, tuple(host), workload


def flagfile_lines(plan, cfg, config_path: str, argv,
                   reward_model: str = "") -> tuple[list[str], list[str]]:
    """(the flagfile's lines, plan keys the config has no field for); `reward_model` is
    `launch.plan --reward_model`, which the flagfile passes on as `reward_model.path`."""
    lines = [f"# hfjax plan: {plan.mode}, estimated {plan.iteration_s:.4g} s per step",
             f"--config={config_path}"]
    # The user's own overrides first, so the plan's settings win where both name a key.
    lines += [a for a in argv[1:] if a.startswith("--config.")]
    missing = []
    planned = config_overrides(plan)
    if reward_model and "reward_model.mesh" in planned:
        planned = {"reward_model.path": reward_model, **planned}
    for key, value in planned.items():
        if not _has_key(cfg, key):
            missing.append(key)
            continue
        text = str(value).lower() if isinstance(value, bool) else str(value)
        lines.append(f"--config.{key}={text}")
    return lines, missing


def config_overrides(plan) -> dict[str, object]:
    """`plan.overrides()` in the trainer's role names: the planner's "reward" model is the
    `reward_model` role (`reward_model.mesh`), placed with the reward it feeds."""
    out = dict(plan.overrides())
    if "reward.mesh" in out:
        out["reward_model.mesh"] = out.pop("reward.mesh")
        pools = []
        for pool in str(out["placement"]).split(";"):
            head, roles = pool.split(":", 1)
            names = [x for r in roles.split("+")
                     for x in ((r, "reward_model") if r == "reward" else (r,))]
            pools.append(f"{head}:{'+'.join(names)}")
        out["placement"] = ";".join(pools)
    return out


def _has_key(cfg, key: str) -> bool:
    node = cfg
    for part in key.split("."):
        if not hasattr(node, "keys") or part not in node.keys():
            return False
        node = node[part]
    return True


def _scores_old_policy(cfg, single: bool) -> bool:
    """Whether a step runs the old-policy scoring pass (`dataflow.needs_old_log_prob`, less
    rollout correction's bypass mode, which takes the sampler's log-probs instead; a
    distillation term compares them with the teacher's)."""
    rc = cfg.algo.get("rollout_correction")
    if rc is not None and rc.bypass_mode:
        return False
    k = cfg.async_rollout.max_staleness if "async_rollout" in cfg else 0
    corrects = rc is not None and bool(
        rollout_correction.level_in_force(rc.rollout_is, k, False)
        or rc.rollout_rs not in ("", rollout_correction.NONE) or rc.rollout_token_veto_threshold)
    distills = (cfg.algo.get("distill") or {}).get("coef", 0.0) > 0
    return bool(cfg.algo.use_kl_in_reward) or not single or corrects or distills
