"""The HybridFlow paper's PPO workload (§8): actor, critic, reference and reward model of one
size, 1024 prompts of 1024 tokens and 1024-token responses per step, 8 mini-batches of 128.

A planning config: `python -m launch.plan` sizes it for a cluster, e.g.

    python -m launch.plan --config=configs/hybridflow_paper.py \\
        --config.model.path=preset:llama2-7b --target=a100-80gb --num_devices=16

`model.path` names the size (preset:llama2-7b, preset:llama2-13b, preset:codellama-34b); the
reward model follows it unless `reward_model.path` is set. hfjax's precision policy: float32
master weights and Adam, bfloat16 compute, remat of every layer; the frozen reward model in
bfloat16. The paper's systems score in micro-batches and decode in pages, which hfjax's runs
do not (they score the whole batch in one call and preallocate every row's cache), so the
planner models them here (`plan.score_micro`, `plan.gen_rows`); the tests of the paper's
findings (tests/planner/test_search.py) read this file.
"""

from configs import ppo_arith


def get_config():
    c = ppo_arith.get_config()
    c.model.path = "preset:llama2-7b"
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "float32"
    c.model.remat_policy = "full"
    # The same size as the actor; a derived reference, so that setting reward_model.path on
    # the command line replaces it without changing model.path.
    c.reward_model.path = c.model.get_ref("path") + ""
    c.reward_model.dtype = "bfloat16"
    c.reward.rule_weight = 0.0
    c.reward.model_weight = 1.0
    c.sft.steps = 0
    c.data.train_batch_size = 1024
    c.data.max_prompt_length = 1024
    c.rollout.response_length = 1024
    c.rollout.n = 1
    c.actor.ppo_mini_batch_size = 128  # prompts: 8 updates per step
    c.actor.ppo_micro_batch_size = 128  # sequences
    c.critic.ppo_mini_batch_size = 128
    c.critic.ppo_micro_batch_size = 128
    c.plan.score_micro = 128
    c.plan.gen_rows = -1
    c.trainer.out_dir = "runs/hybridflow_paper"
    return c
