"""Metric sinks for a run: JSONL, TensorBoard, a console summary and the optional trackers
(W&B, MLflow: `hfjax.run.trackers`), plus the PNG plot of reward and validation accuracy.

Every sink gets the same records: `(step, {name: float})`, one per RL step, with verl's metric
names (`critic/score/mean`, `actor/pg_loss`, `timing_s/gen`, `val-core/<source>/acc/mean@1`, …).
Step 0 holds what happens before the first RL step: the warm start's last loss and the
validation before training.

Resuming at step s keeps what the sinks already hold up to s and drops what came after (that work
is redone): the JSONL file is rewritten without the later lines and TensorBoard purges the later
events, so a resumed run's files read like an uninterrupted run's.

`metrics.jsonl` is strict JSON (RFC 8259), so any JSON reader takes it; the record's encoding and
`read_jsonl` live in `hfjax.run.records`, which the trackers share.

Library code prints nothing: the console sink writes through a callable that the launcher gives.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from absl import logging

from hfjax.config.validators import parse_sink_names
from hfjax.run.records import encode_record, format_record, read_jsonl, scalars

JSONL_NAME = "metrics.jsonl"
PLOT_NAME = "metrics.png"
TENSORBOARD_DIR = "tensorboard"
# Keys that measure wall-clock time: they differ between two runs of the same job, so
# comparisons of runs (the exact-resume test) leave them out. So do the compile records
# (`hfjax.controller.compile_log`): a resumed process compiles its programs again.
TIMING_PREFIXES = ("timing_s/", "perf/throughput", "perf/time_per_step", "perf/mfu/",
                   "compile/", "compile_s/", "async/push_s")
REWARD_KEY = "critic/score/mean"
# `val-core/<data_source>/acc/mean@<n>`: the mean score over n samples per held-out prompt.
_VAL_ACC = re.compile(r"^val-core/.+/acc/mean@\d+$")


def is_timing_key(name: str) -> bool:
    """True for wall-clock metrics (see TIMING_PREFIXES)."""
    return name.startswith(TIMING_PREFIXES)


def val_accuracy(record: Mapping[str, Any]) -> float | None:
    """The mean of a record's `val-core/*/acc/mean@<n>` entries, or None when it has none."""
    accs = [v for k, v in record.items() if _VAL_ACC.match(k)]
    return sum(accs) / len(accs) if accs else None


class Sink(Protocol):
    """Receives the run's records. `start` comes first, with the step the run resumed from."""

    def start(self, resumed_from: int | None) -> None: ...

    def write(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One line per step in `<out_dir>/metrics.jsonl`, flushed as it is written."""

    def __init__(self, path: str):
        self.path = path
        self._f = None
        self.history: list[dict] = []

    def start(self, resumed_from: int | None) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        kept = []
        if resumed_from is not None:
            kept = [r for r in read_jsonl(self.path) if r["step"] <= resumed_from]
        # Rewritten under a temporary name and renamed: a crash here leaves the old file whole.
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            for r in kept:
                f.write(encode_record(r) + "\n")
        os.replace(tmp, self.path)
        self.history = kept
        self._f = open(self.path, "a")

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        line = format_record(step, metrics)
        self._f.write(line + "\n")
        self._f.flush()
        self.history.append({"step": int(step), **scalars(metrics)})

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def _summary_writer_class():
    """tensorboardX's SummaryWriter, imported without torch where torch is not loaded yet.

    tensorboardX's writer imports torch whenever it is installed, only to accept torch tensors,
    which hfjax never passes; that import is most of the cost of starting a short run (about 2 s
    of CPU, more than jax's own). A missing `sys.modules` entry would let it load torch; `None`
    makes its `import torch` fail, as on a machine without torch, for the length of this import.
    """
    import sys

    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class TensorBoardSink:
    """Scalars in `<out_dir>/tensorboard` (tensorboardX)."""

    def __init__(self, logdir: str):
        self.logdir = logdir
        self._w = None

    def start(self, resumed_from: int | None) -> None:
        SummaryWriter = _summary_writer_class()
        # purge_step drops events a killed run wrote after the step it resumes from.
        purge = None if resumed_from is None else resumed_from + 1
        # A unique suffix: a writer started within the same second must not reuse a file name.
        self._w = SummaryWriter(logdir=self.logdir, purge_step=purge,
                                filename_suffix=f".{os.getpid()}.{time.time_ns()}")

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        for k, v in scalars(metrics).items():
            self._w.add_scalar(k, v, global_step=step)
        self._w.flush()

    def close(self) -> None:
        if self._w is not None:
            self._w.close()
            self._w = None


class ConsoleSink:
    """A one-line summary of chosen keys every `every` steps (0: only at validation steps),
    written through `write` (the launcher's print)."""

    KEYS = (REWARD_KEY, "actor/pg_loss", "actor/entropy", "response_length/mean",
            "perf/throughput")

    def __init__(self, write: Callable[[str], None], every: int = 0):
        self._write = write
        self.every = every

    def start(self, resumed_from: int | None) -> None:
        pass

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        acc = val_accuracy(metrics)
        due = self.every and step % self.every == 0
        if not due and acc is None:
            return
        parts = [f"step {step}:"]
        if due:
            parts += [f"{k}={metrics[k]:.4g}" for k in self.KEYS if k in metrics]
        parts += [f"{k}={v:.4f}" for k, v in sorted(metrics.items()) if k.startswith("val-core/")]
        self._write(" ".join(parts))

    def close(self) -> None:
        pass


class MetricsLogger:
    """Fans records out to sinks. `history` holds every record of the run: those kept from
    before a resume (from the JSONL sink) and those logged since."""

    def __init__(self, sinks: Sequence[Sink] = ()):
        self.sinks = list(sinks)
        self.history: list[dict] = []

    def start(self, resumed_from: int | None) -> None:
        for s in self.sinks:
            s.start(resumed_from)
        for s in self.sinks:
            if isinstance(s, JsonlSink):
                self.history = list(s.history)
                break

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for s in self.sinks:
            s.write(step, metrics)
        self.history.append({"step": int(step), **scalars(metrics)})

    def close(self) -> None:
        for s in self.sinks:
            s.close()


def make_logger(
    names: str | Iterable[str],
    out_dir: str,
    *,
    console: Callable[[str], None] | None = None,
    console_every: int = 0,
    wandb_project: str = "hfjax",
    wandb_name: str = "",
    config: Mapping[str, Any] | None = None,
    extra: Sequence[Sink] = (),
) -> MetricsLogger:
    """A logger with the named sinks under out_dir, plus `extra` sinks (e.g. a progress bar).
    The console sink needs `console`, the callable that prints. The trackers take
    `wandb_project` (W&B's project, MLflow's experiment), `wandb_name` (the run's name;
    default: out_dir's name) and `config` (logged as the run's parameters)."""
    sinks: list[Sink] = []
    for n in parse_sink_names(names):
        if n == "jsonl":
            sinks.append(JsonlSink(os.path.join(out_dir, JSONL_NAME)))
        elif n == "tensorboard":
            sinks.append(TensorBoardSink(os.path.join(out_dir, TENSORBOARD_DIR)))
        elif n in ("wandb", "mlflow"):
            from hfjax.run import trackers

            cls = trackers.WandbSink if n == "wandb" else trackers.MlflowSink
            sinks.append(cls(wandb_project, wandb_name or os.path.basename(os.path.abspath(
                out_dir)), config, out_dir))
        elif n == "console" and console is not None:
            sinks.append(ConsoleSink(console, console_every))
    return MetricsLogger([*sinks, *extra])


def plot_run(records: Sequence[Mapping[str, Any]], path: str, title: str = "") -> str | None:
    """Writes a PNG of training reward and validation accuracy against step; returns the path,
    or None when the records hold neither."""
    reward = [(r["step"], r[REWARD_KEY]) for r in records if REWARD_KEY in r]
    val = [(r["step"], a) for r in records if (a := val_accuracy(r)) is not None]
    if not reward and not val:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if reward:
        ax.plot(*zip(*reward), label=f"train reward ({REWARD_KEY})", lw=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation accuracy (val-core mean)", lw=1.5)
    ax.set_xlabel("RL step")
    values = [v for _, v in reward + val if not math.isnan(v)]
    if values and all(0 <= v <= 1 for v in values):
        # The [0, 1] score range, unless every value is small (a format-credit reward such as
        # 0.01 per answered problem): then zoom in so the trend shows.
        top = 1.0 if max(values) > 0.25 else max(max(values) * 1.15, 1e-3)
        ax.set_ylim(-0.02 * top, top * 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    if title:
        ax.set_title(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def start_memory_tracking(enabled: bool) -> bool:
    """Starts jax-smi's device-memory tracking when enabled on a GPU/TPU backend (a no-op on
    CPU, where devices report no memory stats); returns whether tracking runs."""
    if not enabled:
        return False
    import jax

    if jax.default_backend() == "cpu":
        logging.info("trainer.jax_smi: no device memory to track on CPU")
        return False
    from jax_smi import initialise_tracking

    initialise_tracking()
    return True
