"""The SFT and reward-model entry points on tiny models: the RL warm start is the SFT path
(same weights, step for step), an SFT run's output is what launch.train starts from, and
launch.train_rm learns held-out preferences and writes a reward model an RL run loads."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from support import subprocess_env, tiny_rl_config

from hfjax.data import prepare
from hfjax.models.hf_io import load_score
from hfjax.run.rm import RMTrainer
from hfjax.run.sft import SFTTrainer
from hfjax.run.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sft_config(out_dir=None):
    cfg = tiny_rl_config(out_dir=out_dir)
    cfg.sft.steps, cfg.sft.batch_size, cfg.sft.micro_batch_size = 3, 16, 8
    return cfg


def host(params):
    with jax.transfer_guard("allow"):
        return {jax.tree_util.keystr(p): np.array(x) for p, x in
                jax.tree_util.tree_leaves_with_path(params)}


@pytest.mark.slow
def test_warm_start_is_the_sft_path_and_feeds_launch_train(tmp_path):
    cfg = sft_config()
    trainer = Trainer(cfg)
    warm = trainer.warm_start()
    sft = SFTTrainer(cfg)
    result = sft.fit()
    assert result["last"] == warm  # the same loss and gradient norm, step for step
    got, want = host(sft.actor.params), host(trainer.actor.params)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert result["after"]["val/sft_loss"] < result["before"]["val/sft_loss"]
    assert "val-core/hfjax/arith/acc/mean@1" in result["after"]

    out = sft.save(str(tmp_path / "sft" / "hf"))
    rl = tiny_rl_config()
    rl.model.path, rl.sft.steps = out, 0
    again = Trainer(rl)  # the tokenizer and the weights come from the SFT run's directory
    assert again.tok.vocab_size == trainer.tok.vocab_size
    for k, v in host(again.actor.params).items():
        np.testing.assert_array_equal(v, want[k], err_msg=k)


@pytest.mark.slow
def test_launch_train_rm_learns_held_out_pairs(tmp_path):
    prepare.prepare("arith_cost_prefs", 300, 60, tmp_path / "prefs", seed=0,
                    config={"max_b": 9, "pairs_per_prompt": 2})
    out = tmp_path / "cost"
    small = ["--config.model.hidden_size=32", "--config.model.intermediate_size=64",
             "--config.model.head_dim=16", "--config.model.num_layers=1",
             "--config.model.num_heads=2", "--config.model.num_kv_heads=1"]
    cmd = [sys.executable, "-m", "launch.train_rm", "--config=configs/cost_arith.py",
           "--config.model.path=", f"--config.rm.train_files={tmp_path}/prefs/train.parquet",
           f"--config.rm.val_files={tmp_path}/prefs/test.parquet", "--config.rm.steps=60",
           "--config.rm.eval_every=30", "--config.rm.lr=3e-3", f"--config.trainer.out_dir={out}",
           *small]
    # As a user runs it: this process's 8 simulated devices are a test setting (with them the
    # run is an fsdp=8 job of 8 device threads on the 2 shared cores).
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=subprocess_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["target"] == "cost" and summary["heldout_pairs"] == 120
    assert summary["heldout_pairwise_accuracy_after"] >= 0.8
    assert summary["heldout_pairwise_accuracy_after"] > summary["heldout_pairwise_accuracy_before"]
    model = load_score(str(out / "hf"), what="cost_model.path")  # an RL run can load it
    assert type(model).__name__ == "ScoreModel"


def test_reward_model_from_a_policy_resolves_the_compute_dtype(tmp_path):
    """model.dtype is the compute dtype (`auto` resolved as an RL run resolves it), never the
    parameters': a reward model started from an SFT policy keeps model.param_dtype weights."""
    prepare.prepare("arith_prefs", 32, 8, tmp_path / "prefs", seed=0,
                    config={"max_b": 9, "pairs_per_prompt": 1})
    policy = SFTTrainer(sft_config()).save(str(tmp_path / "sft" / "hf"))
    for dtype, want in (("auto", "float32"), ("bfloat16", "bfloat16")):
        cfg = sft_config()
        cfg.model.path, cfg.model.dtype = policy, dtype
        cfg.rm.train_files = str(tmp_path / "prefs" / "train.parquet")
        cfg.rm.steps, cfg.rm.batch_size, cfg.rm.micro_batch_size = 1, 8, 8
        group = RMTrainer(cfg).group
        assert group.config.dtype == want  # a tiny model on CPU: auto is float32
        assert {str(x.dtype) for x in jax.tree.leaves(group.params)} == {"float32"}
