"""Exact resume, end to end: `python -m launch.train` runs as a subprocess, is killed (SIGKILL at
a random moment after step 3) or stopped (SIGTERM), and the same command is run again. The
resumed run's metrics JSONL must equal an uninterrupted run's bit for bit, leaving out only the
wall-clock keys (`timing_s/*`, `perf/throughput`, see `hfjax.run.metrics.is_timing_key`): every
loss, reward, KL, entropy and validation accuracy after the resume is recomputed and compared.

Ctrl-C (SIGINT) is checked the same way as SIGTERM; a second Ctrl-C ends the run at once.

The job is tiny (one layer, hidden 64, 12 PPO steps with an adaptive KL controller so that its
state matters) and the runs share a persistent XLA compilation cache (the launcher's own,
pointed at a temporary directory), so after the first run each takes seconds. The exported
actor is checked here as well: `python -m launch.export` on the uninterrupted run, loaded by
transformers, gives hfjax's logits.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from support import comparable_records, run_train, subprocess_env, train_cmd

from hfjax.run.metrics import read_jsonl

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOTAL = 12
OVERRIDES = {
    "sft.steps": 150, "sft.batch_size": 16, "sft.micro_batch_size": 16, "sft.corruption": "none",
    "model.hidden_size": 64, "model.intermediate_size": 128, "model.head_dim": 16,
    "model.num_layers": 1, "model.num_heads": 2, "model.num_kv_heads": 1,
    "data.n_train": 256, "data.n_test": 32, "data.train_batch_size": 16,
    "actor.ppo_mini_batch_size": 8, "actor.ppo_micro_batch_size": 8,
    "critic.ppo_mini_batch_size": 8, "critic.ppo_micro_batch_size": 8,
    "algo.kl_ctrl.type": "adaptive", "trainer.total_steps": TOTAL, "trainer.test_freq": 3,
    "trainer.save_freq": 2, "trainer.max_to_keep": 3, "trainer.logger": "jsonl,tensorboard",
}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    # A cache of its own: runs are killed here, maybe while writing to it.
    return subprocess_env(tmp_path_factory.mktemp("xla_cache"))


def _start_and_wait(out_dir, env, step: int, extra_delay: float = 0.0) -> subprocess.Popen:
    """Starts the job and returns once its JSONL holds `step`, plus `extra_delay` seconds."""
    log = open(os.path.join(os.path.dirname(out_dir), os.path.basename(out_dir) + ".log"), "w")
    p = subprocess.Popen(train_cmd(out_dir, OVERRIDES, cpu_devices=1), cwd=ROOT, env=env,
                         stdout=log, stderr=subprocess.STDOUT, text=True)
    log.close()  # the child holds its own copy
    path = os.path.join(out_dir, "metrics.jsonl")
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if p.poll() is not None:
            break
        if os.path.exists(path) and any(r["step"] >= step for r in read_jsonl(path)):
            time.sleep(extra_delay)
            return p
        time.sleep(0.005)
    p.kill()
    raise AssertionError(f"the job ended or stalled before step {step}: {open(log.name).read()}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, env):
    out = tmp_path_factory.mktemp("reference") / "run"
    summary = run_train(out, env, OVERRIDES, cpu_devices=1)
    assert summary["step"] == TOTAL and summary["resumed_from"] is None
    records = comparable_records(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(TOTAL + 1))
    # The job must train, or equality after a resume would prove little.
    assert any(r.get("actor/grad_norm", 0) > 0 for r in records)
    assert len({r["actor/kl_coef"] for r in records if "actor/kl_coef" in r}) > 1
    return out, records


def test_sigkill_then_rerun_resumes_exactly(tmp_path, env, reference):
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    kill_after, delay = rng.randint(3, 6), rng.uniform(0.0, 0.1)
    out = tmp_path / "run"
    p = _start_and_wait(out, env, kill_after, delay)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert p.returncode == -signal.SIGKILL, f"job finished before the kill (seed {seed})"
    summary = run_train(out, env, OVERRIDES, cpu_devices=1)
    start = summary["resumed_from"]
    # save_freq=2, and the kill came before the last step's checkpoint.
    assert start is not None and start % 2 == 0 and start < TOTAL, (seed, summary)
    resumed = comparable_records(out / "metrics.jsonl")
    ref = reference[1]
    after = [r for r in resumed if r["step"] > start]
    assert after == [r for r in ref if r["step"] > start], f"seed {seed}, resumed at {start}"
    assert resumed == ref
    assert summary["step"] == TOTAL


def test_sigterm_saves_exits_cleanly_and_resumes_exactly(tmp_path, env, reference):
    out = tmp_path / "run"
    p = _start_and_wait(out, env, 3)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=300) == 0
    lines = open(str(out) + ".log").read().strip().splitlines()
    summary = json.loads(lines[-1])
    stopped = summary["step"]
    assert summary["preempted"] and 3 <= stopped < TOTAL, summary
    assert any(f"SIGTERM: stopped at step {stopped}" in line for line in lines)
    assert (out / "checkpoints" / str(stopped)).is_dir()
    assert max(r["step"] for r in read_jsonl(out / "metrics.jsonl")) == stopped
    resumed_summary = run_train(out, env, OVERRIDES, cpu_devices=1)
    assert resumed_summary["resumed_from"] == stopped
    assert comparable_records(out / "metrics.jsonl") == reference[1]


def test_ctrl_c_saves_exits_cleanly_and_resumes_exactly(tmp_path, env, reference):
    out = tmp_path / "run"
    p = _start_and_wait(out, env, 3)
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    assert p.wait(timeout=300) == 130  # the shell's code for Ctrl-C, after a clean stop
    assert time.monotonic() - t0 < 240
    log = open(str(out) + ".log").read()
    lines = log.strip().splitlines()
    summary = json.loads(lines[-1])
    stopped = summary["step"]
    assert summary["preempted"] and 3 <= stopped < TOTAL, summary
    assert any(f"SIGINT: stopped at step {stopped}, checkpoint" in line for line in lines)
    assert "Traceback" not in log and "KeyboardInterrupt" not in log
    assert (out / "checkpoints" / str(stopped)).is_dir()
    resumed_summary = run_train(out, env, OVERRIDES, cpu_devices=1)
    assert resumed_summary["resumed_from"] == stopped
    assert comparable_records(out / "metrics.jsonl") == reference[1]


def test_a_second_ctrl_c_ends_the_run_at_once(tmp_path, env, reference):
    out = tmp_path / "run"
    p = _start_and_wait(out, env, 2)
    p.send_signal(signal.SIGINT)
    time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    assert p.wait(timeout=60) == -signal.SIGINT
    assert time.monotonic() - t0 < 30


def test_rerun_of_a_finished_job_does_nothing(reference, env):
    summary = run_train(reference[0], env, OVERRIDES, cpu_devices=1)
    assert summary["resumed_from"] == TOTAL and summary["step"] == TOTAL
    assert comparable_records(reference[0] / "metrics.jsonl") == reference[1]
    assert (reference[0] / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_export_cli_loads_in_transformers_with_matching_logits(tmp_path, reference, env):
    import jax
    import torch
    import transformers

    from hfjax.run.export import load_actor

    run = reference[0]
    hf_dir = tmp_path / "hf"
    p = subprocess.run([sys.executable, "-m", "launch.export", f"--ckpt={run}", f"--out={hf_dir}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    model, restored = load_actor(str(run))
    assert restored.step == TOTAL
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    hf.eval()
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    texts = ["12+34=#### 46", "99-9=", "57+8=#### 65"]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, ids))
    rows = np.array([[tok.pad_token_id] * (width - len(i)) + i for i in ids], np.int32)
    mask = (np.arange(width)[None] >= width - np.array([len(i) for i in ids])[:, None])
    mask = mask.astype(np.int32)
    # hfjax counts positions from each row's first real token; transformers is told the same.
    pos = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(rows, dtype=torch.long),
                 attention_mask=torch.tensor(mask, dtype=torch.long),
                 position_ids=torch.tensor(pos, dtype=torch.long)).logits.numpy()
    ours = np.asarray(jax.device_get(model(rows, mask)))
    real = mask.astype(bool)
    assert np.abs(ours[real]).max() > 1.0  # a trained model, not a zero head
    # float32 logits of magnitude ~3 from two implementations' reduction orders: 1.3e-5 apart
    # at one of 540 positions on the disjoint-split run; a wrong weight moves them by O(1).
    np.testing.assert_allclose(ours[real], ref[real], atol=1e-5, rtol=1e-5)


def test_bad_config_stops_the_launcher_with_a_message(tmp_path, env):
    cmd = [*train_cmd(tmp_path / "run", OVERRIDES, cpu_devices=1),
           "--config.actor.ppo_mini_batch_size=7"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1
    assert "hfjax train: actor: mini-batch of 7 sequences" in p.stderr
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "run").exists()  # nothing was written


def test_resume_disable_on_a_run_with_checkpoints_is_refused_before_anything_runs(reference,
                                                                                   env):
    out = reference[0]
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    cmd = train_cmd(out, OVERRIDES, cpu_devices=1) + ["--config.trainer.resume=disable"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1
    assert "hfjax train: trainer.resume=disable, but" in p.stderr
    assert "Traceback" not in p.stderr
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before  # nothing touched
