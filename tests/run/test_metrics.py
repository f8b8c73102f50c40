"""Metric sinks: the JSONL format (sorted keys, floats that read back bit for bit), what a
resume keeps, TensorBoard purging, the console summary, the plot, and the optional sinks."""

import json
import struct
import subprocess
import sys

import numpy as np
import pytest
from support import subprocess_env

from hfjax.run import metrics


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


def test_jsonl_lines_are_sorted_and_floats_read_back_bitwise(tmp_path):
    values = {"actor/pg_loss": 0.1 + 0.2, "critic/score/mean": float(np.float32(1) / 3),
              "tiny": 5e-324, "neg": -1.2345678901234567e-300, "actor/entropy": 2.0}
    sink = metrics.JsonlSink(str(tmp_path / "m.jsonl"))
    sink.start(None)
    sink.write(7, values)
    sink.close()
    line = (tmp_path / "m.jsonl").read_text().strip()
    keys = list(json.loads(line))
    assert keys == sorted(keys) and keys[0] == "actor/entropy"
    back = metrics.read_jsonl(str(tmp_path / "m.jsonl"))[0]
    assert back["step"] == 7
    for k, v in values.items():
        assert _bits(back[k]) == _bits(v), k


def test_jsonl_rejects_non_scalars(tmp_path):
    sink = metrics.JsonlSink(str(tmp_path / "m.jsonl"))
    sink.start(None)
    with pytest.raises(TypeError, match="'x' is ndarray"):
        sink.write(1, {"x": np.zeros(2)})
    sink.close()


def test_resume_keeps_records_up_to_the_step_and_drops_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = metrics.MetricsLogger([metrics.JsonlSink(str(path))])
    log.start(None)
    for s in range(6):
        log.log(s, {"critic/score/mean": s / 10})
    log.close()
    with open(path, "a") as f:
        f.write('{"step": 6, "critic/sco')  # a write cut off by SIGKILL
    log = metrics.MetricsLogger([metrics.JsonlSink(str(path))])
    log.start(3)
    assert [r["step"] for r in log.history] == [0, 1, 2, 3]
    log.log(4, {"critic/score/mean": 0.9})
    log.close()
    assert [r["step"] for r in metrics.read_jsonl(str(path))] == [0, 1, 2, 3, 4]
    assert metrics.read_jsonl(str(path))[-1]["critic/score/mean"] == 0.9
    # A fresh start (no resume) begins an empty file.
    log = metrics.MetricsLogger([metrics.JsonlSink(str(path))])
    log.start(None)
    log.close()
    assert metrics.read_jsonl(str(path)) == []


def test_a_broken_line_in_the_middle_is_an_error(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 0}\nnot json\n{"step": 1}\n')
    with pytest.raises(ValueError, match="line 2 is damaged .*move .*m.jsonl aside") as err:
        metrics.read_jsonl(str(path))
    assert "\n" not in str(err.value)


def test_timing_keys():
    assert metrics.is_timing_key("timing_s/gen")
    assert metrics.is_timing_key("perf/throughput")
    assert not metrics.is_timing_key("perf/total_num_tokens")
    assert not metrics.is_timing_key("critic/score/mean")


def test_tensorboard_writes_and_purges_on_resume(tmp_path):
    sink = metrics.TensorBoardSink(str(tmp_path / "tb"))
    sink.start(None)
    sink.write(1, {"critic/score/mean": 0.5})
    sink.close()
    sink = metrics.TensorBoardSink(str(tmp_path / "tb"))
    sink.start(0)
    sink.write(1, {"critic/score/mean": 0.7})
    sink.close()
    events = _read_events(tmp_path / "tb")
    # The resumed writer logs a purge marker from step 1 on, so readers drop the old step 1.
    assert any(e.get("file_version", "").startswith("brain.Event") for e in events)
    scalars = [(e["step"], e["value"]) for e in events if "value" in e]
    assert scalars == [(1, pytest.approx(0.5)), (1, pytest.approx(0.7))]
    assert any(e.get("session_log") == "START" and e["step"] == 1 for e in events)


def test_tensorboard_sink_does_not_load_torch(tmp_path):
    """A run's TensorBoard sink leaves torch unloaded (tensorboardX would import it, seconds of
    every run's start-up); the events it writes are read back."""
    code = ("import sys; from hfjax.run import metrics; s = metrics.TensorBoardSink(sys.argv[1]); "
            "s.start(None); s.write(3, {'a': 1.5}); s.close(); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "tb")], env=subprocess_env(),
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.strip() == "False"
    assert [(e["step"], e["value"]) for e in _read_events(tmp_path / "tb") if "value" in e] == [
        (3, pytest.approx(1.5))]


def _read_events(d):
    """(step, tag, value) events from tensorboardX files, read with its own protobufs."""
    from tensorboardX.proto import event_pb2

    out = []
    for f in sorted(d.iterdir()):
        data = f.read_bytes()
        i = 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            ev = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
            i += 12 + n + 4
            rec = {"step": ev.step}
            if ev.file_version:
                rec["file_version"] = ev.file_version
            if ev.HasField("session_log"):
                rec["session_log"] = event_pb2.SessionLog.SessionStatus.Name(ev.session_log.status)
            for v in ev.summary.value:
                rec["value"] = v.simple_value
            out.append(rec)
    return out


def test_console_summary_lines():
    lines = []
    sink = metrics.ConsoleSink(lines.append, every=2)
    sink.start(None)
    sink.write(1, {"critic/score/mean": 0.25})
    sink.write(2, {"critic/score/mean": 0.5, "actor/pg_loss": -0.125})
    sink.write(3, {"critic/score/mean": 0.75, "val-core/a/acc/mean@1": 0.5})
    assert lines == ["step 2: critic/score/mean=0.5 actor/pg_loss=-0.125",
                     "step 3: val-core/a/acc/mean@1=0.5000"]


def test_plot_is_a_png_and_needs_data(tmp_path):
    records = [{"step": 0, "val-core/x/acc/mean@1": 0.1}]
    records += [{"step": s, "critic/score/mean": s / 10} for s in range(1, 6)]
    records += [{"step": 5, "val-core/x/acc/mean@1": 0.6}]
    png = metrics.plot_run(records, str(tmp_path / "p.png"))
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert metrics.plot_run([{"step": 1, "other": 1.0}], str(tmp_path / "q.png")) is None


def test_val_accuracy_averages_sources():
    r = {"val-core/a/acc/mean@1": 0.5, "val-core/b/acc/mean@1": 1.0, "critic/score/mean": 0.0}
    assert metrics.val_accuracy(r) == 0.75
    assert metrics.val_accuracy({"critic/score/mean": 0.0}) is None


def test_sink_names_and_lazy_wandb(tmp_path):
    with pytest.raises(ValueError, match="unknown sink"):
        metrics.make_logger("console,tensorbored", str(tmp_path))
    log = metrics.make_logger("console, jsonl", str(tmp_path), console=print)
    assert [type(s).__name__ for s in log.sinks] == ["ConsoleSink", "JsonlSink"]
    log.start(None)
    log.log(1, {"a": 1.0})
    log.close()
    # The trackers' packages are imported only when their sinks start (another test in this
    # process may have started one already).
    loaded = {m for m in ("wandb", "mlflow") if m in sys.modules}
    w = metrics.make_logger("wandb,mlflow", str(tmp_path))
    assert [type(s).__name__ for s in w.sinks] == ["WandbSink", "MlflowSink"]
    assert {m for m in ("wandb", "mlflow") if m in sys.modules} == loaded


def test_memory_tracking_is_a_no_op_on_cpu():
    assert metrics.start_memory_tracking(False) is False
    assert metrics.start_memory_tracking(True) is False  # the suite runs on CPU
