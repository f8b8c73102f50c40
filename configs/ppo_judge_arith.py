"""PPO on the embedded arithmetic task against a generative judge alone (reward.rule_weight=0;
held-out accuracy is still scored by the exact-answer rule, which the policy never sees). The
judge is configs/sft_judge_arith.py's, reading "a+b=" + the answer + "==" and writing the right
answer, then 1 or 0;
validation reports how often it agrees with the rule (val-aux/judge_agreement/mean).
docs/algorithms.md gives the commands."""

from configs import ppo_arith
from hfjax.data import arith


def get_config():
    c = ppo_arith.get_config()
    c.reward.rule_weight = 0.0
    c.reward.judge_weight = 1.0
    j = c.reward.judge
    j.path = "runs/judge_arith/judge/hf"
    j.template = arith.JUDGE_TEMPLATE
    j.parser = arith.JUDGE_PARSER  # the verdict after the judge's own answer
    j.max_verdict_tokens = 6  # up to 3 digits and a sign, a space, the verdict
    j.default_score = 0.0
    c.trainer.out_dir = "runs/judge_arith/ppo"
    return c
