"""Tool-use demonstrations (`launch.prepare_data --sft_demos`) and their SFT layout: with
SmolLM2's real tokenizer and chat template, a demonstration is the token sequence a multi-turn
rollout produces, with the loss on the policy's turns and none on the tool's."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest

from configs import ppo_arith
from hfjax.agents import AgentLoop
from hfjax.agents.render import rollout_layout
from hfjax.config import check_flags
from hfjax.data import prepare, tool_demos
from hfjax.data import sft as sft_data
from hfjax.engine.sampler import SamplingParams
from hfjax.engine.spec import MultiTurnSpec
from hfjax.models.smollm2 import smollm2_gguf_path
from hfjax.models.tokenizer import Tokenizer
from hfjax.tools import ToolRunner, resolve_tools

PRODUCTS = {"min_terms": 2, "max_terms": 2, "min_digits": 3, "max_digits": 4,
            "operators": ["*"], "allow_parentheses": False, "allow_negation": False}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(smollm2_gguf_path())


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out = tmp_path_factory.mktemp("demos")
    paths = prepare.prepare("basic_arithmetic", 3, 2, out, config=dict(PRODUCTS),
                            tools="calculator", sft_demos=True)
    return paths


def test_prepare_writes_a_demonstration_per_prompt_with_the_tools_result(files):
    assert set(files) == {"train", "test", "sft_train", "sft_test"}
    prompts = pq.read_table(files["train"]).to_pylist()
    demos = pq.read_table(files["sft_train"]).to_pylist()
    assert len(demos) == len(prompts) == 3
    for row, demo in zip(prompts, demos):
        m = demo["messages"]
        assert [x["role"] for x in m] == ["system", "user", "assistant", "tool", "assistant"]
        assert [x["content"] for x in m[:2]] == [x["content"] for x in row["prompt"]]
        a, b = (int(v) for v in json.loads(row["extra_info"]["entry"])["metadata"]
                ["expression"].split(" * "))
        (call,) = m[2]["tool_calls"]
        assert call["function"]["name"] == "calculator"
        assert json.loads(call["function"]["arguments"]) == {"expression": f"{a} * {b}"}
        assert m[3]["content"] == str(a * b) == row["reward_model"]["ground_truth"]
        assert m[4]["content"] == f"#### {a * b}"


def test_loss_mask_is_zero_exactly_on_the_prompt_and_the_tool_turn(files, tok):
    data = sft_data.load_parquet(files["sft_train"], tok, max_prompt_length=400,
                                 max_response_length=128)
    demos = pq.read_table(files["sft_train"]).to_pylist()
    assert len(data.examples) == 3
    for ex, demo in zip(data.examples, demos):
        m = demo["messages"]
        # Reference: the chat template's own rendering of the whole conversation, the call
        # written as the policy writes it, cut after the final answer's end-of-turn token.
        call = tool_demos_call_text(m[2])
        full = tok.apply_chat_template(
            m[:2] + [{"role": "assistant", "content": call}] + [
                {"role": r["role"], "content": r["content"]} for r in m[3:]])
        end = "<|im_end|>"
        full = full[: full.rindex(end) + len(end)]
        prompt_text = tok.apply_chat_template(m[:2], add_generation_prompt=True)
        assert tok.decode(list(ex.prompt_ids), skip_special_tokens=False) == prompt_text
        assert tok.decode(list(ex.prompt_ids + ex.response_ids),
                          skip_special_tokens=False) == full
        # Character spans of the reference: the tool turn runs from the end-of-turn after the
        # call to the next assistant header, inclusive; everything else is the policy's.
        rest = full[len(prompt_text):]
        tool_from = rest.index("</tool_call>") + len("</tool_call>")
        tool_to = rest.index("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")
        want_tool = rest[tool_from:tool_to]
        assert want_tool == f"<|im_end|>\n<|im_start|>tool\n{m[3]['content']}<|im_end|>\n" \
                            "<|im_start|>assistant\n"
        pos, flags = 0, []
        for t in ex.response_ids:
            piece = tok.decode([t], skip_special_tokens=False)
            inside = tool_from <= pos and pos + len(piece) <= tool_to
            straddles = pos < tool_from < pos + len(piece) or pos < tool_to < pos + len(piece)
            assert not straddles, "a token straddles the tool turn's edge"
            flags.append(0 if inside else 1)
            pos += len(piece)
        assert pos == len(rest)
        assert list(ex.loss_mask) == flags
        assert ex.response_ids[-1] == tok.eos_id and ex.loss_mask[-1] == 1
        assert tok.decode([t for t, f in zip(ex.response_ids, ex.loss_mask) if f],
                          skip_special_tokens=False) == f"{call}{m[4]['content']}<|im_end|>"


def tool_demos_call_text(message: dict) -> str:
    """The call as the tools' system message shows the format (written out here, not by the
    code under test)."""
    (c,) = message["tool_calls"]
    args = json.loads(c["function"]["arguments"])
    return ("<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": args})
            + "\n</tool_call>")


class ScriptedTurns:
    """Stands in for the policy's turn engine (`hfjax.engine.session.TurnEngine`): the session
    it opens decodes, for every row, the next turn of a fixed script (followed by junk after a
    call, which the loop must cut at the close tag), in the layout `TurnSession.turns`
    returns."""

    def __init__(self, turns: list[list[int]], junk: list[int]):
        self.script, self.junk, self.k, self.rows, self.prefilled = turns, junk, 0, 0, 0

    def open(self, state, ids, mask, params, seed):
        self.rows = np.asarray(ids).shape[0] * params.n
        return self

    def resume(self, new, seeds):
        self.k += 1

    def turns(self):
        turn = self.script[self.k] + (self.junk if self.k + 1 < len(self.script) else [])
        toks = np.tile(np.asarray(turn, np.int32), (self.rows, 1))
        return (toks, np.zeros(toks.shape, np.float32), np.zeros(self.rows, np.int32),
                np.full(self.rows, len(turn), np.int32))


def test_sft_layout_is_the_rollouts_token_for_token(files, tok):
    """A rollout whose policy writes the demonstration's turns (the calculator answering for
    real) yields the SFT example's response ids, with gen_mask equal to its loss mask."""
    demo = pq.read_table(files["sft_test"]).to_pylist()[0]["messages"]
    prompt, ids, mask = rollout_layout(tok, demo)
    call = tok.encode(tool_demos_call_text(demo[2]), add_special_tokens=False)
    answer = tok.encode(demo[4]["content"], add_special_tokens=False) + [tok.eos_id]
    script = ScriptedTurns([call, answer], junk=tok.encode(" and more", add_special_tokens=False))
    base = MultiTurnSpec.of(ppo_arith.get_config().rollout.multi_turn)
    spec = dataclasses.replace(base, enable=True, max_turns=2, max_tool_response_len=32)
    with ToolRunner(resolve_tools("calculator")) as runner:
        loop = AgentLoop(SimpleNamespace(pad_id=tok.pad_id, mesh=None), tok, runner, spec)
        loop.engine = script
        out = loop.run(None, np.asarray([prompt]), np.ones((1, len(prompt)), np.int32),
                       SamplingParams(max_new_tokens=128, temperature=1.0, n=1,
                                      eos_ids=(tok.eos_id,)))
    k = int(out.attn_mask[0].sum())
    assert out.trajectories[0].tool_calls == 1 and out.trajectories[0].stop == "eos"
    assert out.tokens[0, :k].tolist() == ids
    assert out.gen_mask[0, :k].tolist() == mask
    assert sum(mask) == len(call) + len(answer) and script.k == 1


@pytest.mark.parametrize("messages, match", [
    ([{"role": "user", "content": "2*3"},
      {"role": "assistant", "content": "let me call"},
      {"role": "tool", "content": "6"},
      {"role": "assistant", "content": "#### 6"}], r"must end with its call's </tool_call>"),
    ([{"role": "user", "content": "2*3"},
      {"role": "assistant", "content": "", "tool_calls": [
          {"type": "function", "function": {"name": "calculator",
                                            "arguments": '{"expression": "2*3"}'}}]},
      {"role": "tool", "content": "6"}], r"ends with a tool turn"),
    ([{"role": "user", "content": "2*3"}, {"role": "assistant", "content": "6"},
      {"role": "tool", "content": "6"}, {"role": "user", "content": "again"},
      {"role": "assistant", "content": "6"}], r"must end with its call's"),
    ([{"role": "user", "content": "2*3"},
      {"role": "assistant", "content": "", "tool_calls": [
          {"type": "function", "function": {"name": "calculator", "arguments": "{oops"}}]},
      {"role": "tool", "content": "6"}, {"role": "assistant", "content": "6"}],
     r"arguments are not JSON"),
])
def test_malformed_tool_conversations_are_refused_in_one_line(tok, tmp_path, messages, match):
    import pyarrow as pa

    path = str(tmp_path / "bad.parquet")
    pq.write_table(pa.table({"messages": pa.array([messages])}), path)
    with pytest.raises(ValueError, match=match) as err:
        sft_data.load_parquet(path, tok, max_prompt_length=64, max_response_length=64)
    assert "row 0" in str(err.value) and "\n" not in str(err.value)


def test_demos_need_the_calculator_and_an_expression(tmp_path):
    with pytest.raises(ValueError, match="add --tools=calculator"):
        check_flags("prepare_data", {"n_train": 4, "n_test": 0, "out": str(tmp_path / "x"),
                                     "seed": 0, "task_config": "{}", "tools": "",
                                     "sft_demos": True})
    with pytest.raises(ValueError, match="add --tools=calculator"):
        prepare.prepare("arith_tool", 2, 0, tmp_path / "y", sft_demos=True)
    rows, _ = prepare.make_splits("arith", 2, 0, tools="calculator")
    with pytest.raises(ValueError, match="need an arithmetic expression"):
        tool_demos.demonstrations(rows, "calculator")
    rows, _ = prepare.make_splits("arith_tool", 2, 0, tools="calculator")
    demos, skipped = tool_demos.demonstrations(rows, "calculator")
    assert not skipped and [d["messages"][-1]["content"] for d in demos] == [
        f"#### {r['reward_model']['ground_truth']}" for r in rows]


def test_sft_parquet_warm_start_passes_the_config_rules(files):
    """data.task=parquet with sft.steps > 0 is accepted when sft.train_files names the
    demonstrations (launch.sft, and launch.train's warm start, read them); without them the
    warm start is refused in one line."""
    from configs import sft_smollm2_tool
    from hfjax.config import check_config

    c = sft_smollm2_tool.get_config()
    c.data.train_files, c.data.val_files = files["train"], files["test"]
    c.sft.train_files = files["sft_train"]
    check_config(c)
    c.sft.train_files = ""
    with pytest.raises(ValueError, match=r"sft.steps=40: the warm start .* or "
                                         r"--config.sft.train_files to SFT parquet"):
        check_config(c)
