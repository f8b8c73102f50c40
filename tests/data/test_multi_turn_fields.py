"""verl's multi-turn fields (agent_name, extra_info.tools_kwargs, extra_info.interaction_kwargs):
the arith_tool task writes them, the Dataset reads and checks them, batches carry them."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from hfjax.data.batching import prompt_batch
from hfjax.data.dataset import Dataset, reward_meta
from hfjax.data.prepare import DESCRIBE_ONLY, make_splits, prepare, write_rows
from hfjax.rewards.registry import get_reward_fn
from hfjax.tools.calculator import calculate


def test_arith_tool_files_carry_the_multi_turn_fields(tmp_path, tok):
    paths = prepare("arith_tool", n_train=20, n_test=5, out_dir=tmp_path, seed=0)
    table = pq.read_table(paths["train"])
    assert table.schema.names == ["data_source", "prompt", "ability", "reward_model",
                                  "extra_info", "agent_name"]
    rows = table.to_pylist()
    for r in rows:
        x = r["extra_info"]
        a, b = x["a"], x["b"]
        assert 100 <= a <= 9999 and 100 <= b <= 9999
        assert r["prompt"] == [{"role": "user", "content": f"{a}*{b}="}]
        assert r["reward_model"]["ground_truth"] == str(a * b)
        assert r["agent_name"] == "tool_agent"
        assert set(x["tools_kwargs"]) == {"calculator"}
        assert x["interaction_kwargs"] == {"name": "arith_tool", "query": f"{a}*{b}=",
                                           "ground_truth": str(a * b)}
        # The tool the rows name can answer them.
        assert calculate(f"{a}*{b}") == r["reward_model"]["ground_truth"]
    test_prompts = {r["prompt"][0]["content"] for r in pq.read_table(paths["test"]).to_pylist()}
    assert not test_prompts & {r["prompt"][0]["content"] for r in rows}

    ds = Dataset.from_parquet(list(paths.values()), tok, max_prompt_length=32)
    assert len(ds) == 25 and ds.report.skipped == {}
    row = ds.rows[0]
    assert row["agent_name"] == "tool_agent"
    assert row["tools_kwargs"] == {"calculator": {"create_kwargs": {
        "query": row["prompt"][0]["content"]}}}
    assert row["interaction_kwargs"]["ground_truth"] == row["reward_model"]["ground_truth"]
    truth = row["reward_model"]["ground_truth"]
    fn = get_reward_fn(row["data_source"])
    assert fn(row["data_source"], f"<tool_call>...</tool_call>#### {truth}", truth, None) == 1.0
    assert fn(row["data_source"], f"#### {int(truth) + 1}", truth, None) == 0.0

    # Passed through to the batch's non-tensor data.
    batch = prompt_batch(ds.rows[:4], np.arange(4), tok.pad_id, 32)
    assert list(batch.meta["agent_name"]) == ["tool_agent"] * 4
    assert [kw["calculator"]["create_kwargs"]["query"] for kw in batch.meta["tools_kwargs"]] == [
        r["prompt"][0]["content"] for r in ds.rows[:4]]
    assert batch.meta["interaction_kwargs"][2] == ds.rows[2]["interaction_kwargs"]


def test_digits_option_and_bad_options():
    train, _ = make_splits("arith_tool", 30, 0, seed=3, config={"digits": [2, 2]})
    assert all(10 <= r["extra_info"][k] <= 99 for r in train for k in ("a", "b"))
    with pytest.raises(ValueError, match=r"digits=\[4, 3\].*1 <= fewest <= most"):
        make_splits("arith_tool", 3, 0, config={"digits": [4, 3]})
    with pytest.raises(ValueError, match="takes only digits"):
        make_splits("arith_tool", 3, 0, config={"max_b": 9})


def verl_row(i, **fields):
    row = {"data_source": "openai/gsm8k",
           "prompt": [{"role": "user", "content": f"{i}+{i}="}],
           "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
           "extra_info": {"index": i}}
    for key, value in fields.items():
        if key == "agent_name":
            row[key] = value
        else:
            row["extra_info"][key] = value
    return row


def test_rows_naming_different_tools_and_rows_naming_none(tmp_path, tok):
    rows = [
        verl_row(0, agent_name="tool_agent",
                 tools_kwargs={"python": {"create_kwargs": {"timeout": 3}}}),
        verl_row(1, agent_name="tool_agent",
                 tools_kwargs={"calculator": {"create_kwargs": {"digits": 4}}},
                 interaction_kwargs={"name": "checker"}),
        verl_row(2),
    ]
    path = tmp_path / "mixed.parquet"
    write_rows(rows, path)
    # Parquet shares struct fields between rows: row 0 reads back with a null calculator.
    raw = pq.read_table(path).to_pylist()
    assert raw[0]["extra_info"]["tools_kwargs"]["calculator"] is None
    ds = Dataset.from_parquet(path, tok, max_prompt_length=32)
    assert [r["agent_name"] for r in ds.rows] == ["tool_agent", "tool_agent",
                                                   "single_turn_agent"]
    assert ds.rows[0]["tools_kwargs"] == {"python": {"create_kwargs": {"timeout": 3}}}
    assert ds.rows[1]["tools_kwargs"] == {"calculator": {"create_kwargs": {"digits": 4}}}
    assert ds.rows[2]["tools_kwargs"] == {}
    assert [r["interaction_kwargs"] for r in ds.rows] == [{}, {"name": "checker"}, {}]


def test_single_turn_data_is_unchanged(tok):
    ds = Dataset([verl_row(i) for i in range(3)], tok, max_prompt_length=32)
    assert all(r["agent_name"] is None and r["tools_kwargs"] is None for r in ds.rows)
    assert set(reward_meta(ds.rows)) == {"data_source", "ground_truth", "reward_style",
                                         "extra_info"}


@pytest.mark.parametrize("fields, message", [
    ({"agent_name": 3}, "row 0: field agent_name is int, expected a non-empty str"),
    ({"agent_name": ""}, "row 0: field agent_name is str, expected a non-empty str"),
    ({"tools_kwargs": "calculator"},
     "row 0: field extra_info.tools_kwargs is str, expected a dict {tool name:"),
    ({"tools_kwargs": {"calculator": [1]}},
     "row 0: field extra_info.tools_kwargs.calculator is list, expected a dict"),
    ({"interaction_kwargs": "gsm8k"},
     "row 0: field extra_info.interaction_kwargs is str, expected a dict"),
])
def test_bad_multi_turn_fields_are_errors_naming_row_and_field(tok, fields, message):
    rows = [verl_row(0, **fields), verl_row(1)]
    with pytest.raises(ValueError, match=message):
        Dataset(rows, tok, max_prompt_length=32)
    # Or counted skips, as for any malformed row.
    ds = Dataset(rows, tok, max_prompt_length=32, on_bad_row="skip")
    assert len(ds) == 1 and ds.report.skipped == {"malformed row": 1}


def test_tools_flag_writes_a_system_message_from_the_tool_schemas(tmp_path, chat_tok):
    """`prepare(..., tools=...)` puts the tools' description first in every prompt and names
    them in tools_kwargs; the Dataset reads the rows, and the call the message shows is one
    the parser and the runner accept."""
    from hfjax.tools import ToolRunner, parse_tool_calls, resolve_tools
    from hfjax.tools.prompt import system_message

    tools = resolve_tools("calculator,python", DESCRIBE_ONLY)
    paths = prepare("chain_sum", n_train=6, n_test=3, out_dir=tmp_path, seed=1,
                    tools="calculator,python")
    plain, _ = make_splits("chain_sum", 6, 3, seed=1)
    rows = pq.read_table(paths["train"]).to_pylist()
    system = system_message(tools)
    for row, bare in zip(rows, plain, strict=True):
        assert row["prompt"] == [{"role": "system", "content": system}] + bare["prompt"]
        assert row["agent_name"] == "tool_agent"
        assert row["extra_info"]["tools_kwargs"] == {
            name: {"create_kwargs": {"query": bare["prompt"][-1]["content"]}}
            for name in ("calculator", "python")}
        assert row["reward_model"] == bare["reward_model"]
    # The message carries each tool's name, description and argument schema, as JSON.
    for tool in tools.values():
        assert json.dumps(tool.schema()["function"]) in system
    # Its example call (the last tag; the first names the format) is one the calculator runs.
    calls = parse_tool_calls(system[system.rindex("<tool_call>"):])
    assert len(calls) == 1 and calls[0].name == "calculator"
    with ToolRunner({"calculator": tools["calculator"]}) as runner:
        [obs] = runner.run(calls)
    assert not obs.error and obs.text == "7006652"

    ds = Dataset.from_parquet(paths["train"], chat_tok, max_prompt_length=4096)
    assert len(ds) == 6 and ds.report.skipped == {}
    assert set(ds.rows[0]["tools_kwargs"]) == {"calculator", "python"}
    text = chat_tok.decode(ds.rows[0]["prompt_ids"])
    assert text.startswith("You have tools.") and "<tools>" in text
    assert text.endswith(rows[0]["prompt"][-1]["content"])


def test_tools_flag_keeps_an_existing_system_message_and_refuses_bad_specs():
    train, _ = make_splits("arith_tool", 2, 0, seed=0)
    from hfjax.data.prepare import with_tools

    row = dict(train[0], prompt=[{"role": "system", "content": "Be brief."}] + train[0]["prompt"])
    out = with_tools(row, "TOOLS", {"calculator": {"create_kwargs": {"query": "q"}}})
    assert out["prompt"][0] == {"role": "system", "content": "TOOLS\n\nBe brief."}
    assert out["prompt"][1:] == train[0]["prompt"] and row["prompt"][0]["content"] == "Be brief."
    with pytest.raises(ValueError, match="unknown tool 'abacus'"):
        make_splits("chain_sum", 2, 0, tools="abacus")
    with pytest.raises(ValueError, match="preference pairs.*drop --tools"):
        make_splits("arith_prefs", 2, 0, tools="calculator")
