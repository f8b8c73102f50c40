"""launch.train's console output in a log file (a cluster job's `> log 2>&1`): plain progress
lines, no progress bar redraws."""

import json
import os
import subprocess
import sys

from support import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--config.model.hidden_size=32", "--config.model.intermediate_size=64",
        "--config.model.head_dim=16", "--config.model.num_layers=1",
        "--config.model.num_heads=2", "--config.model.num_kv_heads=1",
        "--config.data.n_train=64", "--config.data.n_test=16",
        "--config.data.train_batch_size=16", "--config.actor.ppo_mini_batch_size=8",
        "--config.actor.ppo_micro_batch_size=8", "--config.critic.ppo_mini_batch_size=8",
        "--config.critic.ppo_micro_batch_size=8", "--config.sft.steps=0",
        "--config.reward.num_processes=0"]


def test_a_log_file_gets_plain_progress_lines(tmp_path):
    steps = 20
    log = tmp_path / "log"
    cmd = [sys.executable, "-m", "launch.train", *TINY, f"--config.trainer.total_steps={steps}",
           "--config.trainer.test_freq=0", "--config.trainer.val_before_train=False",
           "--config.trainer.log_every=0", f"--config.trainer.save_freq={steps}",
           f"--config.trainer.out_dir={tmp_path / 'run'}"]
    with open(log, "w") as f:  # stdout and stderr both the file, as `> log 2>&1`
        proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=900,
                              env=subprocess_env())
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert "\r" not in text
    progress = [ln for ln in text.splitlines() if ln.startswith("ppo: step ")]
    # A line every tenth of the run (and one per 30 s of a slower run), the last step's among them.
    wall = json.loads(text.strip().splitlines()[-1])["wall_s"]
    assert 10 <= len(progress) <= 10 + int(wall // 30) + 1, progress
    assert progress[-1].startswith(f"ppo: step {steps}/{steps},")
