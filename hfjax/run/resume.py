"""Resuming a run: what a checkpoint holds (`checkpoint_items`: the arrays of the trained
worker groups; `host_state`: the JSON state of the loop) and how it is installed again
(`load_state`); whether `trainer.resume` resumes from what a run directory holds, read
from the checkpoints' JSON before anything is built (`check_resume`), and the config as the
JSON a checkpoint stores (`config_json`)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from hfjax.models import qwen2_5_vl
from hfjax.numerics.losses import (
    LagrangeMultiplier,
    kl_controller_from_state,
    kl_controller_state,
)
from hfjax.run import checkpoint as ckpt_lib
from hfjax.workers import lora_state
from hfjax.workers.actor import BaseReference
from hfjax.workers.groups import WorkerGroups


def check_resume(cfg, ckpt: ckpt_lib.RunCheckpointer | None, mode: str = "auto") -> bool:
    """Whether `trainer.resume` resumes (see `checkpoint.resume_source`), reading only the
    checkpoints' JSON; raises before anything is built, restored or written when the setting
    contradicts what `ckpt` holds, or when the checkpoint to resume was saved by another
    algorithm (CheckpointMismatch)."""
    plan = ckpt_lib.resume_source(ckpt, mode)
    if plan is None:
        return False
    source, step = plan
    for s in [step] if step is not None else reversed(source.steps()):
        try:
            _, saved = source.read_json(s)
        except ckpt_lib.CheckpointCorrupt:
            continue  # restore_latest passes over it (or says that none is readable)
        algo = saved.get("algorithm")
        if algo and algo != cfg.algorithm:
            out_dir = os.path.dirname(source.directory)
            raise ckpt_lib.CheckpointMismatch(
                f"{source.step_dir(s)} was saved by a {algo!r} run and this config runs "
                f"{cfg.algorithm!r}; resume it with the config it was started with (saved in "
                f"{source.step_dir(s)}/config), or start a new run: "
                f"--config.trainer.out_dir={out_dir}-{cfg.algorithm}")
        break
    return True


def config_json(cfg) -> dict:
    """The resolved config as plain JSON data."""
    return json.loads(cfg.to_json_best_effort(sort_keys=True))


def trained_groups(w: WorkerGroups) -> dict[str, Any]:
    """The groups that take updates (and so have optimizer state to save)."""
    pairs = [("actor", w.actor), ("critic", w.critic), ("cost_critic", w.cost_critic)]
    pairs += [(k, g) for k, g in w.roles.items() if getattr(g, "opt_state", None)]
    return {name: g for name, g in pairs if g is not None}


def lora_base_path(cfg) -> str | None:
    """The path a LoRA run's checkpoint names its frozen base by: `model.path` when RL starts
    from that file as it is; None (the checkpoint holds the base) when the model comes from
    scratch or from this run's warm start."""
    return None if not cfg.model.path or cfg.sft.steps > 0 else cfg.model.path


def checkpoint_items(w: WorkerGroups, cfg) -> dict[str, Any]:
    """The arrays a checkpoint holds: params and optimizer state of each trained group, and
    the reference's params (saved rather than rebuilt: they are the warm-started actor's)
    unless the reference is the LoRA actor's own base."""
    if w.actor.trainable is not None:
        # LoRA: the adapters and their optimizer state, plus the base only when no path names
        # it (`hfjax.workers.lora_state`).
        items = lora_state.items(w.actor, lora_base_path(cfg))
    else:
        items = {"actor_params": w.actor.params, "actor_opt_state": w.actor.opt_state}
    tower = w.actor.tower
    if tower is not None and not tower.trains:  # a frozen tower: the export needs it
        items["actor_vision"] = tower.frozen
    if w.ref is not None and not isinstance(w.ref, BaseReference):
        items["ref_params"] = w.ref.params
    for name, g in trained_groups(w).items():
        if name != "actor":
            items[f"{name}_params"] = g.params
            items[f"{name}_opt_state"] = g.opt_state
    return items


def host_state(w: WorkerGroups, cfg, *, step: int, data: dict, model_cfg) -> dict:
    """The loop's JSON state at `step`: the data cursor, the KL and Lagrange controllers, the
    update programs' call counts (they seed mini-batch shuffles), the model's config and, with
    LoRA, the base model's name and fingerprint."""
    return {
        "step": step,
        "seed": cfg.seed,
        "data": data,
        "kl_ctrl": kl_controller_state(w.kl_ctrl),
        "lagrange": None if w.lagrange is None else w.lagrange.state(),
        "train_calls": {name: g._train_calls for name, g in trained_groups(w).items()},
        "model_config": dataclasses.asdict(model_cfg),
        **({"vision": {"config": qwen2_5_vl.config_record(w.actor.vl),
                       "frozen": not w.actor.tower.trains}} if w.actor.vl is not None else {}),
        **({"lora": lora_state.state(w.actor, lora_base_path(cfg), ckpt_lib.fingerprints)}
           if w.actor.trainable is not None else {}),
    }


def load_state(w: WorkerGroups, restored: ckpt_lib.Restored, train_iter) -> int:
    """Installs a restored checkpoint into the worker groups and the data iterator; returns
    the restored step."""
    it, st = restored.items, restored.state
    if w.actor.trainable is not None:
        problem = lora_state.install(w.actor, it, st.get("lora"), ckpt_lib.fingerprints)
        if problem:
            raise ckpt_lib.CheckpointMismatch(problem)
    else:
        w.actor.params, w.actor.opt_state = it["actor_params"], it["actor_opt_state"]
    if "actor_vision" in it:
        w.actor.tower.frozen = it["actor_vision"]
    if w.ref is not None and not isinstance(w.ref, BaseReference):
        w.ref.params = it["ref_params"]
    trained = trained_groups(w)
    for name, g in trained.items():
        if name != "actor":
            g.params, g.opt_state = it[f"{name}_params"], it[f"{name}_opt_state"]
    try:
        train_iter.restore(st["data"])
    except ValueError as err:
        raise ckpt_lib.CheckpointMismatch(str(err)) from None
    w.kl_ctrl = kl_controller_from_state(st["kl_ctrl"])
    if st.get("lagrange") is not None:
        w.lagrange = LagrangeMultiplier.from_state(st["lagrange"])
    for name, n in st["train_calls"].items():
        trained[name]._train_calls = int(n)
    return int(st["step"])
