"""A run config as the planner sees it, and a plan as config overrides.

`plan_inputs` reads the models (the actor from `model.*`, the critic and the reference where the
algorithm and its KL terms need them, a reward model when one is named), the roles scored on the
host, and the step's shape (`hfjax.controller.simulator.Workload`, with the sampler's buckets)
from a config, without loading any weights. `flagfile_lines` writes a plan as an absl flagfile
that `launch.train --flagfile=...` runs unchanged.
"""

from __future__ import annotations

import json
import os

from hfjax.algorithms.registry import get_algorithm
from hfjax.controller.costs import ModelSpec
from hfjax.controller.simulator import Workload
from hfjax.data import arith
from hfjax.engine.sampler import MIN_NEW_TOKENS_BUCKET, MIN_PROMPT_BUCKET, bucket_size
from hfjax.models import gguf_io
from hfjax.models.config import ModelConfig
from hfjax.models.presets import get_preset, preset_name
from hfjax.workers.groups import needs_ref, scratch_model_config


def model_config(cfg):
    """The actor's ModelConfig as the trainer will build it, without loading weights."""
    m = cfg.model
    if not m.path:
        tok = arith.tokenizer()
        positions = cfg.data.max_prompt_length + cfg.rollout.response_length
        return scratch_model_config(m, tok.vocab_size, tok.pad_id, tok.eos_id, positions)
    return load_config(m.path, param_dtype=m.dtype, dtype=m.dtype,
                       scan_layers=m.scan_layers, remat_policy=m.remat_policy)


def load_config(path: str, **overrides):
    """A ModelConfig from a preset name, an HF directory or a .gguf file (metadata only)."""
    if (name := preset_name(path)) is not None:
        return get_preset(name).replace(**overrides)
    if str(path).endswith(".gguf"):
        return ModelConfig.from_hf_config(gguf_io.read_gguf_config(path), **overrides)
    config = os.path.join(path, "config.json")
    if not os.path.exists(config):
        raise FileNotFoundError(f"{path}: not a preset:NAME, an HF directory with config.json "
                                "or a .gguf file")
    with open(config) as f:
        return ModelConfig.from_hf_config(json.load(f), **overrides)


def plan_inputs(cfg, reward_model: str = "", score_micro: int = 0, gen_rows: int = 0):
    """(models, host roles, workload) of the run a config describes."""
    algo = get_algorithm(cfg.algorithm)
    actor_cfg = model_config(cfg)
    name = cfg.model.path or "scratch model"
    models = [ModelSpec("actor", actor_cfg, "causal_lm", True, f"actor {name}")]
    if "critic" in algo.roles:
        models.append(ModelSpec("critic", actor_cfg, "value", True, f"critic {name}"))
    host = []
    if needs_ref(cfg, algo.roles):
        models.append(ModelSpec("ref", actor_cfg, "causal_lm", False, f"ref {name}"))
    elif "ref" in algo.roles:
        # No KL term reads it, so the run builds no reference; the placement still names the
        # role, on the actor's pool.
        host.append("ref")
    if "reward" in algo.roles:
        if reward_model:
            m = cfg.model
            rcfg = load_config(reward_model, param_dtype=m.dtype, dtype=m.dtype,
                               scan_layers=m.scan_layers, remat_policy=m.remat_policy)
            models.append(ModelSpec("reward", rcfg, "score", False, f"reward {reward_model}"))
        else:
            host.append("reward")
    a, c, r, n = cfg.actor, cfg.get("critic"), cfg.rollout, cfg.rollout.n
    s = cfg.data.train_batch_size * n
    single = a.ppo_epochs == 1 and a.ppo_mini_batch_size * n == s
    workload = Workload(
        prompts=cfg.data.train_batch_size, n=n,
        prompt_len=bucket_size(cfg.data.max_prompt_length, MIN_PROMPT_BUCKET),
        response_len=bucket_size(r.response_length, MIN_NEW_TOKENS_BUCKET),
        actor_mini=a.ppo_mini_batch_size * n, actor_micro=a.ppo_micro_batch_size,
        actor_epochs=a.ppo_epochs,
        critic_mini=c.ppo_mini_batch_size * n if "critic" in algo.roles else 0,
        critic_micro=c.ppo_micro_batch_size if "critic" in algo.roles else 0,
        critic_epochs=c.ppo_epochs if "critic" in algo.roles else 1,
        old_log_prob=bool(cfg.algo.use_kl_in_reward) or not single,
        score_micro=score_micro, gen_rows=gen_rows,
    )
    return models, tuple(host), workload


def flagfile_lines(plan, cfg, config_path: str, argv) -> tuple[list[str], list[str]]:
    """(the flagfile's lines, plan keys the config has no field for)."""
    lines = [f"# hfjax plan: {plan.mode}, estimated {plan.iteration_s:.4g} s per step",
             f"--config={config_path}"]
    # The user's own overrides first, so the plan's settings win where both name a key.
    lines += [a for a in argv[1:] if a.startswith("--config.")]
    missing = []
    for key, value in plan.overrides().items():
        if not _has_key(cfg, key):
            missing.append(key)
            continue
        text = str(value).lower() if isinstance(value, bool) else str(value)
        lines.append(f"--config.{key}={text}")
    return lines, missing


def _has_key(cfg, key: str) -> bool:
    node = cfg
    for part in key.split("."):
        if not hasattr(node, "keys") or part not in node.keys():
            return False
        node = node[part]
    return True
