"""On-policy distillation on the embedded arithmetic task (docs/algorithms.md): a student half
the teacher's size (hidden 96, 197k weights against 396k) warm-started by the default job's SFT,
samples; the teacher, GRPO with LoRA's merged policy (python -m launch.export
--ckpt=runs/grpo_lora_arith --out=runs/grpo_lora_arith/merged --format=merged), scores every
sampled token on its own pool, and the advantage is the per-token reverse KL alone."""

from configs import grpo_arith


def get_config():
    c = grpo_arith.get_config()
    c.algorithm = "opd"
    c.algo.adv_estimator = "distill"
    c.algo.distill.coef = 1.0
    c.actor.use_kl_loss = False  # the teacher anchors the student; no reference
    c.algo.use_kl_in_reward = False
    c.teacher.path = "runs/grpo_lora_arith/merged"
    m = c.model
    m.hidden_size, m.intermediate_size, m.num_heads, m.num_kv_heads = 96, 256, 3, 1
    c.trainer.out_dir = "runs/opd_arith"
    return c
