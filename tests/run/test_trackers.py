"""The W&B and MLflow sinks (`trainer.logger=...,wandb,mlflow`): the values each tracker holds,
read back with its own reader, are metrics.jsonl's; the config is the run's parameters; a
resumed run continues the same tracker run; a missing extra is refused in one line.

MLflow is read with its client (`MlflowClient.get_metric_history`). W&B's offline run is read
from its run file (`run-<id>.wandb`): wandb ships no Python reader for it since its Go core
writes it, so `_wandb_records` splits the file's framing (a LevelDB log: 7-byte headers in
32 KiB blocks after wandb's 7-byte file header) and decodes each record with wandb's own
protobuf class, `wandb.proto.wandb_internal_pb2.Record`."""

import glob
import json
import math
import os
import sys

import pytest

from hfjax.config import ConfigError, check_config
from hfjax.run import metrics, trackers

pytest.importorskip("wandb")
pytest.importorskip("mlflow")

CONFIG = {"algorithm": "grpo", "actor": {"lr": 1e-6, "mesh": "fsdp=8"},
          "rollout": {"n": 4, "stop": ["</answer>"]}, "trainer": {"out_dir": "runs/x"}}


def _record(step):
    return {"critic/score/mean": 0.1 * step, "actor/pg_loss": -0.5 + step,
            "val-core/arith/acc/mean@1": step / 10, "timing_s/gen": 1.5 + step}


def _run(out_dir, steps, resumed_from=None):
    log = metrics.make_logger("jsonl,wandb,mlflow", str(out_dir), wandb_project="hfjax-test",
                              config=CONFIG)
    log.start(resumed_from)
    for step in steps:
        log.log(step, _record(step))
    log.close()


def _wandb_records(path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, block, pending, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length = int.from_bytes(data[pos + 4:pos + 6], "little")
        kind = data[pos + 6]  # 1 full, 2 first, 3 middle, 4 last
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    for var in ("WANDB_MODE", "MLFLOW_TRACKING_URI", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_trackers_hold_the_jsonl_values_and_a_resume_continues_their_runs(tmp_path):
    out = tmp_path / "run"
    _run(out, range(0, 5))
    ids = trackers.read_ids(str(out))
    _run(out, range(3, 7), resumed_from=2)  # steps 3 and 4 are redone
    assert trackers.read_ids(str(out)) == ids and set(ids) == {"wandb", "mlflow"}
    want = {r["step"]: r for r in metrics.read_jsonl(str(out / metrics.JSONL_NAME))}
    assert sorted(want) == list(range(7))

    # MLflow: one run in the local file store under out_dir, the config as its params.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri="file:" + str(out / "mlruns"))
    exp = client.get_experiment_by_name("hfjax-test")
    runs = client.search_runs([exp.experiment_id])
    assert [r.info.run_id for r in runs] == [ids["mlflow"]]
    assert runs[0].data.params == {"algorithm": "grpo", "actor.lr": "1e-06",
                                   "actor.mesh": "fsdp=8", "rollout.n": "4",
                                   "rollout.stop": '["</answer>"]', "trainer.out_dir": "runs/x"}
    assert runs[0].info.status == "FINISHED"
    for key in _record(0):
        history = client.get_metric_history(ids["mlflow"], trackers.mlflow_name(key))
        got = {}
        for m in sorted(history, key=lambda m: m.timestamp):  # a redone step: the later value
            got[m.step] = m.value
        assert got == {s: r[key] for s, r in want.items()}, key
    assert trackers.mlflow_name("val-core/arith/acc/mean@1") == "val-core/arith/acc/mean_at_1"

    # W&B: the offline run files, one per process start, under the same run id.
    files = sorted(glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(files) == 2 and all(f.endswith(f"run-{ids['wandb']}.wandb") for f in files)
    got, config = {}, {}
    for f in files:
        for rec in _wandb_records(f):
            kind = rec.WhichOneof("record_type")
            if kind == "run":  # the run's start, with its config
                assert rec.run.run_id == ids["wandb"] and rec.run.project == "hfjax-test"
                config |= {i.key: json.loads(i.value_json) for i in rec.run.config.update}
            elif kind == "config":  # later config updates
                config |= {i.key: json.loads(i.value_json) for i in rec.config.update}
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                         for i in rec.history.item}
                got[items.pop("_step")] = {k: v for k, v in items.items()
                                           if not k.startswith("_")}
    assert {k: config[k] for k in CONFIG} == CONFIG
    assert sorted(got) == list(range(7))
    for step, record in want.items():
        expected = {k: v for k, v in record.items() if k != "step"}
        assert got[step].keys() == expected.keys()
        assert all(math.isclose(got[step][k], v, rel_tol=0, abs_tol=0) for k, v in
                   expected.items()), step


def test_a_fresh_run_in_the_same_out_dir_starts_new_tracker_runs(tmp_path):
    _run(tmp_path, [0])
    first = trackers.read_ids(str(tmp_path))
    _run(tmp_path, [0])  # not a resume
    second = trackers.read_ids(str(tmp_path))
    assert first["mlflow"] != second["mlflow"] and first["wandb"] != second["wandb"]


def test_a_set_tracking_uri_is_used(tmp_path, monkeypatch):
    store = tmp_path / "elsewhere"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "file:" + str(store))
    log = metrics.make_logger("mlflow", str(tmp_path / "run"), config=CONFIG)
    log.start(None)
    log.log(0, _record(0))
    log.close()
    assert os.path.isdir(store) and not os.path.exists(tmp_path / "run" / "mlruns")


@pytest.mark.parametrize("tracker,extra", [("wandb", "wandb"), ("mlflow", "mlflow")])
def test_a_missing_extra_is_refused_at_the_config_in_one_line(tracker, extra, monkeypatch):
    from configs import ppo_arith

    c = ppo_arith.get_config()
    c.trainer.logger = f"jsonl,{tracker}"
    check_config(c)  # installed: accepted
    monkeypatch.setitem(sys.modules, tracker, None)  # as if the package were absent
    with pytest.raises(ConfigError) as err:
        check_config(c)
    msg = str(err.value)
    assert "\n" not in msg and f'pip install -e ".[{extra}]"' in msg and tracker in msg
