"""prepare_data writes verl-schema parquet that the Dataset loads and the rewards score."""

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hfjax.data.dataset import Dataset
from hfjax.data.prepare import GSM_SUFFIX, make_splits, prepare
from hfjax.rewards.registry import get_reward_fn

VERL_COLUMNS = ["data_source", "prompt", "ability", "reward_model", "extra_info"]


def test_gsm_symbolic_files_have_verls_schema(tmp_path, tok):
    paths = prepare("gsm_symbolic", n_train=12, n_test=4, out_dir=tmp_path, seed=0)
    assert set(paths) == {"train", "test"}
    train, test = pq.read_table(paths["train"]), pq.read_table(paths["test"])
    assert train.num_rows == 12 and test.num_rows == 4
    schema = train.schema
    assert schema.names == VERL_COLUMNS
    assert schema.field("data_source").type == pa.string()
    assert schema.field("prompt").type == pa.list_(
        pa.struct([("role", pa.string()), ("content", pa.string())]))
    assert schema.field("reward_model").type == pa.struct(
        [("style", pa.string()), ("ground_truth", pa.string())])
    rows = train.to_pylist()
    r = rows[0]
    assert r["data_source"] == "reasoning_gym/gsm_symbolic" and r["ability"] == "math"
    assert r["prompt"][0]["role"] == "user"
    assert r["prompt"][0]["content"].endswith(" " + GSM_SUFFIX)
    assert r["reward_model"]["style"] == "rule"
    entry = json.loads(r["extra_info"]["entry"])
    assert entry["answer"] == r["reward_model"]["ground_truth"]
    assert [x["extra_info"]["index"] for x in rows] == list(range(12))
    assert {x["extra_info"]["split"] for x in rows} == {"train"}
    # Disjoint splits.
    questions = {x["extra_info"]["question"] for x in rows}
    assert not questions & {x["extra_info"]["question"] for x in test.to_pylist()}

    # The files load through the Dataset, and their own answers score 1 with the reward.
    ds = Dataset.from_parquet(paths["train"], tok, max_prompt_length=1024)
    assert len(ds) == 12 and ds.report.skipped == {}
    for row in ds.rows[:4]:
        fn = get_reward_fn(row["data_source"])
        truth = row["reward_model"]["ground_truth"]
        assert fn(row["data_source"], f"...\n#### {truth}", truth, row["extra_info"]) == 1.0


def test_same_seed_same_rows_other_seed_other_rows():
    a, _ = make_splits("chain_sum", 5, 2, seed=1)
    b, _ = make_splits("chain_sum", 5, 2, seed=1)
    c, _ = make_splits("chain_sum", 5, 2, seed=2)
    assert a == b and a != c


@pytest.mark.parametrize("task", ["basic_arithmetic", "countdown", "chain_sum", "arith"])
def test_other_tasks_load_and_score(tmp_path, tok, task):
    paths = prepare(task, n_train=6, n_test=2, out_dir=tmp_path, seed=0)
    ds = Dataset.from_parquet(list(paths.values()), tok, max_prompt_length=2048)
    assert len(ds) == 8
    want = "hfjax/arith" if task == "arith" else f"reasoning_gym/{task}"
    assert {r["data_source"] for r in ds.rows} == {want}
    row = ds.rows[0]
    truth = row["reward_model"]["ground_truth"]
    fn = get_reward_fn(row["data_source"])
    assert fn(row["data_source"], f"#### {truth}", truth, row["extra_info"]) == 1.0


def test_too_few_distinct_problems_is_an_error():
    with pytest.raises(ValueError, match="distinct problems"):
        make_splits("arith", 200, 0, config={"max_b": 1})  # 180 distinct


def test_command_line(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "launch.prepare_data", "--task=chain_sum", "--n_train=3",
         "--n_test=2", f"--out={tmp_path}", "--seed=0"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    assert "train.parquet: 3 rows" in out.stdout and "test.parquet: 2 rows" in out.stdout
    assert pq.read_table(tmp_path / "test.parquet").num_rows == 2
