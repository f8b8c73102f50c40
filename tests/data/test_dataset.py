"""Parquet prompt sets: round trip, validation, length filtering and the resumable iterator."""

import copy
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hfjax.data import arith
from hfjax.data.dataset import (
    BAD_GROUND_TRUTH,
    EMPTY_PROMPT,
    MALFORMED,
    TOO_LONG,
    Dataset,
    render_prompt,
    reward_meta,
)
from hfjax.data.prepare import write_rows


def gsm_row(i: int, answer: str = None, content: str = None) -> dict:
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": content or f"What is {i} + {i}?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer or str(2 * i)},
        "extra_info": {"split": "train", "index": i},
    }


def write(tmp_path, rows, name="train.parquet"):
    path = tmp_path / name
    write_rows(rows, path)
    return path


def test_parquet_round_trip(tmp_path, tok):
    rows = [gsm_row(i) for i in range(12)]
    path = write(tmp_path, rows)
    ds = Dataset.from_parquet(path, tok, max_prompt_length=64)
    assert len(ds) == 12
    assert ds.report.rows_read == 12 and ds.report.rows_kept == 12 and ds.report.skipped == {}
    for want, got in zip(rows, ds.rows):
        for key in ("data_source", "prompt", "ability", "reward_model", "extra_info"):
            assert got[key] == want[key], key
        content = want["prompt"][-1]["content"]
        # No chat template: the prompt is the last message's text, one token per character.
        assert got["prompt_ids"] == tok.encode(content, add_special_tokens=False)
        assert tok.decode(got["prompt_ids"]) == content
    meta = reward_meta(ds.rows[:3])
    assert meta["ground_truth"] == ["0", "2", "4"]
    assert meta["data_source"] == ["openai/gsm8k"] * 3
    assert meta["extra_info"][1] == {"split": "train", "index": 1}


def test_several_files_keep_order_and_name_rows(tmp_path, tok):
    a = write(tmp_path, [gsm_row(i) for i in range(3)], "a.parquet")
    b = write(tmp_path, [gsm_row(i) for i in range(3, 5)], "b.parquet")
    ds = Dataset.from_parquet([a, b], tok, max_prompt_length=64)
    assert [r["reward_model"]["ground_truth"] for r in ds.rows] == ["0", "2", "4", "6", "8"]


def test_chat_template_is_applied(tmp_path, chat_tok):
    rows = [gsm_row(1)]
    rows[0]["prompt"].insert(0, {"role": "system", "content": "Be brief."})
    ds = Dataset.from_parquet(write(tmp_path, rows), chat_tok, max_prompt_length=64)
    text = chat_tok.decode(ds.rows[0]["prompt_ids"], skip_special_tokens=False)
    assert text == "<|system|>Be brief.<|user|>What is 1 + 1?<|assistant|>"
    assert ds.rows[0]["prompt_ids"] == render_prompt(chat_tok, rows[0]["prompt"])


def test_long_prompts_are_dropped_and_counted(tmp_path, tok):
    rows = [gsm_row(i, content="x" * n) for i, n in enumerate([5, 10, 11, 30, 10, 2])]
    ds = Dataset.from_parquet(write(tmp_path, rows), tok, max_prompt_length=10)
    assert len(ds) == 4
    assert ds.report.too_long == 2 and ds.report.skipped == {TOO_LONG: 2}
    assert all(len(r["prompt_ids"]) <= 10 for r in ds.rows)
    assert "2 prompt longer than max_prompt_length" in ds.report.summary()


# -- bad data --------------------------------------------------------------------------------


def _table_with(rows_py, **override_types):
    """A parquet table built column by column, letting a test give a column a wrong type."""
    cols = {k: [r.get(k) for r in rows_py] for k in rows_py[0]}
    arrays = {k: pa.array(v, override_types.get(k)) for k, v in cols.items()}
    return pa.table(arrays)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda r: r["reward_model"].pop("ground_truth"),
         "row 2: missing field reward_model.ground_truth"),
        (lambda r: r["reward_model"].update(ground_truth=None),
         "row 2: missing field reward_model.ground_truth"),
        (lambda r: r.update(data_source=None), "row 2: missing field data_source"),
        (lambda r: r["prompt"][0].pop("content"), "row 2: missing field prompt[0].content"),
        (lambda r: r.update(reward_model=None), "row 2: missing field reward_model"),
    ],
)
def test_missing_fields_are_errors_naming_file_row_and_field(tmp_path, tok, mutate, message):
    rows = [gsm_row(i) for i in range(4)]
    mutate(rows[2])
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(ValueError, match=r"parquet .*bad\.parquet " + re.escape(message)):
        Dataset.from_parquet(path, tok, max_prompt_length=64)


def test_missing_column_is_an_error(tmp_path, tok):
    rows = [gsm_row(i) for i in range(3)]
    for r in rows:
        del r["reward_model"]
    path = tmp_path / "nocol.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(ValueError, match="missing column.*reward_model"):
        Dataset.from_parquet(path, tok, max_prompt_length=64)


def test_wrong_types_are_errors(tmp_path, tok):
    # ground_truth written as an integer column.
    rows = [gsm_row(i) for i in range(3)]
    for r in rows:
        r["reward_model"]["ground_truth"] = int(r["reward_model"]["ground_truth"])
    path = tmp_path / "int_gt.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(ValueError, match="row 0: field reward_model.ground_truth is int, "
                                         "expected str"):
        Dataset.from_parquet(path, tok, max_prompt_length=64)
    # prompt written as a plain string instead of chat messages.
    rows = [gsm_row(i) for i in range(3)]
    for r in rows:
        r["prompt"] = r["prompt"][0]["content"]
    path = tmp_path / "str_prompt.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(ValueError, match="row 0: field prompt is str, expected a list of"):
        Dataset.from_parquet(path, tok, max_prompt_length=64)


def test_unknown_data_source_names_it_and_the_known_ones(tmp_path, tok):
    rows = [gsm_row(i) for i in range(3)]
    rows[1]["data_source"] = "my/unknown_task"
    with pytest.raises(ValueError, match=r"row 1: no reward function for data_source "
                                         r"'my/unknown_task'; known: .*openai/gsm8k"):
        Dataset.from_parquet(write(tmp_path, rows), tok, max_prompt_length=64)


def test_unknown_reasoning_gym_task_is_an_error(tok):
    rows = [gsm_row(0)]
    rows[0]["data_source"] = "reasoning_gym/no_such_task"
    with pytest.raises(ValueError, match="reasoning-gym has no task 'no_such_task'"):
        Dataset(rows, tok, max_prompt_length=64)


def test_empty_prompts_and_unparseable_truths_are_counted_skips(tmp_path, tok, caplog):
    rows = [gsm_row(i) for i in range(8)]
    rows[1]["prompt"][0]["content"] = "   "
    rows[2]["prompt"] = []
    rows[4]["reward_model"]["ground_truth"] = "1,000"  # '####' extraction drops the comma
    rows[5]["reward_model"]["ground_truth"] = "twelve"
    rows[6]["reward_model"]["ground_truth"] = ""
    ds = Dataset.from_parquet(write(tmp_path, rows), tok, max_prompt_length=64)
    assert [r["extra_info"]["index"] for r in ds.rows] == [0, 3, 7]
    assert ds.report.skipped == {EMPTY_PROMPT: 2, BAD_GROUND_TRUTH: 3}
    assert ds.report.rows_read == 8 and ds.report.rows_kept == 3
    logged = caplog.text
    assert "row 4: ground truth '1,000' is not a plain number" in logged
    assert "row 1: empty prompt" in logged


def test_latex_ground_truths_are_checked_with_math_verify(tok):
    rows = [gsm_row(i) for i in range(3)]
    for r, gt in zip(rows, ["\\frac{1}{2}", "\\frac{", "x^2+1"]):
        r["data_source"] = "hfjax/math"
        r["reward_model"]["ground_truth"] = gt
    ds = Dataset(rows, tok, max_prompt_length=64)
    assert [r["reward_model"]["ground_truth"] for r in ds.rows] == ["\\frac{1}{2}", "x^2+1"]
    assert ds.report.skipped == {BAD_GROUND_TRUTH: 1}


def test_on_bad_row_skip_counts_malformed_rows(tok):
    rows = [gsm_row(i) for i in range(4)]
    rows[3]["reward_model"] = "42"
    ds = Dataset(rows, tok, max_prompt_length=64, on_bad_row="skip")
    assert len(ds) == 3 and ds.report.skipped == {MALFORMED: 1}


def test_no_usable_rows_is_an_error(tok):
    rows = [gsm_row(i, answer="n/a") for i in range(3)]
    with pytest.raises(ValueError, match="no usable rows.*3 ground truth"):
        Dataset(rows, tok, max_prompt_length=64)


def test_custom_reward_accepts_any_source_and_truth(tmp_path, tok):
    fn = tmp_path / "r.py"
    fn.write_text("def score(data_source, solution_str, ground_truth, extra_info):\n"
                  "    return 1.0\n")
    rows = [gsm_row(i, answer="anything goes") for i in range(3)]
    rows[0]["data_source"] = "my/own"
    ds = Dataset(rows, tok, max_prompt_length=64, custom_reward_fn=f"{fn}:score")
    assert len(ds) == 3


# -- iteration -------------------------------------------------------------------------------


def _draw(it, n):
    return [[r["extra_info"]["index"] for r in it.__next__()] for _ in range(n)]


def test_iterator_covers_each_epoch_without_repeats(tok):
    ds = Dataset([gsm_row(i) for i in range(10)], tok, max_prompt_length=64)
    it = ds.iterator(batch_size=3, seed=7)
    assert it.steps_per_epoch == 3
    batches = _draw(it, 6)
    first, second = sum(batches[:3], []), sum(batches[3:], [])
    assert len(set(first)) == 9 and len(set(second)) == 9  # one row left over each epoch
    assert first != second  # reshuffled
    assert it.state()["epoch"] == 1
    # Same seed, same sequence; another seed, another one.
    assert _draw(ds.iterator(3, seed=7), 6) == batches
    assert _draw(ds.iterator(3, seed=8), 6) != batches


def test_iterator_state_restores_the_identical_continuation(tok):
    ds = Dataset([gsm_row(i) for i in range(11)], tok, max_prompt_length=64)
    it = ds.iterator(batch_size=4, seed=3)
    _draw(it, 5)  # into the third epoch
    state = copy.deepcopy(it.state())
    assert set(state) == {"seed", "epoch", "cursor", "num_rows", "fingerprint"}
    assert all(isinstance(v, int) for v in state.values())
    want = _draw(it, 7)

    # A fresh process: a new dataset from the same rows, a new iterator, the saved state.
    again = Dataset([gsm_row(i) for i in range(11)], tok, max_prompt_length=64)
    resumed = again.iterator(batch_size=4, seed=999)
    resumed.restore(state)
    assert _draw(resumed, 7) == want


def test_iterator_refuses_state_from_other_data(tok):
    ds = Dataset([gsm_row(i) for i in range(10)], tok, max_prompt_length=64)
    state = ds.iterator(2, seed=0).state()
    other = Dataset([gsm_row(i) for i in range(1, 11)], tok, max_prompt_length=64)
    with pytest.raises(ValueError, match="saved for 10 rows .* same data files"):
        other.iterator(2, seed=0).restore(state)


def test_iterator_batch_larger_than_dataset_is_an_error(tok):
    ds = Dataset([gsm_row(i) for i in range(3)], tok, max_prompt_length=64)
    with pytest.raises(ValueError, match="batch_size 4 is larger than the dataset"):
        ds.iterator(4, seed=0)


def test_arith_task_through_the_same_api():
    ds = Dataset.arith(n=64, seed=0, max_prompt_length=8)
    tok = arith.tokenizer()
    want = arith.problems(64, seed=0)
    assert len(ds) == 64 and ds.report.skipped == {}
    assert ds.rows[5]["reward_model"]["ground_truth"] == want[5]["reward_model"]["ground_truth"]
    assert tok.decode(ds.rows[5]["prompt_ids"]) == want[5]["prompt"][0]["content"]
    it = ds.iterator(16, seed=0)
    batch = next(it)
    assert len(batch) == 16 and len({r["extra_info"]["index"] for r in batch}) == 16
    assert np.all([len(r["prompt_ids"]) <= 8 for r in batch])
