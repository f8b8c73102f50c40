"""Dr.GRPO on the embedded arithmetic task: GRPO's dataflow with mean-centred advantages (no
division by the group's std) and a loss summed over tokens and divided by the fixed response
length, so neither long responses nor easy prompts weigh differently."""

from configs import grpo_arith


def get_config():
    c = grpo_arith.get_config()
    c.algorithm = "drgrpo"
    c.algo.norm_adv_by_std_in_grpo = False
    c.actor.loss_agg_mode = "seq-mean-token-sum-norm"
    c.trainer.out_dir = "runs/drgrpo_arith"
    return c
