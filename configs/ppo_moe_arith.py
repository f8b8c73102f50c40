"""The default job (PPO on the embedded arithmetic task) with a mixture-of-experts policy
trained from scratch: every layer's MLP is 8 gated experts of width 192, each token takes 2 of
them (the same active MLP width, 384, as the default job's dense model), dropless dispatch. A
small load-balancing loss (Switch form, weight 0.01) keeps every expert in use through the warm
start and RL. Results, and the same job with routing replay
(`--config.actor.router_replay=r2` or `r3`), in docs/architecture.md, "A tiny mixture of
experts learns"."""

from configs import ppo_arith


def get_config():
    c = ppo_arith.get_config()
    c.model.num_experts = 8
    c.model.num_experts_per_tok = 2
    c.model.moe_intermediate_size = 192
    c.actor.moe_aux_loss_coef = 0.01
    # A shorter warm start than the default job's 1000 steps and more RL steps than its 60: on
    # the shared 2-core CPU a sparse layer's step is about twice the dense one's, and the
    # whole job runs in under 10 minutes (docs/architecture.md).
    c.sft.steps = 800
    c.trainer.total_steps = 100
    c.trainer.test_freq = 20
    c.trainer.save_freq = 100
    c.trainer.out_dir = "runs/ppo_moe_arith"
    return c
