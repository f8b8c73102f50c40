"""RL algorithms: shared numerics (core), advantage estimators, losses, and the registered
dataflow drivers (ppo, grpo)."""

from hfjax.algorithms import advantages, losses  # noqa: F401  (registration on import)
