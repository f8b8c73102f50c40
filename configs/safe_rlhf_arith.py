"""Safe-RLHF on the embedded arithmetic task: PPO from the SFT policy against the learned reward
model, constrained by a learned cost model that scores answers writing the forbidden digit 7
above 0 (configs/cost_arith.py). The Lagrange multiplier grows while the batch's mean cost is
above the threshold; being both right and cheap is impossible for the ~19% of problems whose
answer contains a 7, so the policy must trade reward for cost there.
scripts/safe_rlhf_arith.sh trains the SFT policy, the reward model and the cost model first."""

from configs import ppo_arith


def get_config():
    c = ppo_arith.get_config()
    c.algorithm = "safe_rlhf"
    c.algo.adv_estimator = "safe_rlhf"
    c.model.path = "runs/rlhf_arith/sft/hf"
    c.sft.steps = 0
    c.reward_model.path = "runs/rlhf_arith/rm/hf"
    c.cost_model.path = "runs/rlhf_arith/cost/hf"
    c.cost_model.reference_fn = "hfjax.data.arith:forbidden_digit_cost"
    c.reward.rule_weight = 0.0
    c.algo.safe_rlhf.cost_threshold = -2.0
    c.algo.safe_rlhf.lambda_init = 0.5
    c.algo.safe_rlhf.lambda_lr = 0.05
    c.trainer.out_dir = "runs/safe_rlhf_arith"
    return c
