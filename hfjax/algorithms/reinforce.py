"""The REINFORCE family, critic-free like GRPO but with the KL folded into the reward:

- RLOO: each sample's baseline is the mean score of the other samples of its prompt;
- REINFORCE++: the discounted return-to-go whitened over the batch (one sample per prompt is
  enough);
- REINFORCE++-baseline: the score minus its prompt's mean, whitened over the batch.

Each runs GRPO's dataflow (`grpo.grpo_step`) with its own advantage estimator, which its check
requires of the config.
"""

from hfjax.algorithms.grpo import ROLES, grpo_step
from hfjax.algorithms.registry import register_algorithm, requires

for _name in ("rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
    register_algorithm(_name, roles=ROLES,
                       check=requires(_name, algo__adv_estimator=_name))(grpo_step)
