"""RL numerics: pure jnp functions registered by name.

- `core`: the registries, masked statistics, log-probs and entropy from logits, loss aggregation;
- `advantages`: advantage estimators (GAE, GRPO, RLOO, REINFORCE++, ReMax, Safe-RLHF) over
  `AdvantageInputs`;
- `losses`: policy losses over `PolicyLossInputs`, the value loss, the pairwise (Bradley–Terry)
  loss of reward and cost models, KL penalties, the KL coefficient controllers and Safe-RLHF's
  Lagrange multiplier;
- `shaping`: DAPO's overlong penalty and dynamic-sampling rule, scores placed on last tokens.

Importing the package registers every estimator, loss and KL penalty, so a driver or worker
looks them up by the config's name (``ADV_ESTIMATORS.get(cfg.algo.adv_estimator)``). A new
estimator or loss registers itself the same way from any module.
"""

from hfjax.numerics import advantages, distill, losses, shaping  # noqa: F401  (registration)
from hfjax.numerics.advantages import AdvantageInputs
from hfjax.numerics.core import ADV_ESTIMATORS, KL_PENALTIES, LOSS_AGG_MODES, POLICY_LOSSES
from hfjax.numerics.losses import PolicyLossInputs

__all__ = [
    "ADV_ESTIMATORS",
    "KL_PENALTIES",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "AdvantageInputs",
    "PolicyLossInputs",
]
