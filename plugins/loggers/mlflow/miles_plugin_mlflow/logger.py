"""MLflow sink through ``MlflowClient``: no global active run, so nothing else in the process
(a user's own mlflow calls) is disturbed."""
from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import yaml
from miles import MilesError
from miles_sinks import HeldPoints, earlier_rows, numeric, read_config

from .config import MlflowConfig

ID_FILE = "mlflow_run_id"
MAX_PARAM = 6000  # MLflow's limit on a parameter value's length
BATCH = 100  # MLflow's limit on parameters per log_batch call
METRICS_BATCH = 1000  # MLflow's limit on metrics per log_batch call


def key(name: str) -> str:
    """A metric or parameter name MLflow accepts (letters, digits, ``_-. /``; others become ``_``)."""
    return re.sub(r"[^\w\-. /]", "_", name)[:250]


def flatten(config: Any, prefix: str = "") -> dict[str, str]:
    """``{"run": {"steps": 4}}`` -> ``{"run.steps": "4"}`` (MLflow parameters are flat strings)."""
    if isinstance(config, dict) and config:
        out: dict[str, str] = {}
        for k, v in config.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {key(prefix[:-1]): str(config)[:MAX_PARAM]} if prefix else {}


class MlflowLogger:
    """One MLflow run per miles run folder; its id is kept in ``<out_dir>/mlflow_run_id`` so that
    rerunning the same command (a resume) continues the same MLflow run. MLflow cannot delete a
    metric's points, so the steps a killed run logged after its last checkpoint keep the values
    they have and the resumed run does not log them again (one point per metric and step). At
    its first step the logger adds the run folder's earlier steps the store lacks (a store
    replaced, or this logger added to a run that is resumed)."""

    def __init__(self, cfg: MlflowConfig | None = None, *, out_dir: str, config: dict[str, Any] | None = None):
        from mlflow.entities import Param, RunStatus
        from mlflow.tracking import MlflowClient

        cfg = cfg or MlflowConfig()
        os.makedirs(out_dir, exist_ok=True)
        uri = cfg.tracking_uri or f"sqlite:///{os.path.abspath(os.path.join(out_dir, 'mlflow.db'))}"
        id_path = os.path.join(out_dir, ID_FILE)
        try:
            self.client = MlflowClient(tracking_uri=uri)
            run_id = self._existing_run(id_path)
            self.held = HeldPoints()
            if run_id:
                self.client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
                self.held = self._held_points(run_id)
            else:
                exp = self._experiment(cfg.experiment, None if cfg.tracking_uri else out_dir)
                run_id = self.client.create_run(
                    exp, run_name=cfg.run_name or os.path.basename(os.path.abspath(out_dir))).info.run_id
                params = [Param(k, v) for k, v in flatten(read_config(config, out_dir)).items()]
                for i in range(0, len(params), BATCH):
                    self.client.log_batch(run_id, params=params[i:i + BATCH])
            # the whole config as one file too: parameters are cut at MLflow's length limit
            self.client.log_text(run_id, yaml.safe_dump(read_config(config, out_dir), sort_keys=False),
                                 "config.yaml")
        except Exception as e:  # MLflow, SQLAlchemy and OS errors alike mean the store is unusable
            raise MilesError(f"loggers: mlflow could not open a run at {uri} ({type(e).__name__}: {e}); "
                             f"check tracking_uri (default: a SQLite file in run.out_dir)") from e
        with open(id_path, "w") as f:
            f.write(run_id)
        self.run_id, self.uri, self.out_dir = run_id, uri, out_dir
        self.first = True

    def _existing_run(self, id_path: str) -> str | None:
        """The run id a previous attempt of this run folder wrote, if that run is in the store."""
        from mlflow.exceptions import MlflowException

        if not os.path.isfile(id_path):
            return None
        run_id = Path(id_path).read_text().strip()
        try:
            self.client.get_run(run_id)
        except MlflowException:  # the store was replaced (another tracking_uri): start a new run
            return None
        return run_id

    def _held_points(self, run_id: str) -> HeldPoints:
        """Every (metric, step) the run already holds (read once, when a run is resumed)."""
        keys = self.client.get_run(run_id).data.metrics
        return HeldPoints((k, m.step) for k in keys for m in self.client.get_metric_history(run_id, k))

    def _experiment(self, name: str, out_dir: str | None) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        # with the default SQLite store, artifacts go beside it (MLflow's default is ./mlruns of the cwd)
        location = Path(out_dir, "mlflow-artifacts").absolute().as_uri() if out_dir else None
        return self.client.create_experiment(name, artifact_location=location)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        steps = [(step, metrics)]
        if self.first:
            steps, self.first = earlier_rows(self.out_dir, step) + steps, False
        rows = [Metric(k, v, now, s) for s, m in steps
                for k, v in self.held.fresh(s, {key(k): v for k, v in numeric(m).items()}).items()]
        for i in range(0, len(rows), METRICS_BATCH):
            self.client.log_batch(self.run_id, metrics=rows[i:i + METRICS_BATCH])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
