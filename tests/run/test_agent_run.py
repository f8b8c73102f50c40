"""Multi-turn rollouts in a run: a GRPO step on the arith_tool task reports the trajectories'
turns, calls and errors and hands the trajectories to the reward; launch.evaluate runs the same
loop and writes each trajectory turn by turn."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from support import (
    children_left,
    hfjax_children,
    scripted_policy,
    subprocess_env,
    tiny_rl_config,
    tool_call_successors,
)

from hfjax.config import model_source
from hfjax.models import transformer
from hfjax.rewards.registry import register_reward
from hfjax.run.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCE = "tests/agent/turns"


@register_reward(SOURCE)
def policy_turns(data_source, solution_str, ground_truth, extra_info):
    """The trajectory's policy turns, read from the record the reward receives."""
    turns = extra_info["trajectory"]["turns"]
    return float(sum(t["role"] == "assistant" for t in turns))


def _config(tmp_path):
    c = tiny_rl_config(algorithm="grpo", out_dir=tmp_path)
    c.data.task, c.data.max_prompt_length = "arith_tool", 12
    c.rollout.n, c.rollout.response_length = 2, 32
    c.actor.ppo_mini_batch_size = 8
    c.actor.ppo_micro_batch_size = 16
    c.algo.adv_estimator, c.algo.use_kl_in_reward = "grpo", False
    m = c.rollout.multi_turn
    m.enable, m.tools, m.max_turns, m.max_tool_response_len = True, "calculator", 3, 8
    return c


@pytest.mark.slow
def test_a_multi_turn_grpo_step_calls_its_tool_and_takes_a_second_turn(tmp_path, monkeypatch):
    """A GRPO step whose policy is forced to call its tool (a `scripted_policy`: it writes
    `<tool_call>{"name":"calculator"}</tool_call>` after the prompt and EOS after the result):
    through the trainer's real actor, engine, loop and tool runner every trajectory has one
    successful call and two policy turns, and the reward reads them. A loop built with
    max_turns=1 (or one that drops the call or its result) fails here."""
    c = _config(tmp_path)
    c.rollout.multi_turn.tools = "support:AnswerTool"

    def forced(cfg, tokenizer, compute_dtype, pools):
        model_cfg = dataclasses.replace(model_source.model_config(cfg, tokenizer, compute_dtype),
                                        tie_word_embeddings=False)
        model = transformer.build(model_cfg, "causal_lm", seed=cfg.seed)
        return scripted_policy(model, tool_call_successors(tokenizer, "<eos>"))

    monkeypatch.setattr(model_source, "initial_model", forced)
    trainer = Trainer(c)
    for row in trainer.train_data.rows:
        row["data_source"] = SOURCE
    m = trainer.train_step()
    assert m["tool_calls/mean"] == 1.0 and m["tool_errors/mean"] == 0.0
    assert m["num_turns/mean"] == 2.0
    # The reward read each trajectory's turns: its mean score is the mean policy turns.
    assert m["critic/score/mean"] == pytest.approx(2.0, abs=1e-5)
    # The tools ran in worker processes, which the trainer's close ends.
    assert any("hfjax.tools.worker" in c for c in hfjax_children())
    trainer.close()
    assert not children_left("hfjax.tools.worker")


@pytest.mark.slow
def test_evaluate_writes_trajectories_turn_by_turn(tmp_path):
    out = tmp_path / "responses.jsonl"
    p = subprocess.run(
        [sys.executable, "-m", "launch.evaluate", "--config=configs/grpo_tool_arith.py",
         "--tools=calculator", "--limit=4", "--config.rollout.response_length=32",
         "--config.trainer.compilation_cache_dir=off", f"--responses={out}"],
        cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert result["prompts"] == 4 and 0.0 <= result["hfjax/arith_tool/greedy"] <= 1.0
    recs = [json.loads(line) for line in open(out)]
    assert len(recs) == 4
    for r in recs:
        assert r["turns"][0]["role"] == "assistant" and r["stop"] in (
            "eos", "max_turns", "length", "tool_length")
        assert r["num_turns"] == sum(t["role"] == "assistant" for t in r["turns"])
        # The response's mask counts the policy's tokens only.
        assert sum(t["tokens"] for t in r["turns"] if t["role"] == "assistant") == \
            r["response_tokens"]
