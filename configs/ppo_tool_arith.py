"""PPO with a GAE critic and a calculator: `configs/grpo_tool_arith.py`'s task, warm start and
multi-turn rollouts (products of 3- and 4-digit numbers the embedded tiny model cannot work out
in its head), trained with PPO instead of GRPO.

The critic starts from the warm-started policy's trunk with a zero value head and learns the
value of each policy token; the calculator's results in a trajectory are context for both
models, not steps: GAE skips them, carrying the value bootstrap and the running advantage from
one policy turn to the one before (docs/algorithms.md, "Multi-turn credit"). The score sits on
the last policy token. A KL penalty against the warm start goes into the reward, as in
`configs/ppo_arith.py`. Results and command: docs/algorithms.md.
"""

from configs import grpo_tool_arith


def get_config():
    c = grpo_tool_arith.get_config()
    c.algorithm = "ppo"
    c.algo.adv_estimator = "gae"
    c.algo.use_kl_in_reward = True
    c.actor.use_kl_loss = False
    # The critic sees the same 16 x 8 = 128 trajectories per step, in one update.
    c.critic.ppo_mini_batch_size = 16
    c.critic.ppo_micro_batch_size = 128
    c.trainer.out_dir = "runs/ppo_tool_arith"
    return c
