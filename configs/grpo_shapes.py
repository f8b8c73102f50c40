"""GRPO on the embedded visual task (data.task=shapes: count the red squares in a picture): a
tiny Qwen2.5-VL-shaped policy from scratch (a 2-block vision tower, frozen by default, beside
the 2-layer decoder), warm-started on imperfect demonstrations with the pictures (70% give the
bare count, which the reward rejects: hfjax.data.shapes.sft_texts), then 8 samples per prompt
and the arithmetic task's `#### <answer>` rule reward. Held-out pictures are disjoint from
training ones by construction (hfjax.data.shapes). `--config.data.blank_images=True` is the
control: the same run with every picture white (docs/vision.md has both arms' results)."""

from configs import grpo_arith


def get_config():
    c = grpo_arith.get_config()
    c.data.task = "shapes"
    c.data.max_prompt_length = 16  # "<|vision_start|>", 4 image tokens, "<|vision_end|>", "="
    c.data.n_train = 4096
    c.data.n_test = 256
    c.data.train_batch_size = 16
    c.model.hidden_size = 64
    c.model.intermediate_size = 128
    c.model.head_dim = 16
    c.model.vision_depth = 2
    c.model.vision_hidden_size = 32
    c.model.vision_num_heads = 2
    c.sft.steps = 400
    c.sft.batch_size = 64
    c.sft.micro_batch_size = 64
    c.actor.share_prompt = False  # rows with images are scored as padded rows
    c.actor.ppo_mini_batch_size = 16
    c.actor.ppo_micro_batch_size = 128
    c.rollout.response_length = 8  # "#### 3" and the end token
    c.trainer.total_steps = 200
    c.trainer.test_freq = 50
    c.trainer.out_dir = "runs/grpo_shapes"
    return c
