"""The cross-process matrix (docs/scaling.md, "The cross-process matrix"): a table of cells,
each a layout x an async mode x an algorithm on 2 or 3 processes x 1 CPU device. A cell runs
with checkpoints at every step, is SIGKILLed (every process) a random moment after its first
RL checkpoint, and the same command resumes it to the end; its metrics must equal a
one-process run on as many devices within 1e-6 (wall-clock keys aside). A cell that cannot run
across processes must be refused in one line, which the test checks instead.

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
from support import start_rank, subprocess_env, tiny_process_job, tiny_rl_config

from hfjax.data import arith
from hfjax.models import save_hf, transformer
from hfjax.models.config import scratch_model_config
from hfjax.run.metrics import is_timing_key, read_jsonl
from launch import local_cluster

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOTAL = 3
BASE = tiny_process_job(TOTAL)
# name: (processes, placement with the default algorithm's roles; an algorithm's other roles
# join the pools of `ROLES_OF`'s roles). On 3 processes x 1 device a pool spans 2 of them.
LAYOUTS = {
    "pool_each": (2, "gen=1:rollout;train=1:actor+ref+critic+reward"),
    "colocate": (2, "colocate"),
    "split_models": (2, "a=1:actor+rollout+ref;b=1:critic+reward"),
    "span_actor": (3, "a=2:actor+rollout+ref;b=1:critic+reward"),
    "span_train": (3, "gen=1:rollout;train=2:actor+ref+critic+reward"),
}
MODES = {
    "sync": {},
    "k1": {"async_rollout.max_staleness": 1},
    "k2_push2": {"async_rollout.max_staleness": 2, "async_rollout.push_every": 2},
    "partial": {"async_rollout.max_staleness": 1, "async_rollout.partial_rollout": True},
}
SCORE = {"reward_model.path": "{rm}", "reward.model_weight": 1.0}
ALGORITHMS = {  # the default config is PPO with a critic and KL in the reward
    "default": {},
    "grpo": {"algorithm": "grpo", "algo.adv_estimator": "grpo", "algo.use_kl_in_reward": False},
    "lora": {"actor.lora.rank": 4, "actor.lora.alpha": 8.0},
    # A learned reward model (a tiny random score model) beside the rule reward, in the pool of
    # the rule reward: on its own process in pool_each, split_models and the span layouts.
    "rm": SCORE,
    # Safe-RLHF: a reward and a cost model, a cost critic beside the critic.
    "safe_rlhf": SCORE | {"algorithm": "safe_rlhf", "algo.adv_estimator": "safe_rlhf",
                          "cost_model.path": "{cost}", "cost_critic.ppo_mini_batch_size": 4,
                          "cost_critic.ppo_micro_batch_size": 8},
}
ROLES_OF = {  # algorithm: {a default role: the roles that take its place in the placement}
    "grpo": {"critic": ()},
    "rm": {"reward": ("reward", "reward_model")},
    "safe_rlhf": {"critic": ("critic", "cost_critic"),
                  "reward": ("reward", "reward_model", "cost_model")},
}


def refusal(layout, mode, algo) -> str | None:
    """The text of the one line that refuses a cell, or None for a cell that runs."""
    if layout == "pool_each" and algo == "lora":  # in one process as well
        return "a rollout pool of its own (async_rollout) does not run with actor.lora.rank"
    return None


CI = {("pool_each", "k2_push2", "default"), ("span_actor", "sync", "rm")}


def _cells():
    full = os.environ.get("HFJAX_PROCESS_MATRIX")
    for layout in LAYOUTS:
        for mode in MODES:
            for algo in ALGORITHMS:
                pools = [p.split(":")[-1] for p in LAYOUTS[layout][1].split(";")]
                if mode != "sync" and "rollout" not in pools:
                    continue  # K >= 1 needs a rollout pool apart from the actor's (config rule)
                if layout.startswith("span") and (algo not in ("default", "rm")
                                                  or mode not in ("sync", "k1")):
                    continue
                cell = (layout, mode, algo)
                if cell in CI or full:
                    yield pytest.param(*cell, id="-".join(cell))


def _placement(layout, algo) -> str:
    placement = LAYOUTS[layout][1]
    if placement == "colocate":
        return placement
    swap = ROLES_OF.get(algo, {})
    pools = []
    for pool in placement.split(";"):
        head, roles = pool.split(":")
        roles = [r for role in roles.split("+") for r in swap.get(role, (role,))]
        pools.append(f"{head}:{'+'.join(roles)}")
    return ";".join(pools)


def _overrides(layout, mode, algo, out_dir, score_dirs) -> list[str]:
    o = dict(BASE) | MODES[mode] | ALGORITHMS[algo]
    o["placement"] = _placement(layout, algo)
    o["trainer.out_dir"] = out_dir
    return [f"--config.{k}={str(v).format(**score_dirs)}" for k, v in o.items()]


def _records(out_dir) -> list[dict]:
    return [{k: v for k, v in r.items() if not is_timing_key(k) and k != "async/push_s"}
            for r in read_jsonl(os.path.join(out_dir, "metrics.jsonl"))]


@pytest.fixture(scope="module")
def score_dirs(tmp_path_factory) -> dict[str, str]:
    """Tiny random reward and cost models (HF score directories) for the task's tokenizer."""
    tok = arith.tokenizer()
    m = scratch_model_config(tiny_rl_config().model, tok.vocab_size, tok.pad_id, tok.eos_id, 32)
    return {name: save_hf(transformer.build(m, "score", seed=seed),
                          str(tmp_path_factory.mktemp(name)))
            for seed, name in ((1, "rm"), (2, "cost"))}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    # One compile cache for every cell; its own, as processes are killed while they run.
    return subprocess_env(tmp_path_factory.mktemp("xla_cache"))


@pytest.mark.parametrize("layout,mode,algo", list(_cells()))
def test_cell(tmp_path, env, score_dirs, layout, mode, algo):
    run = tmp_path / "many"
    n = LAYOUTS[layout][0]
    args = _overrides(layout, mode, algo, run, score_dirs)
    logfile = tmp_path / "log"
    with open(logfile, "a") as log:
        port = local_cluster.free_port()
        procs = [start_rank(rank, port, args, env, log, n) for rank in range(n)]
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
        procs = [start_rank(rank, port, args, env, log, n) for rank in range(n)]
        codes = [q.wait(timeout=600) for q in procs]
    text = open(logfile).read()
    assert codes == [0] * n, text[-3000:]
    assert "resuming from" in text
    one = tmp_path / "one"
    p = subprocess.run([sys.executable, "-m", "launch.train", f"--cpu_devices={n}",
                        *_overrides(layout, mode, algo, one, score_dirs)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    a, b = _records(one), _records(run)
    assert [r["step"] for r in b] == list(range(TOTAL + 1))
    assert [sorted(r) for r in a] == [sorted(r) for r in b]
    # It trained (GRPO's step may be 0 where every group's samples score alike).
    assert any(r["actor/grad_norm"] > 0 for r in b[1:])
    if "reward_model.path" in ALGORITHMS[algo]:  # the learned reward model scored
        assert all(math.isfinite(r["reward_model/score/mean"]) for r in b[1:])
    if algo == "safe_rlhf":
        assert all(math.isfinite(r["cost/mean"]) for r in b[1:])
    if layout != "colocate":  # the actor's arrays sit on some processes only
        items = os.listdir(run / "checkpoints" / str(TOTAL))
        assert "actor_params.per_process" in items, items
    staleness = MODES[mode].get("async_rollout.max_staleness", 0)
    if staleness:
        # Stale samples, within the bound; each pool's idle time measured on its own
        # process (process 0 generates, process 1 trains) and logged by both.
        assert 0 < max(r["async/staleness/max"] for r in b[1:]) <= staleness
        assert all(r["async/push_bytes"] > 0 for r in b[1:])
        if mode == "partial":  # some rows continued under the next version
            assert max(r["async/partial/rows"] for r in b[1:]) > 0
        steps = [r for r in read_jsonl(os.path.join(run, "metrics.jsonl"))
                 if "timing_s/idle/train" in r]
        assert steps
        for r in steps:
            for key in ("timing_s/idle/train", "timing_s/idle/rollout"):
                assert math.isfinite(r[key]) and r[key] >= 0, (r["step"], key, r[key])
    for x, y in zip(a, b, strict=True):
        for k in x:
            assert abs(x[k] - y[k]) <= 1e-6 * max(1.0, abs(x[k])), (x["step"], k, x[k], y[k])
