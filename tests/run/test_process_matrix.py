"""The cross-process matrix (docs/scaling.md, "The cross-process matrix"): a table of cells,
each a layout x an async mode x an algorithm on 2 processes x 1 CPU device. A cell runs with
checkpoints at every step, is SIGKILLed (both processes) a random moment after its first RL
checkpoint, and the same command resumes it to the end; its metrics must equal a one-process
run on 2 devices within 1e-6 (wall-clock keys aside). A cell that cannot run across processes
must be refused in one line, which the test checks instead.

CI runs the cells in `CI`; `scripts/process_matrix.sh` runs them all (HFJAX_PROCESS_MATRIX=1).
"""

import math
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from support import start_rank, subprocess_env, tiny_process_job

from hfjax.run.metrics import is_timing_key, read_jsonl
from launch import local_cluster

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOTAL = 3
BASE = tiny_process_job(TOTAL)
LAYOUTS = {  # name: (placement with the default algorithm's roles, with GRPO's)
    "pool_each": ("gen=1:rollout;train=1:actor+ref+critic+reward",
                  "gen=1:rollout;train=1:actor+ref+reward"),
    "colocate": ("colocate", "colocate"),
    "split_models": ("a=1:actor+rollout+ref;b=1:critic+reward", "a=1:actor+rollout;b=1:ref+reward"),
}
MODES = {
    "sync": {},
    "k1": {"async_rollout.max_staleness": 1},
    "k2_push2": {"async_rollout.max_staleness": 2, "async_rollout.push_every": 2},
    "partial": {"async_rollout.max_staleness": 1, "async_rollout.partial_rollout": True},
}
ALGORITHMS = {  # the default config is PPO with a critic and KL in the reward
    "default": {},
    "grpo": {"algorithm": "grpo", "algo.adv_estimator": "grpo", "algo.use_kl_in_reward": False},
    "lora": {"actor.lora.rank": 4, "actor.lora.alpha": 8.0},
}


def refusal(layout, mode, algo) -> str | None:
    """The text of the one line that refuses a cell, or None for a cell that runs."""
    if layout == "pool_each" and algo == "lora":  # in one process as well
        return "a rollout pool of its own (async_rollout) does not run with actor.lora.rank"
    if mode == "partial":
        return "async_rollout.partial_rollout=True runs in one process only"
    return None


CI = {("pool_each", "k2_push2", "default")}


def _cells():
    for layout in LAYOUTS:
        for mode in MODES:
            for algo in ALGORITHMS:
                if layout != "pool_each" and mode != "sync":
                    continue  # K >= 1 needs a rollout pool apart from the actor's (config rule)
                cell = (layout, mode, algo)
                if cell in CI or os.environ.get("HFJAX_PROCESS_MATRIX"):
                    yield pytest.param(*cell, id="-".join(cell))


def _overrides(layout, mode, algo, out_dir) -> list[str]:
    o = dict(BASE) | MODES[mode] | ALGORITHMS[algo]
    o["placement"] = LAYOUTS[layout][algo == "grpo"]
    o["trainer.out_dir"] = out_dir
    return [f"--config.{k}={v}" for k, v in o.items()]


def _records(out_dir) -> list[dict]:
    return [{k: v for k, v in r.items() if not is_timing_key(k) and k != "async/push_s"}
            for r in read_jsonl(os.path.join(out_dir, "metrics.jsonl"))]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    # One compile cache for every cell; its own, as processes are killed while they run.
    return subprocess_env(tmp_path_factory.mktemp("xla_cache"))


@pytest.mark.parametrize("layout,mode,algo", list(_cells()))
def test_cell(tmp_path, env, layout, mode, algo):
    run = tmp_path / "two"
    args = _overrides(layout, mode, algo, run)
    logfile = tmp_path / "log"
    with open(logfile, "a") as log:
        port = local_cluster.free_port()
        procs = [start_rank(rank, port, args, env, log) for rank in range(2)]
        refused = refusal(layout, mode, algo)
        if refused:
            codes = [q.wait(timeout=300) for q in procs]
            text = open(logfile).read()
            assert 0 not in codes, text[-3000:]
            lines = [ln for ln in text.splitlines() if refused in ln]
            assert lines and lines[0].startswith("hfjax train: "), text[-3000:]
            assert not (run / "checkpoints").exists() or not os.listdir(run / "checkpoints")
            return
        done = run / "checkpoints" / "1" / "trainer"
        deadline = time.monotonic() + 600
        while not done.is_dir() and time.monotonic() < deadline:
            assert all(q.poll() is None for q in procs), open(logfile).read()[-3000:]
            time.sleep(0.05)
        time.sleep(random.uniform(0, 0.3))
        for q in procs:
            q.send_signal(signal.SIGKILL)
        for q in procs:
            q.wait(timeout=60)
        port = local_cluster.free_port()
        procs = [start_rank(rank, port, args, env, log) for rank in range(2)]
        codes = [q.wait(timeout=600) for q in procs]
    text = open(logfile).read()
    assert codes == [0, 0], text[-3000:]
    assert "resuming from" in text
    one = tmp_path / "one"
    p = subprocess.run([sys.executable, "-m", "launch.train", "--cpu_devices=2",
                        *_overrides(layout, mode, algo, one)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    a, b = _records(one), _records(run)
    assert [r["step"] for r in b] == list(range(TOTAL + 1))
    assert [sorted(r) for r in a] == [sorted(r) for r in b]
    assert all(r["actor/grad_norm"] > 0 for r in b[1:])
    if layout == "pool_each":  # every checkpointed array sits on one process only
        items = os.listdir(run / "checkpoints" / str(TOTAL))
        assert "actor_params.per_process" in items, items
    staleness = MODES[mode].get("async_rollout.max_staleness", 0)
    if staleness:
        # Stale samples, within the bound; each pool's idle time measured on its own
        # process (process 0 generates, process 1 trains) and logged by both.
        assert 0 < max(r["async/staleness/max"] for r in b[1:]) <= staleness
        assert all(r["async/push_bytes"] > 0 for r in b[1:])
        steps = [r for r in read_jsonl(os.path.join(run, "metrics.jsonl"))
                 if "timing_s/idle/train" in r]
        assert steps
        for r in steps:
            for key in ("timing_s/idle/train", "timing_s/idle/rollout"):
                assert math.isfinite(r[key]) and r[key] >= 0, (r["step"], key, r[key])
    for x, y in zip(a, b, strict=True):
        for k in x:
            assert abs(x[k] - y[k]) <= 1e-6 * max(1.0, abs(x[k])), (x["step"], k, x[k], y[k])
