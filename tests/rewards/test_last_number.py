"""The reward of configs/grpo_smollm2_arith.py (configs/last_number_reward.py). The config's
GRPO steps on SmolLM2-135M-Instruct run in the smoke tier, as docs/data.md and
docs/algorithms.md show them (tests/test_documented_commands.py)."""


from configs.last_number_reward import last_number


def test_the_reward_reads_the_final_number():
    assert last_number("x", "59 + 68 = 127. So, the final answer is 127.", "127") == 1.0
    assert last_number("x", "The answer is 275.", "127") == 0.0
    assert last_number("x", "96 - 85 - 77 = -66", "-66") == 1.0
    assert last_number("x", "It is 1,270 ... #### 127\nsee 5 more", "127") == 0.0  # after ####
    assert last_number("x", "#### 127", "127") == 1.0
    assert last_number("x", "no number at all", "127") == 0.0
