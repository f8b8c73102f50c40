"""DAPO on the embedded arithmetic task: 8 samples per prompt; clip-higher (0.2 / 0.28);
dynamic sampling (groups whose samples all score the same are dropped and more prompts are
generated, at most 10 generation batches per step); a token-mean loss; overlong shaping
(responses longer than 12 - 3 = 9 tokens lose up to 1.0; the longest answer, "#### 108" and
EOS, is 9 tokens); no KL term, so no reference model."""

from configs import grpo_arith


def get_config():
    c = grpo_arith.get_config()
    c.algorithm = "dapo"
    c.algo.adv_estimator = "grpo"
    c.actor.use_kl_loss = False
    c.algo.use_kl_in_reward = False
    c.actor.clip_ratio_low = 0.2
    c.actor.clip_ratio_high = 0.28
    c.actor.loss_agg_mode = "token-mean"
    c.rollout.response_length = 12
    c.algo.filter_groups.enable = True
    c.algo.filter_groups.max_num_gen_batches = 10
    c.algo.filter_groups.on_exhausted = "fill"
    c.algo.overlong_buffer.enable = True
    c.algo.overlong_buffer.len = 3
    c.algo.overlong_buffer.penalty_factor = 1.0
    c.trainer.out_dir = "runs/dapo_arith"
    return c
