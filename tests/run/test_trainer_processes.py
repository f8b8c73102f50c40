"""The trainer across processes, end to end, with real processes on 127.0.0.1 (CPU devices,
gloo collectives between processes):

- 2 processes x 4 devices (`launch.local_cluster`) against 1 process x 8 devices: 3 PPO steps
  of the default task with the 3D-HybridEngine on (training `fsdp=4,tensor=2`, decoding
  `data=4,tensor=2`), a critic and a reference on the same mesh. Metrics and final parameters
  agree within 1e-6, not bit for bit: a gradient summed over the `fsdp` axis, which spans both
  processes, is summed by gloo across processes in another order than by XLA within one
  process (float32 rounding, ~1e-7 relative a reduction).
- A lost process, then a resume: one of two processes is SIGKILLed after the first
  checkpoint; the other exits within 60 s naming it; the same command run again resumes from
  the checkpoint both processes wrote, and is SIGKILLed (both processes) once more after the
  next one; the third run finishes. Its metrics equal the uninterrupted 2-process run's bit
  for bit (wall-clock keys aside): the same programs on the same processes sum in the same
  order.

The job is tiny and starts from scratch (no warm start). The task's exact-answer reward would
then be 0 everywhere, so tests/partial_credit_reward.py gives partial credit per character and
every PPO stage computes on non-zero numbers.
"""

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import partial_credit_reward
import pytest
from support import subprocess_env

from hfjax.parallel import distributed as dist
from hfjax.run.metrics import is_timing_key, read_jsonl
from launch import local_cluster

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOTAL = 3
OVERRIDES = {
    "sft.steps": 0,
    "model.hidden_size": 64, "model.intermediate_size": 128, "model.head_dim": 16,
    "model.num_layers": 1, "model.num_heads": 2, "model.num_kv_heads": 2,
    "data.n_train": 256, "data.n_test": 32, "data.train_batch_size": 16,
    "actor.ppo_mini_batch_size": 16, "actor.ppo_micro_batch_size": 16,
    "critic.ppo_mini_batch_size": 16, "critic.ppo_micro_batch_size": 16,
    "actor.mesh": "fsdp=4,tensor=2", "rollout.mesh": "data=4,tensor=2",
    "ref.mesh": "fsdp=4,tensor=2", "critic.mesh": "fsdp=4,tensor=2",
    "reward.num_processes": 0,
    "reward.custom_fn": f"{partial_credit_reward.__file__}:{partial_credit_reward.score.__name__}",
    "trainer.total_steps": TOTAL, "trainer.test_freq": TOTAL, "trainer.save_freq": 1,
    "trainer.max_to_keep": 5, "trainer.logger": "jsonl", "trainer.plot": False,
}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    # The runs share compiled programs (the first compiles them) in a cache of their own, as
    # processes are killed here, maybe while writing to it.
    return subprocess_env(tmp_path_factory.mktemp("xla_cache"))


def _args(out_dir) -> list[str]:
    return [f"--config.trainer.out_dir={out_dir}",
            *(f"--config.{k}={v}" for k, v in OVERRIDES.items())]


def _comparable(out_dir) -> list[dict]:
    return [{k: v for k, v in r.items() if not is_timing_key(k)}
            for r in read_jsonl(os.path.join(out_dir, "metrics.jsonl"))]


def _final_params(out_dir, step=TOTAL) -> dict[str, np.ndarray]:
    """{item/leaf: array} of the trained models in a checkpoint, read on the host."""
    import jax
    import orbax.checkpoint as ocp

    out = {}
    for item in ("actor_params", "critic_params"):
        path = os.path.join(out_dir, "checkpoints", str(step), item)
        ckptr = ocp.PyTreeCheckpointer()
        meta = ckptr.metadata(path)
        meta = getattr(getattr(meta, "item_metadata", meta), "tree", meta)
        args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), dict(meta))
        for name, x in ckptr.restore(path, restore_args=args).items():
            out[f"{item}/{name}"] = np.asarray(x)
    return out


@pytest.fixture(scope="module")
def two(tmp_path_factory, env):
    """The uninterrupted 2-process run: (out_dir, its output)."""
    out = tmp_path_factory.mktemp("two") / "run"
    cmd = [sys.executable, "-m", "launch.local_cluster", "--num_processes=2",
           "--devices_per_process=4", "--", *_args(out)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    records = _comparable(out)
    # Process 0 alone writes the metrics: one line per step, not one per process.
    assert [r["step"] for r in records] == list(range(TOTAL + 1))
    # The job must train, or equal numbers would prove little.
    assert all(r["actor/grad_norm"] > 0 and r["critic/grad_norm"] > 0 for r in records[1:])
    assert all(r["critic/score/mean"] > 0 for r in records[1:])
    return out, p.stdout


def test_two_processes_print_once(two):
    _, out = two
    lines = out.splitlines()
    # Process 0 alone prints the run's lines and its summary; process 1 prints nothing of it.
    assert any(line.startswith("[0] hfjax: ppo on 8 cpu devices (2 processes x 4)")
               for line in lines), out[-3000:]
    assert any(line.startswith('[0] {"heldout_accuracy_before"') for line in lines)
    assert not any(line.startswith("[1] hfjax: ppo") or line.startswith('[1] {"heldout')
                   for line in lines), out[-3000:]


def test_two_processes_equal_one(tmp_path, env, two):
    two_out, _ = two
    one_out = tmp_path / "one"
    p = subprocess.run([sys.executable, "-m", "launch.train", "--cpu_devices=8", *_args(one_out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    one, two_records = _comparable(one_out), _comparable(two_out)
    assert [sorted(r) for r in one] == [sorted(r) for r in two_records]
    for a, b in zip(one, two_records):
        for k in a:
            assert abs(a[k] - b[k]) <= 1e-6 * max(1.0, abs(a[k])), (a["step"], k, a[k], b[k])
    p1, p2 = _final_params(one_out), _final_params(two_out)
    assert sorted(p1) == sorted(p2)
    for k in p1:
        np.testing.assert_allclose(p2[k], p1[k], rtol=0, atol=1e-6, err_msg=k)
    # The job moved the parameters well beyond that tolerance.
    first = _final_params(one_out, step=0)
    assert max(np.abs(p1[k] - first[k]).max() for k in p1) > 1e-4


def _start(rank, port, out_dir, env, log_dir):
    """One process of a 2-process run, joined with the process flags (no launcher)."""
    log = open(os.path.join(log_dir, f"process{rank}.log"), "a")
    cmd = [sys.executable, "-u", "-m", "launch.train", "--cpu_devices=4",
           f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
           f"--process_id={rank}", "--heartbeat_timeout_s=20", *_args(out_dir)]
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                         start_new_session=True)
    log.close()
    return p


def _run_until_checkpoint(out_dir, env, log_dir, step):
    """Starts both processes; returns them once checkpoint `step` is complete on disk."""
    port = local_cluster.free_port()
    procs = [_start(rank, port, out_dir, env, log_dir) for rank in range(2)]
    done = os.path.join(out_dir, "checkpoints", str(step), "trainer")
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and not os.path.isdir(done):
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.05)
    if not os.path.isdir(done):
        for p in procs:
            p.kill()
        logs = [open(os.path.join(log_dir, f"process{r}.log")).read()[-3000:] for r in range(2)]
        raise AssertionError(f"no checkpoint {step}:\n" + "\n".join(logs))
    return procs


def test_lost_process_then_resume(tmp_path, env, two):
    out, logs = tmp_path / "run", str(tmp_path)
    # 1. SIGKILL process 1 after the first RL checkpoint: process 0 must name it and stop.
    p0, p1 = _run_until_checkpoint(out, env, logs, 1)
    p1.send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    try:
        code = p0.wait(timeout=60)
    finally:
        p0.kill()
    took = time.monotonic() - t0
    log0 = open(tmp_path / "process0.log").read()
    assert took < 60
    # LossWatch reports after half of --heartbeat_timeout_s, ahead of JAX's own abort.
    assert code == dist.EXIT_LOST_PROCESS, log0[-3000:]
    # The survivor names the lost process and its pools, the timeout and the command that resumes.
    assert re.search(r"hfjax: process 0 of 2 lost process 1 \(pools? .+\): no heartbeat "
                     r"from it for 10 s .*resume from the last checkpoint with: \S", log0), \
        log0[-3000:]
    # 2. The same command resumes from what both processes saved (process 1 killed, process 0
    # stopped), to the end, and ends where the uninterrupted run does.
    port = local_cluster.free_port()
    procs = [_start(rank, port, out, env, logs) for rank in range(2)]
    codes = [p.wait(timeout=600) for p in procs]
    log0 = open(tmp_path / "process0.log").read()
    assert codes == [0, 0], log0[-3000:]
    assert "resuming from" in log0
    assert _comparable(out) == _comparable(two[0])


def _safetensors(path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def test_export_and_generate_across_processes(tmp_path, env, two):
    run = two[0]
    # Export: every process restores its shards, process 0 writes what they gather.
    p2 = subprocess.run(
        [sys.executable, "-m", "launch.local_cluster", "--num_processes=2",
         "--devices_per_process=4", "--module=launch.export", "--", f"--ckpt={run}",
         f"--out={tmp_path / 'two'}"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600)
    assert p2.returncode == 0, p2.stdout[-3000:] + p2.stderr[-3000:]
    assert f"[0] wrote {tmp_path / 'two'}" in p2.stdout
    assert "[1] wrote" not in p2.stdout
    p1 = subprocess.run([sys.executable, "-m", "launch.export", f"--ckpt={run}",
                         f"--out={tmp_path / 'one'}"], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600)
    assert p1.returncode == 0, p1.stderr[-3000:]
    one, two_ = _safetensors(tmp_path / "one"), _safetensors(tmp_path / "two")
    assert sorted(one) == sorted(two_)
    for k in one:
        np.testing.assert_array_equal(two_[k], one[k], err_msg=k)
    # Generation from the exported model: greedy, on a decode mesh over both processes.
    gen = ["--", f"--model={tmp_path / 'one'}", "--prompt=12+34=", "--prompt=57-8=",
           "--temperature=0", "--max_new_tokens=8"]
    g2 = subprocess.run(
        [sys.executable, "-m", "launch.local_cluster", "--num_processes=2",
         "--devices_per_process=4", "--module=launch.generate", *gen], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=600)
    assert g2.returncode == 0, g2.stdout[-3000:] + g2.stderr[-3000:]
    g1 = subprocess.run([sys.executable, "-m", "launch.generate", *gen[1:]], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)
    assert g1.returncode == 0, g1.stderr[-3000:]
    one_lines = g1.stdout.splitlines()
    zero_lines = [line[4:] for line in g2.stdout.splitlines() if line.startswith("[0] ")]
    answers = _answers(one_lines)
    assert len(answers) == 2 and _answers(zero_lines) == answers, (g1.stdout, g2.stdout)
    assert not any(line.startswith("[1] ---") for line in g2.stdout.splitlines())


def _answers(lines: list[str]) -> list[tuple[str, str]]:
    """(prompt header, generated text) pairs of launch.generate's output."""
    return [(h, t) for h, t in zip(lines, lines[1:]) if h.startswith("--- prompt")]
