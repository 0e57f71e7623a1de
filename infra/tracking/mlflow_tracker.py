"""The MLflow tracker: one MLflow run per rl-train run, through `mlflow.MlflowClient`.

Its run is named `<run name>-<flow run id>` and tagged `prefect.flow_run_id` (this invocation's)
and `prefect.flow_run_ids` (every invocation that wrote to it: a resumed run continues it). The
client makes one HTTP attempt per call with a 5 s timeout (`MLFLOW_HTTP_REQUEST_MAX_RETRIES`,
`MLFLOW_HTTP_REQUEST_TIMEOUT` unless set): the channel retries, not the client.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

from infra.tracking.channel import Artifact, Finish, Metrics, Op, Params, Text
from infra.tracking.config import MlflowTracking
from infra.tracking.run_info import TrackedRun

METRICS_PER_BATCH, PARAMS_PER_BATCH = 1000, 100
"""MLflow's limits on one `log_batch`."""
LOCAL_UI = "http://127.0.0.1:5000"
"""Where `mlflow ui` serves a local store by default."""


def default_uri(directory: Path) -> str:
    """The local store of a run without `uri`: a SQLite database in its directory."""
    return f"sqlite:///{(directory / 'mlflow.db').resolve()}"


class MlflowTracker:
    def __init__(self, settings: MlflowTracking, run: TrackedRun) -> None:
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
        from mlflow.tracking import MlflowClient

        self.settings, self.run = settings, run
        self.uri = settings.uri or default_uri(run.directory)
        self.client = MlflowClient(tracking_uri=self.uri)
        saved = run.saved or {}
        self.run_id: str | None = saved.get("run_id")
        self.experiment_id: str | None = saved.get("experiment_id")
        self._known_params: set[str] = set()

    def start(self) -> None:
        """Continue the saved MLflow run, else make one (and its experiment)."""
        from mlflow.exceptions import MlflowException

        flow_run = self.run.flow_run_id
        if self.run_id is not None:
            try:
                existing = self.client.get_run(self.run_id)
            except MlflowException as error:
                if error.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                self.run_id = None  # not on this server (another store now): a new run
            else:
                ids = existing.data.tags.get("prefect.flow_run_ids", "")
                self._known_params = set(existing.data.params)
                self.client.update_run(self.run_id, status="RUNNING")
                self.client.set_tag(self.run_id, "prefect.flow_run_id", flow_run)
                self.client.set_tag(self.run_id, "prefect.flow_run_ids", ",".join(filter(None, [ids, flow_run])))
                return
        experiment = self.client.get_experiment_by_name(self.settings.experiment)
        if experiment is not None:
            self.experiment_id = experiment.experiment_id
        else:
            local = None if self.settings.uri else (self.run.directory / "mlflow-artifacts").resolve().as_uri()
            self.experiment_id = self.client.create_experiment(self.settings.experiment, artifact_location=local)
        tags = {"prefect.flow_run_id": flow_run, "prefect.flow_run_ids": flow_run, "rlboost.run": self.run.name}
        created = self.client.create_run(self.experiment_id, run_name=self.run.label, tags=tags)
        self.run_id = created.info.run_id
        self.run.save({"uri": self.uri, "run_id": self.run_id, "experiment_id": self.experiment_id})

    def send(self, ops: Sequence[Op]) -> None:
        from mlflow.entities import Metric, Param

        if self.run_id is None:
            self.start()
        assert self.run_id is not None
        metrics: list[Metric] = []
        params: list[Param] = []
        for op in ops:
            if isinstance(op, Metrics):
                now = int(time.time() * 1000)
                metrics += [Metric(key, value, now, op.step) for key, value in op.values.items()]
                continue
            if isinstance(op, Params):
                params += [Param(k, v) for k, v in op.values.items() if k not in self._known_params]
                continue
            self._log_batches(metrics, params)
            metrics, params = [], []
            if isinstance(op, Artifact):
                self.client.log_artifact(self.run_id, str(op.path))
            elif isinstance(op, Text):
                self.client.log_text(self.run_id, op.text, f"{op.name}.txt")
                self.client.set_tag(self.run_id, f"rlboost.{op.name}", op.text[:5000])
            elif isinstance(op, Finish):
                self.client.set_terminated(self.run_id)
        self._log_batches(metrics, params)

    def _log_batches(self, metrics: list, params: list) -> None:
        assert self.run_id is not None
        for i in range(0, len(params), PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + PARAMS_PER_BATCH])
            self._known_params.update(p.key for p in params[i : i + PARAMS_PER_BATCH])
        for i in range(0, len(metrics), METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + METRICS_PER_BATCH])

    def link(self) -> tuple[str, str] | None:
        """(URL of the run in MLflow's UI, how to see it), once the run exists."""
        if self.run_id is None:
            return None
        remote = self.uri.startswith(("http://", "https://"))
        base = self.uri.rstrip("/") if remote else LOCAL_UI
        url = f"{base}/#/experiments/{self.experiment_id}/runs/{self.run_id}"
        how = "MLflow run" if remote else f"MLflow run: serve it with `mlflow ui --backend-store-uri {self.uri}`"
        return url, how
