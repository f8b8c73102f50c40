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
    # The cost model (sign term) scores answers with a 7 at about +8.8 and the others at about
    # -8.6 (measured on 800 answers), so the mean cost is about -8.6 + 17.4 p for a share p of
    # costly answers. The SFT policy writes a 7 in ~19% of its answers (mean cost ~ -5.3);
    # the threshold -7.0 asks for p <= ~9%.
    c.algo.safe_rlhf.cost_threshold = -7.0
    c.algo.safe_rlhf.lambda_init = 0.5
    c.algo.safe_rlhf.lambda_lr = 0.05
    # Costs span about +-9: let the cost critic's values move that far within a few updates.
    c.cost_critic.cliprange_value = 5.0
    c.trainer.total_steps = 80
    c.trainer.out_dir = "runs/safe_rlhf_arith"
    return c
