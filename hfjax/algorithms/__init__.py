"""RL algorithms as dataflow drivers over worker groups (`ppo`, `grpo`), registered by name
(`registry`), with the stages they share (`dataflow`). The numerics they use (estimators,
losses, KL) are in `hfjax.numerics`."""
