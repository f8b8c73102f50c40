"""What a step's metrics say about the run's health, read from the metrics the step fetches
anyway (no extra host round trip):

- updates that were not applied because the loss or gradient norm went NaN or infinite
  (`hfjax.engine.update` refuses them on the device): `trainer.nonfinite=stop` ends the run with
  `NonFiniteError`, naming the stage and the step; `skip` lets it go on, counting them in
  `<role>/nonfinite_updates`;
- an update with a finite gradient that left a parameter non-finite (`<role>/nonfinite_params`):
  it cannot be taken back, so the run ends whatever `trainer.nonfinite` says;
- a policy near uniform: its mean token entropy near log(vocab), `health/near_uniform_policy`
  = 1. An untrained model starts there; a policy that was not and becomes so has collapsed, and
  the trainer warns once when that happens.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from absl import logging

# {count metric: (stage, its loss metric, the config section whose lr drives it)}
NONFINITE = {
    "sft/nonfinite_updates": ("the warm start (sft)", "sft/loss", "sft"),
    "critic/nonfinite_updates": ("update_critic", "critic/vf_loss", "critic"),
    "actor/nonfinite_updates": ("update_actor", "actor/pg_loss", "actor"),
    "cost_critic/nonfinite_updates": ("update_cost_critic", "cost_critic/vf_loss",
                                      "cost_critic"),
}
ENTROPY_KEY = "actor/token_entropy"
UNIFORM_KEY = "health/near_uniform_policy"
# A policy whose mean token entropy is this share of log(vocab) samples nearly uniformly.
COLLAPSE_SHARE = 0.9


class NonFiniteError(RuntimeError):
    """Non-finite numbers that end the run (see the module docstring)."""


def params_key(key: str) -> str:
    """The `<role>/nonfinite_params` flag next to a `<role>/nonfinite_updates` count."""
    return key.replace("nonfinite_updates", "nonfinite_params")


def must_stop(metrics: Mapping[str, float], cfg) -> bool:
    """Whether `check_nonfinite` will end the run on these metrics."""
    return any(metrics.get(params_key(k)) for k in NONFINITE) or (
        cfg.trainer.nonfinite == "stop" and any(metrics.get(k) for k in NONFINITE))


def check_nonfinite(metrics: Mapping[str, float], where: str, cfg) -> int:
    """The number of updates the step did not apply; raises NonFiniteError when an applied
    update left a non-finite parameter, or when any update was refused and
    `cfg.trainer.nonfinite` is "stop". `where` names the step, e.g. "RL step 7"."""
    skipped = 0
    for key, (stage, loss_key, section) in NONFINITE.items():
        grad_key = key.replace("nonfinite_updates", "grad_norm")
        if metrics.get(params_key(key)):
            raise NonFiniteError(
                f"an update in {stage} at {where} made parameters non-finite although its "
                f"gradient was finite ({grad_key}={_fmt(metrics, grad_key)}): it cannot be "
                "taken back, so the run stops whatever trainer.nonfinite says, and no "
                f"checkpoint holds it. Lower {section}.lr (now {cfg[section].lr:g}); rerunning "
                "resumes from the newest checkpoint")
        n = int(metrics.get(key, 0))
        skipped += n
        if n and cfg.trainer.nonfinite == "stop":
            raise NonFiniteError(
                f"non-finite numbers in {stage} at {where} ({loss_key}={_fmt(metrics, loss_key)},"
                f" {grad_key}={_fmt(metrics, grad_key)}); the update was not applied and no "
                f"checkpoint holds it. Lower {section}.lr (now {cfg[section].lr:g}), or set "
                "--config.trainer.nonfinite=skip to skip such updates and go on; rerunning "
                "resumes from the newest checkpoint")
    return skipped


def near_uniform(metrics: Mapping[str, float], vocab_size: int) -> bool:
    """Whether the policy's mean token entropy is near that of a uniform distribution."""
    ent = metrics.get(ENTROPY_KEY)
    if ent is None or not math.isfinite(ent) or vocab_size < 2:
        return False
    return ent >= COLLAPSE_SHARE * math.log(vocab_size)


def _fmt(metrics: Mapping[str, float], key: str) -> str:
    v = metrics.get(key)
    return "n/a" if v is None else f"{v:.4g}"


class CollapseWatch:
    """Watches a run's steps for a policy that collapses to near-uniform sampling after it had
    peaked, and warns once (per process) when it does."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.peaked = self.reported = False

    def observe(self, metrics: Mapping[str, float], step: int) -> bool:
        """Whether the step's policy is near uniform (`near_uniform`); logs the first collapse
        after a peaked step."""
        uniform = near_uniform(metrics, self.vocab_size)
        if not uniform:
            self.peaked = True
        elif self.peaked and not self.reported:
            self.reported = True
            logging.warning("step %d: the policy collapsed: its mean token entropy %.3g is near "
                            "log(vocab) = %.3g, it samples almost uniformly; lower actor.lr",
                            step, metrics[ENTROPY_KEY], math.log(self.vocab_size))
        return uniform
