"""What a checkpoint of a LoRA actor holds, and how it is put back.

A LoRA run's checkpoint holds the adapters (`actor_params`) and their optimizer state
(`actor_opt_state`), never a second copy of the model. The frozen base is named instead:
- by `model.path` when RL starts from that file as it is (no warm start): the checkpoint
  stores the path and a fingerprint of every base array, and a resume loads the base from the
  path again and refuses to go on if its fingerprint changed;
- by the checkpoint itself when this run made the base (a model from scratch, or a warm
  start): then the base is saved too (`actor_base`), as a full run saves its reference.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from flax import nnx

from hfjax.models import lora
from hfjax.workers.base import WorkerGroup

Fingerprints = Callable[[Mapping[str, Any]], dict[str, int]]


def items(actor: WorkerGroup, base_path: str | None) -> dict[str, Any]:
    """The checkpoint items of a LoRA actor: adapters, their optimizer state, and the base
    when no path names it (`base_path` None: the checkpoint holds it)."""
    out = {"actor_params": actor.trainable_params(), "actor_opt_state": actor.opt_state}
    if base_path is None:
        out["actor_base"] = actor.base_params()
    return out


def base_fingerprints(actor: WorkerGroup, fingerprints: Fingerprints) -> dict[str, int]:
    """{array name: fingerprint} of the actor's base (computed once: the base is frozen)."""
    if getattr(actor, "_base_fingerprints", None) is None:
        actor._base_fingerprints = fingerprints(lora.leaf_names(actor.base_params()))
    return actor._base_fingerprints


def state(actor: WorkerGroup, base_path: str | None, fingerprints: Fingerprints) -> dict:
    """The JSON record of the adapters' settings and of the base they adapt (loaded from
    `base_path`, or saved in the checkpoint when it is None)."""
    return {"spec": actor.lora.as_dict(),
            "base": {"path": base_path, "saved": base_path is None,
                     "fingerprints": base_fingerprints(actor, fingerprints)}}


def install(actor: WorkerGroup, items: Mapping[str, Any], record: Mapping[str, Any] | None,
            fingerprints: Fingerprints) -> str | None:
    """Puts restored adapters, optimizer state (and base, when saved) into `actor`. Returns
    the problem when the checkpoint does not fit this run (no LoRA record, other adapter
    settings, or a base whose fingerprint changed), else None."""
    if record is None:
        return ("the checkpoint was saved without LoRA adapters; resume it with "
                "actor.lora.rank=0 or start afresh (--config.trainer.resume=disable)")
    if record["spec"] != actor.lora.as_dict():
        return (f"the checkpoint's adapters are {record['spec']}, this run's "
                f"{actor.lora.as_dict()}; resume with the same actor.lora settings")
    base = items["actor_base"] if record["base"]["saved"] else actor.base_params()
    if not record["base"]["saved"]:
        now = base_fingerprints(actor, fingerprints)
        if now != record["base"]["fingerprints"]:
            return (f"the base model at {record['base']['path']} is not the one the adapters "
                    "were trained on (its weights' fingerprints differ); resume with the "
                    "original base weights")
    actor.params = nnx.merge_state(items["actor_params"], base)
    actor.opt_state = items["actor_opt_state"]
    if record["base"]["saved"]:
        actor._base_fingerprints = None
    return None
