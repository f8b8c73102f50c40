"""Held-out means unseen: every embedded task and prepared data set, at the sizes its config or
documented command uses, has no test problem in its training prompts, demonstrations or
preference pairs; loaders refuse overlapping files in one line."""

import subprocess
import sys

import pyarrow.parquet as pq
import pytest
from absl import logging

from configs import grpo_long_arith, grpo_tool_arith, ppo_arith
from hfjax.data import arith, holdout, tool_arith
from hfjax.data.dataset import task_dataset, task_splits
from hfjax.data.prepare import make_splits, prepare, write_rows
from hfjax.run.sft import arith_demonstrations


def _keys(rows):
    return {holdout.problem_key(r) for r in rows}


@pytest.mark.parametrize("config", [ppo_arith, grpo_long_arith, grpo_tool_arith],
                         ids=["arith", "arith_chain", "arith_tool"])
def test_embedded_tasks_are_disjoint_at_their_config_sizes(config):
    cfg = config.get_config()
    tok = (tool_arith if cfg.data.task == "arith_tool" else arith).tokenizer()
    train, test = task_splits(cfg, tok)
    assert len(test) == cfg.data.n_test and len(train) == cfg.data.n_train
    test_keys = _keys(test.rows)
    assert len(test_keys) == len(test)  # every test problem once
    assert not test_keys & _keys(train.rows)
    # The SFT demonstrations are written for the training rows (their prompts, decoded, for
    # the first 1,000 rows: the chain's 1,000-token demonstrations are slow to tokenize).
    demos = arith_demonstrations(cfg, tok, train.rows[:1000])
    demo_prompts = {holdout.normalize(tok.decode(list(e.prompt_ids))) for e in demos.examples}
    assert len(demo_prompts) > 100 and not test_keys & demo_prompts
    # Held out whatever the seed: another seed's training rows miss this seed's test rows.
    cfg.seed = 3
    assert not test_keys & _keys(task_dataset(cfg, tok, "train").rows)
    assert all(holdout.is_heldout(k) for k in test_keys)


def test_old_draws_overlapped_which_the_partition_prevents():
    # What the unpartitioned draws gave at the default job's sizes (the bug this module fixes).
    test = _keys(arith.problems(256, seed=10_000, max_b=9))
    train = _keys(arith.problems(20_000, seed=0, max_b=9))
    assert len(test & train) == len(test)
    assert not _keys(arith.problems(512, 10_000, 9, split="test")) & _keys(
        arith.problems(20_000, 0, 9, split="train"))


RG_SIZES = [  # documented commands (docs/, configs/), at their sizes
    ("gsm_symbolic", 512, 32, {}),
    ("chain_sum", 2048, 200, {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}),
    ("basic_arithmetic", 512, 100, {"min_terms": 2, "max_terms": 2, "min_digits": 3,
                                    "max_digits": 4, "operators": ["*"],
                                    "allow_parentheses": False, "allow_negation": False}),
    ("arith", 2000, 200, {"max_b": 99}),
    ("arith_tool", 2000, 200, {}),
]


@pytest.mark.parametrize("task,n_train,n_test,config", RG_SIZES, ids=[s[0] for s in RG_SIZES])
def test_prepared_tasks_are_disjoint_at_documented_sizes(task, n_train, n_test, config):
    train, test = make_splits(task, n_train, n_test, seed=0, config=dict(config))
    assert (len(train), len(test)) == (n_train, n_test)
    test_keys = _keys(test)
    assert len(test_keys) == n_test and not test_keys & _keys(train)
    assert all(holdout.is_heldout(k) for k in test_keys)
    # Another seed's train split shares nothing with this test split either.
    other, _ = make_splits(task, n_train, 0, seed=1, config=dict(config))
    assert not test_keys & _keys(other)


def test_preference_pairs_are_disjoint(tmp_path):
    # scripts/rlhf_arith.sh's pairs: prompts of the reward model's held-out pairs are in no
    # training pair, nor in the default job's training prompts.
    train, test = make_splits("arith_prefs", 1000, 200, seed=0,
                              config={"max_b": 9, "pairs_per_prompt": 4})
    assert len(train) == 4000 and len(test) == 800
    test_keys = _keys(test)
    assert not test_keys & _keys(train)
    rl_train = task_dataset(ppo_arith.get_config(), arith.tokenizer(), "train")
    assert not test_keys & _keys(rl_train.rows)


def test_prepare_refuses_a_test_file_that_overlaps_the_train_file(tmp_path, caplog):
    train, test = make_splits("arith", 50, 20, seed=0)
    write_rows(train + test[:3], tmp_path / "train.parquet")  # a train file holding 3 test rows
    with pytest.raises(ValueError, match=r"3 of 20 test problems .*--allow_overlap"):
        prepare("arith", 0, 20, tmp_path, seed=0)
    assert not (tmp_path / "test.parquet").exists()
    with caplog.at_level(logging.WARNING):
        paths = prepare("arith", 0, 20, tmp_path, seed=0, allow_overlap=True)
    assert pq.read_table(paths["test"]).num_rows == 20
    assert "allowed by --allow_overlap" in caplog.text
    # Beside a train file of its own making, a test split is accepted.
    prepare("arith", 50, 0, tmp_path, seed=0)
    prepare("arith", 0, 20, tmp_path, seed=0)


def test_prepare_data_command_refuses_overlap_in_one_line(tmp_path):
    train, test = make_splits("arith", 50, 20, seed=0)
    write_rows(train + test, tmp_path / "train.parquet")
    out = subprocess.run([sys.executable, "-m", "launch.prepare_data", "--task=arith",
                          "--n_train=0", "--n_test=20", f"--out={tmp_path}"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "20 of 20 test problems" in lines[0], out.stderr


def test_dataset_refuses_overlapping_parquet(tmp_path, caplog):
    train, test = make_splits("arith", 50, 20, seed=0)
    write_rows(train, tmp_path / "train.parquet")
    write_rows(test[:5] + train[:1], tmp_path / "test.parquet")
    cfg = ppo_arith.get_config()
    cfg.data.task = "parquet"
    cfg.data.train_files, cfg.data.val_files = (str(tmp_path / f"{s}.parquet")
                                                for s in ("train", "test"))
    with pytest.raises(ValueError, match=r"1 of 6 test problems .*data.allow_overlap=True"):
        task_splits(cfg, arith.tokenizer())
    cfg.data.allow_overlap = True
    with caplog.at_level(logging.WARNING):
        _, got = task_splits(cfg, arith.tokenizer())
    assert len(got) == 6 and "allowed by data.allow_overlap=True" in caplog.text
