"""GRPO: n samples per prompt, group-normalised outcome advantages, a KL loss, no critic; and
its variants, the same dataflow with other numerics:

- Dr.GRPO: advantages only mean-centred (no division by the group's std) and the loss summed
  over tokens divided by a constant horizon ("seq-mean-token-sum-norm"), removing GRPO's
  length and difficulty biases;
- GSPO: the PPO clip on a sequence-level importance ratio (policy_loss="gspo");
- OPD (on-policy distillation): the student samples, the teacher (its own role and pool)
  scores every sampled token, and the advantage is the per-token reverse KL alone
  (adv_estimator="distill", `hfjax.numerics.distill`); the rewards are only reported.
"""

from hfjax.algorithms.dataflow import compute_advantage, reward, sample
from hfjax.algorithms.registry import all_of, register_algorithm, requires
from hfjax.algorithms.spec import StepSpec
from hfjax.controller.batch import Batch
from hfjax.workers.groups import WorkerGroups

ROLES = ("actor", "ref", "reward")


def _distills(cfg) -> None:
    if cfg.algo.distill.coef <= 0:
        raise ValueError("algorithm 'opd' learns from the teacher's term alone: set "
                         "--config.algo.distill.coef=1.0 (configs/opd_arith.py does)")


@register_algorithm("grpo", roles=ROLES)
@register_algorithm("drgrpo", roles=ROLES, check=requires(
    "drgrpo", algo__adv_estimator="grpo", algo__norm_adv_by_std_in_grpo=False,
    actor__loss_agg_mode="seq-mean-token-sum-norm"))
@register_algorithm("gspo", roles=ROLES, check=requires(
    "gspo", algo__adv_estimator="grpo", actor__policy_loss="gspo"))
@register_algorithm("opd", roles=("actor", "teacher", "reward"), check=all_of(
    requires("opd", algo__adv_estimator="distill", actor__use_kl_loss=False,
             algo__use_kl_in_reward=False), _distills))
def grpo_step(w: WorkerGroups, batch: Batch, spec: StepSpec) -> tuple[Batch, dict]:
    """The critic-free dataflow: sample, score, the advantage of the configured estimator
    (`algo.adv_estimator`), update the actor. The REINFORCE family runs it too
    (`hfjax.algorithms.reinforce`): its algorithms differ from GRPO in the estimator alone."""
    batch = sample(w, batch, spec)
    batch = reward(w, batch, spec)
    batch, metrics = w.run("adv", compute_advantage, batch, spec, w.kl_ctrl.value)
    metrics |= w.run("update_actor", w.actor.update_actor, batch)
    return batch, metrics
