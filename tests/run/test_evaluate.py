"""launch.evaluate: a run's checkpoint scores what the run's own validation scored, and the
command prints greedy accuracy, the samples' mean and pass@k, and writes every response."""

import json
import os
import subprocess
import sys
import zlib

import pytest
from support import subprocess_env, tiny_rl_config

from hfjax.config.model_source import task_tokenizer
from hfjax.config.run_dir import is_run
from hfjax.rewards.registry import register_reward
from hfjax.run.checkpoint import RunCheckpointer
from hfjax.run.export import export_hf
from hfjax.run.intervals import wilson
from hfjax.run.trainer import Trainer
from hfjax.run.validation import evaluate_policy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A score that depends on every character of a response (a barely trained model would score 0
# on the task's own rule everywhere): equal means mean equal responses.
SOURCE = "tests/evaluate/text_hash"


@register_reward(SOURCE)
def text_hash(data_source, solution_str, ground_truth, extra_info):
    return (zlib.crc32(solution_str.encode()) % 1000 + 1) / 1000


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny PPO run after one step, saved as a checkpoint: (config, validation, out_dir)."""
    out = tmp_path_factory.mktemp("run")
    cfg = tiny_rl_config(out_dir=out)
    trainer = Trainer(cfg)
    for rows in (trainer.train_data.rows, trainer.test_data.rows):
        for row in rows:
            row["data_source"] = SOURCE
    trainer.train_step()
    ck = RunCheckpointer(str(out / "checkpoints"), async_save=False)
    trainer.save(ck)
    ck.wait()
    ck.close()
    trainer.tok.save(str(out / "tokenizer"))
    return cfg, trainer.validate(), trainer.test_data.rows, str(out)


@pytest.mark.slow
def test_a_checkpoint_scores_what_the_run_validated(run, tmp_path):
    cfg, validated, rows, out = run
    assert is_run(out) and is_run(os.path.join(out, "checkpoints"))
    cfg = cfg.copy_and_resolve_references()
    cfg.model.path = export_hf(out, str(tmp_path / "hf"))
    got = evaluate_policy(cfg, task_tokenizer(cfg), rows)
    key = f"val-core/{SOURCE}/acc/mean@1"
    assert validated[key] > 0
    assert got[key] == validated[key]


@pytest.mark.slow
def test_command_prints_greedy_and_pass_at_k_and_writes_responses(run, tmp_path):
    _, _, _, out = run
    hf = export_hf(out, str(tmp_path / "hf"))
    p = subprocess.run(
        [sys.executable, "-m", "launch.evaluate", f"--model={hf}", "--limit=8", "--samples=4",
         "--config.rollout.response_length=8", "--config.trainer.compilation_cache_dir=off",
         f"--responses={tmp_path / 'responses.jsonl'}"],
        cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert result["prompts"] == 8
    for key in ("greedy", "mean@4", "pass@4"):
        assert 0.0 <= result[f"hfjax/arith/{key}"] <= 1.0
    assert result["hfjax/arith/pass@4"] >= result["hfjax/arith/mean@4"]
    assert "hfjax/arith: greedy accuracy" in p.stdout
    # The written responses are the ones scored: their scores give back the printed figures.
    recs = [json.loads(line) for line in open(tmp_path / "responses.jsonl")]
    greedy = [r for r in recs if r["mode"] == "greedy"]
    sampled = [r for r in recs if r["mode"] == "sampled"]
    assert [r["prompt"] for r in greedy] == list(range(8)) and len(sampled) == 32
    assert sum(r["score"] for r in greedy) / 8 == pytest.approx(result["hfjax/arith/greedy"],
                                                                abs=1e-4)
    best = [max(r["score"] for r in sampled if r["prompt"] == i) for i in range(8)]
    assert sum(best) / 8 == pytest.approx(result["hfjax/arith/pass@4"], abs=1e-4)
    # Greedy and pass@k carry a Wilson interval over the 8 prompts; mean@k (correlated
    # samples) none.
    right = int(sum(r["score"] for r in greedy))
    assert result["hfjax/arith/greedy_ci95"] == pytest.approx(wilson(right, 8), abs=1e-4)
    assert result["hfjax/arith/pass@4_ci95"] == pytest.approx(wilson(int(sum(best)), 8),
                                                              abs=1e-4)
    assert "hfjax/arith/mean@4_ci95" not in result
    assert "(95% interval [" in p.stdout
    for r in recs:
        assert 0 <= r["response_tokens"] <= 8 and r["finished"] == (r["response_tokens"] < 8)
        assert r["data_source"] == "hfjax/arith" and r["ground_truth"]
        assert isinstance(r["response"], str)


def test_responses_into_a_missing_folder_is_refused_before_loading(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "launch.evaluate", f"--responses={tmp_path / 'no' / 'r.jsonl'}"],
        cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "does not exist" in p.stderr + p.stdout and "Traceback" not in p.stderr
