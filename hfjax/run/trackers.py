"""Experiment trackers as metric sinks: Weights & Biases and MLflow, each an optional extra
(`pip install -e ".[wandb]"`, `".[mlflow]"`), imported only when `trainer.logger` names it.

Both get metrics.jsonl's records under the same names (MLflow refuses `@` in a name, so
`val-core/<source>/acc/mean@1` is logged there as `.../mean_at_1`, see `mlflow_name`), and the
run's resolved config as the tracker run's parameters (W&B's config; MLflow's params, one per
dotted key). Neither needs a network or an account by default:

- W&B runs offline (files under `<out_dir>/wandb`, uploaded later with `wandb sync`) unless the
  environment sets `WANDB_MODE` (e.g. `online`, with `WANDB_API_KEY`).
- MLflow writes to a local `file:` store in `<out_dir>/mlruns` unless `MLFLOW_TRACKING_URI` is
  set. MLflow 3 keeps that store in maintenance mode behind `MLFLOW_ALLOW_FILE_STORE=true`,
  which the sink sets for its own default store (and which `mlflow ui --backend-store-uri
  file:<out_dir>/mlruns` then needs too).

A tracker's run id is kept in `<out_dir>/trackers.json`, so a resumed run (trainer.resume)
continues the same tracker run instead of starting a new one. The steps redone after a resume
are logged again: W&B's history and MLflow's metric history then hold a step twice (the later
value is the resumed run's), where metrics.jsonl and TensorBoard drop the earlier one.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping
from typing import Any

from hfjax.run.records import scalars

IDS_NAME = "trackers.json"


def read_ids(out_dir: str) -> dict[str, str]:
    """{tracker: run id} of the runs this out_dir logged to."""
    path = os.path.join(out_dir, IDS_NAME)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _write_id(out_dir: str, tracker: str, run_id: str) -> None:
    ids = read_ids(out_dir) | {tracker: run_id}
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, IDS_NAME + ".tmp")
    with open(tmp, "w") as f:
        json.dump(ids, f, indent=2, sort_keys=True)
    os.replace(tmp, os.path.join(out_dir, IDS_NAME))


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as {dotted key: value as text} (lists and None as JSON)."""
    out = {}
    for k, v in config.items():
        if isinstance(v, Mapping):
            out |= flat_params(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, str) else json.dumps(v)
    return out


class WandbSink:
    """Weights & Biases (offline unless WANDB_MODE says otherwise)."""

    def __init__(self, project: str, name: str, config: Mapping[str, Any] | None, out_dir: str):
        self.project, self.name, self.out_dir = project, name, out_dir
        self.config = dict(config or {})
        self._run = None

    def start(self, resumed_from: int | None) -> None:
        import wandb

        run_id = read_ids(self.out_dir).get("wandb") if resumed_from is not None else None
        kw: dict[str, Any] = {}
        if not os.environ.get("WANDB_MODE"):
            kw["mode"] = "offline"
        os.makedirs(self.out_dir, exist_ok=True)
        # Library code prints nothing: no banner, no capture of the process's console.
        settings = wandb.Settings(silent=True, console="off")
        self._run = wandb.init(
            project=self.project, name=self.name, config=self.config, dir=self.out_dir,
            id=run_id, resume="allow" if run_id else None,
            settings=settings, **kw)
        _write_id(self.out_dir, "wandb", self._run.id)

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(scalars(metrics), step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


_MLFLOW_BAD = re.compile(r"[^\w\-. :/]")


def mlflow_name(key: str) -> str:
    """A metric name as MLflow accepts it: `@` becomes `_at_` (`acc/mean@1` -> `acc/mean_at_1`),
    any other character MLflow refuses becomes `_`; every other name is unchanged."""
    return _MLFLOW_BAD.sub("_", key.replace("@", "_at_"))


class MlflowSink:
    """MLflow, through its client: a local `file:` store under out_dir unless
    MLFLOW_TRACKING_URI is set."""

    def __init__(self, experiment: str, name: str, config: Mapping[str, Any] | None,
                 out_dir: str):
        self.experiment, self.name, self.out_dir = experiment, name, out_dir
        self.config = dict(config or {})
        self.client = None
        self.run_id: str | None = None

    @staticmethod
    def tracking_uri(out_dir: str) -> str:
        return (os.environ.get("MLFLOW_TRACKING_URI")
                or "file:" + os.path.join(os.path.abspath(out_dir), "mlruns"))

    def start(self, resumed_from: int | None) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # MLflow 3 refuses a `file:` store unless opted in; the store is ours (the user set
            # none), so opt in for it.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=self.tracking_uri(self.out_dir))
        run_id = read_ids(self.out_dir).get("mlflow") if resumed_from is not None else None
        if run_id:
            self.client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
            return
        exp = self.client.get_experiment_by_name(self.experiment)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(self.experiment)
        self.run_id = self.client.create_run(exp_id, run_name=self.name).info.run_id
        params = [Param(k, v[:6000]) for k, v in flat_params(self.config).items()]
        for i in range(0, len(params), 100):  # MLflow's batch limit
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        _write_id(self.out_dir, "mlflow", self.run_id)

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(mlflow_name(k), v, now, int(step)) for k, v in scalars(metrics).items()]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i:i + 1000])

    def close(self) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id)
            self.client = None
