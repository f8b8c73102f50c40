"""The rules that tie train-config keys together (`TRAIN_RULES`), and the roles a config
runs (`run_roles`, `active_roles`)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from hfjax.config.validators import split
from hfjax.numerics import rollout_correction as rc_numerics


def run_roles(algo, cfg) -> tuple[str, ...]:
    """The algorithm's roles plus those the config selects: a reward model
    (`reward_model.path`) and a generative judge (`reward.judge.path`) score for any
    algorithm with a reward, and a teacher
    (`teacher.path`) for any algorithm with a distillation term (`algo.distill.coef` > 0). A
    cost model is part of an algorithm that uses costs (Safe-RLHF); configuring one for
    another algorithm is a ValueError, since nothing would read it."""
    roles = list(algo.roles)
    rm = cfg.get("reward_model")
    if rm is not None and rm.path and "reward" in roles and "reward_model" not in roles:
        roles.append("reward_model")
    judge = cfg.get("reward", {}).get("judge")
    if judge is not None and judge.path and "judge" not in roles:
        if "reward" not in roles:
            raise ValueError(f"reward.judge.path is set but algorithm {algo.name!r} has no "
                             "reward stage to score with it; unset it")
        roles.append("judge")
    distill = cfg.algo.get("distill")
    teacher = cfg.get("teacher")
    if distill is not None and distill.coef > 0:
        if teacher is None or not teacher.path:
            raise ValueError("algo.distill.coef > 0 distils from a teacher: set "
                             "--config.teacher.path (a model sharing the student's tokenizer)")
        if "teacher" not in roles:
            roles.append("teacher")
    elif teacher is not None and teacher.path:
        raise ValueError("teacher.path is set but algo.distill.coef is 0, so nothing reads the "
                         "teacher; set --config.algo.distill.coef (e.g. 1.0) or unset it")
    cm = cfg.get("cost_model")
    if cm is not None and cm.path and "cost_model" not in roles:
        raise ValueError(f"cost_model.path is set but algorithm {algo.name!r} has no cost; "
                         "unset it, or use an algorithm with a cost model (safe_rlhf)")
    return tuple(roles)


# Roles whose model a config selects by a path (a trained score head).
MODEL_ROLES = ("reward_model", "cost_model")


def _roles(c) -> tuple:
    from hfjax.algorithms.registry import get_algorithm

    algo = get_algorithm(c.algorithm)
    return algo, run_roles(algo, c)


def _selected_models(c) -> str | None:
    try:
        _roles(c)
    except ValueError as err:
        return str(err)
    return None


def _algorithm_settings(c) -> str | None:
    from hfjax.algorithms.registry import get_algorithm

    algo = get_algorithm(c.algorithm)
    if algo.check is None:
        return None
    try:  # the algorithm's own refusals (DAPO with a KL term, Safe-RLHF without a cost model)
        algo.check(c)
    except ValueError as err:
        return str(err)
    return None


def _group_needs_samples(c) -> str | None:
    from hfjax.numerics import core

    estimator = c.algo.adv_estimator
    if core.ADV_ESTIMATORS.info(estimator).get("group") and c.rollout.n < 2:
        return (f"algo.adv_estimator={estimator!r} compares the samples of each prompt, but "
                f"rollout.n={c.rollout.n} draws one; set --config.rollout.n to 2 or more "
                "(e.g. 8)")
    return None


def _score_models(c) -> str | None:
    from hfjax.models.hf_io import check_score_checkpoint

    _, roles = _roles(c)
    for role in MODEL_ROLES:
        if role in roles:
            try:  # reads config.json and the safetensors headers only
                check_score_checkpoint(c[role].path, f"{role}.path")
            except (ValueError, OSError) as err:
                return str(err)
    return None


def _estimator_inputs(c) -> str | None:
    from hfjax.numerics import core

    algo, _ = _roles(c)
    need = core.ADV_ESTIMATORS.info(c.algo.adv_estimator).get("needs", ())
    # What the algorithm's dataflow produces, as it registered it (a critic's values are
    # PPO's `provides`); the roles a config adds (a reward model) produce none of these.
    missing = [k for k in need if k not in algo.provides]
    if missing:
        return (f"algo.adv_estimator={c.algo.adv_estimator!r} needs {', '.join(missing)}, which "
                f"algorithm {algo.name!r} does not produce; choose another estimator or an "
                "algorithm that produces them")
    return None


def _kl_needs_a_reference(c) -> str | None:
    algo, roles = _roles(c)
    if "ref" not in roles and (c.actor.use_kl_loss or c.algo.use_kl_in_reward):
        return (f"algorithm {algo.name!r} has no reference policy, so it has no KL term; set "
                "--config.actor.use_kl_loss=False and --config.algo.use_kl_in_reward=False")
    return None


def _data_files(c) -> str | None:
    d = c.data
    if d.task == "parquet":
        for key in ("train_files", "val_files"):
            if not split(d[key]):
                return (f"data.task='parquet' needs data.{key}: set "
                        f"--config.data.{key}=path/to/{key.split('_')[0]}.parquet "
                        "(launch.prepare_data writes them)")
    elif d.train_files or d.val_files:
        return ("data.train_files/val_files are set but data.task='arith' ignores them; set "
                "--config.data.task=parquet to train on them")
    return None


def _warm_start_needs_arith(c) -> str | None:
    if c.sft.steps > 0 and c.data.task not in ("arith", "arith_chain", "arith_tool", "shapes") \
            and not split(c.sft.get("train_files", "")):
        return (f"sft.steps={c.sft.steps}: the warm start uses the arith task's "
                f"demonstrations, and data.task={c.data.task!r}; set --config.sft.steps=0, or "
                "--config.sft.train_files to SFT parquet")
    return None


def _chain_task(c) -> str | None:
    d, s = c.data, c.sft
    if d.task != "arith_chain":
        return None
    from hfjax.data.arith import CHAIN_MAX

    if 99 + d.chain_steps * d.max_b > CHAIN_MAX:
        return (f"data.chain_steps={d.chain_steps} with data.max_b={d.max_b} runs the chain's "
                f"sums past {CHAIN_MAX} (three digits); lower either")
    if s.steps > 0 and s.corruption == "carry":
        return ("sft.corruption='carry' has no chain form; use 'format' or 'none' with "
                "data.task='arith_chain'")
    if s.steps > 0 and s.get("scratchpad_lines", 0):
        return ("sft.scratchpad_lines: the arith_chain demonstrations are their own chain; "
                "set --config.sft.scratchpad_lines=0")
    return None


def _sft_micro_batches(c) -> str | None:
    s = c.sft
    if s.steps > 0 and s.batch_size % s.micro_batch_size:
        return (f"sft.micro_batch_size={s.micro_batch_size} does not divide "
                f"sft.batch_size={s.batch_size}; pick a divisor")
    return None


def _arith_sizes(c) -> str | None:
    d = c.data
    if d.task in ("arith", "arith_chain", "arith_tool") and d.n_train < d.train_batch_size:
        return (f"data.n_train={d.n_train} is smaller than one batch "
                f"(data.train_batch_size={d.train_batch_size}); raise n_train or lower the batch")
    return None


def _mini_batches_fit(c) -> str | None:
    _, roles = _roles(c)
    for role in ("actor", "critic", "cost_critic"):
        if role not in roles:
            continue
        s = c[role]
        if s.ppo_mini_batch_size > c.data.train_batch_size:
            return (f"{role}.ppo_mini_batch_size={s.ppo_mini_batch_size} prompts is more than "
                    f"data.train_batch_size={c.data.train_batch_size}; lower it")
    return None


def _scratch_model(c) -> str | None:
    m = c.model
    if m.path:
        return None  # the sizes below are ignored; the checkpoint's config is used
    if m.num_heads % m.num_kv_heads:
        return (f"model.num_heads={m.num_heads} is not a multiple of model.num_kv_heads="
                f"{m.num_kv_heads}; grouped-query attention needs whole groups")
    if m.head_dim % 2:
        return f"model.head_dim={m.head_dim} must be even (rotary embeddings pair dimensions)"
    if m.num_experts:
        from hfjax.models.config import scratch_model_config

        try:  # the model's own checks (top-k against the experts, ...), named by config key
            scratch_model_config(m, 1, 0, 0, 1)
        except ValueError as err:
            return f"model: {err}"
    if m.vocab_size:
        from hfjax.data import arith

        need = arith.tokenizer().vocab_size
        if m.vocab_size < need:
            return (f"model.vocab_size={m.vocab_size} is smaller than the tokenizer's {need}; "
                    "set 0 (the tokenizer's size) or more")
    return None


def _vision(c) -> str | None:
    """A vision-language policy (a tower from scratch, model.vision_depth > 0, or a
    Qwen2.5-VL model.path): the settings its training passes carry images with
    (docs/vision.md, "Training")."""
    from hfjax.config.model_source import vision_language

    m, a, r = c.model, c.actor, c.rollout
    if m.vision_depth and m.path:
        return ("model.vision_depth builds a vision tower beside a language model from scratch; "
                "with model.path set (a Qwen2.5-VL path brings its own tower) set "
                "--config.model.vision_depth=0")
    loaded = vision_language(c)
    if not m.vision_depth and loaded is None:
        if c.data.task == "shapes":
            return ("data.task='shapes' shows the policy pictures, and the model is text-only; "
                    "set --config.model.vision_depth (e.g. 2) or a Qwen2.5-VL model.path")
        if c.data.blank_images:
            return ("data.blank_images=True blanks a vision-language policy's pictures, and "
                    "the model is text-only; unset it")
        return None
    heads = loaded.vision.num_heads if loaded is not None else m.vision_num_heads
    if not a.freeze_vision and a.lora.rank > 0:
        return ("actor.freeze_vision=False with actor.lora.rank > 0 trains no vision tower "
                "(adapters go on the language model only); set --config.actor.freeze_vision="
                "True or --config.actor.lora.rank=0")
    if loaded is None and (m.vision_hidden_size % m.vision_num_heads
                           or (m.vision_hidden_size // m.vision_num_heads) % 4):
        return (f"model.vision_hidden_size={m.vision_hidden_size} / vision_num_heads="
                f"{m.vision_num_heads} must give a head_dim divisible by 4 (2-D rotary)")
    for key, text in (("actor.mesh", a.mesh), ("rollout.mesh", r.mesh)):
        tensor = dict(i.split("=") for i in text.replace(" ", "").split(",") if "=" in i
                      ).get("tensor", "1")
        if int(tensor) > 1 and heads % int(tensor):
            return (f"{key}={text!r} splits the vision tower's heads {tensor} ways, which does "
                    f"not divide its {heads} heads; use a tensor size that divides it")
    rows = [k for k, on in (("actor.use_remove_padding", a.use_remove_padding),
                            ("actor.group_by_length", a.group_by_length),
                            ("critic.use_remove_padding", c.critic.use_remove_padding),
                            ("critic.group_by_length", c.critic.group_by_length),
                            ("actor.share_prompt", a.share_prompt and r.n > 1),
                            ("rollout.mode='continuous'", r.mode == "continuous"),
                            ("rollout.multi_turn.enable", r.multi_turn.enable),
                            ("a rollout pool of its own (async_rollout)", _rollout_pool(c)))
            if on]
    if rows:
        return (f"a vision-language policy: rows with images are built for padded rows and "
                f"static rollouts only; turn off {', '.join(rows)}")
    return None


def _rollout_pool(c) -> bool:
    """Whether the placement gives the rollout a pool of its own (an asynchronous run)."""
    from hfjax.controller.async_pools import rollout_pool_name

    a = c.get("async_rollout")
    return a is not None and rollout_pool_name(placement_of(c), a.max_staleness) is not None


def _expert_axis(c) -> str | None:
    """An `expert` mesh axis must divide the actor's experts (a dense model takes it as one
    more data-parallel axis)."""
    from hfjax.parallel.mesh import MeshSpec

    sizes = dict(MeshSpec.parse(c.actor.mesh).sizes) if c.actor.get("mesh") else {}
    ep = sizes.get("expert", 1)
    if ep <= 1:
        return None
    if c.model.path:
        from hfjax.models.hf_io import read_model_config

        experts = read_model_config(c.model.path).num_experts
    else:
        experts = c.model.num_experts
    if experts and experts % ep:
        return (f"actor.mesh={c.actor.mesh!r}: expert={ep} does not divide the model's "
                f"{experts} experts; pick an expert size that divides {experts}")
    return None


def _positions(c) -> str | None:
    """Whether the policy and the reward and cost models (each a path) hold a whole sequence:
    the longest prompt plus the longest response, in positions."""
    need = c.data.max_prompt_length + c.rollout.response_length
    for key in ("model", "reward_model", "cost_model"):
        section = c.get(key)
        path = section.get("path", "") if section is not None else ""
        if not path:
            continue  # none, or a model from scratch (sized to hold them)
        try:
            limit = _max_positions(path)
        except (OSError, ValueError, KeyError) as err:
            return f"{key}.path={path!r}: cannot read its config ({err})"
        if need > limit:
            return (f"data.max_prompt_length + rollout.response_length = {need} positions, more "
                    f"than {key}.path's max_position_embeddings={limit}; shorten them, or use "
                    f"a model with a longer context")
    return None


def _max_positions(path: str) -> int:
    """The max_position_embeddings of a preset, a .gguf file or an HF model directory."""
    from hfjax.models import qwen2_5_vl
    from hfjax.models.config import ModelConfig

    vl = qwen2_5_vl.read_config(path)
    if vl is not None:
        return vl.text.max_position_embeddings
    if path.startswith("preset:"):
        from hfjax.models import presets

        return presets.get_preset(presets.preset_name(path)).max_position_embeddings
    if path.endswith(".gguf"):
        from hfjax.models.gguf_io import read_gguf_config

        hf = read_gguf_config(path)
    else:
        with open(os.path.join(path, "config.json")) as f:
            hf = json.load(f)
    return ModelConfig.from_hf_config(hf).max_position_embeddings


def _adaptive_kl(c) -> str | None:
    k = c.algo.kl_ctrl
    if k.type == "adaptive" and not c.algo.use_kl_in_reward:
        return ("algo.kl_ctrl.type='adaptive' adapts the KL-in-reward coefficient, and "
                "algo.use_kl_in_reward=False; set it to True or use type 'fixed'")
    return None


def _slot_cache(c) -> str | None:
    r = c.rollout
    need = c.data.max_prompt_length + r.response_length
    if r.mode == "continuous" and r.max_cache_len and r.max_cache_len < need:
        return (f"rollout.max_cache_len={r.max_cache_len} cache columns per slot cannot hold a "
                f"request of data.max_prompt_length + rollout.response_length = {need} tokens; "
                f"set --config.rollout.max_cache_len={need} or more, or 0 (no limit)")
    return None


def _token_budget(c) -> str | None:
    need = c.data.max_prompt_length + c.rollout.response_length
    for role, key, zero in (("actor", "ppo_max_token_len_per_gpu", "ppo_micro_batch_size"),
                            ("critic", "ppo_max_token_len_per_gpu", "ppo_micro_batch_size"),
                            ("cost_critic", "ppo_max_token_len_per_gpu", "ppo_micro_batch_size"),
                            ("reward_model", "forward_max_token_len_per_gpu", None),
                            ("cost_model", "forward_max_token_len_per_gpu", None)):
        s = c.get(role)
        if s is None or key not in s:
            continue
        budget = s[key]
        if s.use_remove_padding and budget and budget < need:
            zero = f"{role}.{zero} padded rows' worth" if zero else "the whole batch's tokens"
            return (f"{role}.{key}={budget} tokens is smaller than one sequence "
                    f"(data.max_prompt_length + rollout.response_length = {need}); set "
                    f"--config.{role}.{key}={need} or more, or 0 ({zero})")
    return None


def _one_length_layout(c) -> str | None:
    for role in ("actor", "critic", "cost_critic"):
        s = c.get(role)
        if s is not None and s.get("group_by_length") and s.get("use_remove_padding"):
            return (f"{role}.group_by_length and {role}.use_remove_padding both cut micro-batches "
                    f"to real tokens (grouped padded rows vs packed rows); set one of them to "
                    f"False, e.g. --config.{role}.use_remove_padding=False")
    return None


def _rollout_correction(c) -> str | None:
    r = c.algo.get("rollout_correction")
    if r is None:
        return None
    if r.bypass_mode and r.rollout_is in rc_numerics.IS_LEVELS:
        return (f"algo.rollout_correction.bypass_mode=True with rollout_is={r.rollout_is!r}: "
                "the clipped ratio is taken against the sampler's log-probs, so it already is "
                "the importance ratio and weights would count it twice (verl applies none "
                "there); set rollout_is=none (rejection, rollout_rs, still works) or "
                "bypass_mode=False")
    if r.rollout_rs not in ("", rc_numerics.NONE):
        upper = r.rollout_rs_threshold or r.rollout_is_threshold
        lower = r.rollout_rs_threshold_lower or 1.0 / upper
        if not lower < upper:
            return (f"algo.rollout_correction: the rejection interval [{lower:g}, {upper:g}] "
                    "is empty; set rollout_rs_threshold_lower below rollout_rs_threshold")
    return None


def _async_rollout(c) -> str | None:
    a = c.get("async_rollout")
    if a is None:
        return None
    from hfjax.controller.async_pools import rollout_pool_name, rollout_pool_problem

    k = a.max_staleness
    if a.push_every > k + 1:
        return (f"async_rollout.push_every={a.push_every} leaves samples more than "
                f"max_staleness={k} updates old; set --config.async_rollout.push_every <= "
                f"{k + 1}")
    problem = rollout_pool_problem(placement_of(c), k)
    if problem:
        return problem
    pool = rollout_pool_name(placement_of(c), k)
    if a.partial_rollout:
        if k < 1 or pool is None:
            return ("async_rollout.partial_rollout=True continues rows under weights pushed "
                    "while they decode, and the synchronous loop pushes none; set "
                    "--config.async_rollout.max_staleness=1 or more (on a placement with a "
                    "rollout pool), or partial_rollout=False")
        if a.push_every > k:
            return (f"async_rollout.partial_rollout=True with push_every={a.push_every} = "
                    f"max_staleness + 1 never has a newer version within the bound to continue "
                    f"under; set --config.async_rollout.push_every <= {k}")
        if c.rollout.response_length < 2:
            return ("async_rollout.partial_rollout=True cuts responses halfway, and "
                    f"rollout.response_length={c.rollout.response_length} has no middle; set "
                    "--config.rollout.response_length=2 or more")
    if pool is None:
        return None
    for bad, fix in ((c.actor.lora.rank, "actor.lora.rank=0"),
                     (c.rollout.multi_turn.enable, "rollout.multi_turn.enable=False"),
                     (c.algo.filter_groups.enable, "algo.filter_groups.enable=False")):
        if bad:
            return (f"a rollout pool of its own (async_rollout) does not run with "
                    f"{fix.split('=')[0]} yet; set --config.{fix}, or use a placement without "
                    "one and max_staleness=0")
    return None


def _tools_build(c) -> str | None:
    """The multi-turn tools are built here, once, with their settings: a tool that refuses (the
    python tool where its jail cannot start), or that the ToolRunner's worker processes cannot
    receive, stops the run before anything compiles."""
    m = c.rollout.multi_turn
    if not m.enable or not m.tools:
        return None
    from hfjax.engine.spec import MultiTurnSpec
    from hfjax.tools import resolve_tools
    from hfjax.tools.worker import tool_reference

    try:
        for key, tool in resolve_tools(m.tools, MultiTurnSpec.of(m).tool_options()).items():
            tool_reference(key, tool, "run")  # the runner's worker processes can receive it
    except ValueError as err:
        return f"rollout.multi_turn.tools={m.tools!r}: {err}"
    return None


TRAIN_RULES: tuple[Callable[[Any], str | None], ...] = (
    _selected_models,
    _estimator_inputs,
    _group_needs_samples,
    _algorithm_settings,  # before the generic KL rule: its message is the algorithm's own
    _kl_needs_a_reference,
    _score_models,
    _data_files,
    _warm_start_needs_arith,
    _chain_task,
    _sft_micro_batches,
    _arith_sizes,
    _mini_batches_fit,
    _scratch_model,
    _vision,
    _expert_axis,
    _adaptive_kl,
    _positions,
    _slot_cache,
    _token_budget,
    _one_length_layout,
    _rollout_correction,
    _async_rollout,
    _tools_build,
)


def placement_of(cfg):
    """The config's placement: a mode name or a plain {pool: {size, roles}} mapping."""
    p = cfg.placement
    return p.to_dict() if hasattr(p, "to_dict") else p


def active_roles(algo, cfg=None) -> tuple[str, ...]:
    """The roles that get a pool: the algorithm's, plus those `cfg` selects (`run_roles`)."""
    return algo.roles if cfg is None else run_roles(algo, cfg)
