"""`Trackers`: the run's experiment trackers behind one object, what the rl-train flow calls.

`open_trackers` makes each configured tracker, starts its run (continuing the one `tracking.json`
in the run's directory names, for a resumed run) and puts a Prefect link artifact to it on the
flow run's page. Every call after that only buffers (`Channel.put`): each tracker's thread sends,
so a tracker that fails never fails or slows training. `finish` logs the summary, ends the
trackers' runs and returns what each sent and dropped (`tracking_<kind>_dropped`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from infra.tracking.channel import Artifact, Channel, Finish, Metrics, Op, Params, Text
from infra.tracking.config import Tracker
from infra.tracking.run_info import TrackedRun, flat_metrics, flat_params

log = logging.getLogger("rlboost.tracking")

STATE_FILE = "tracking.json"
"""In the run's directory: each tracker's run id, for a resumed run."""
FINISH_TIMEOUT_S = 30.0
"""The longest the end of a run waits for the trackers to send what they buffered (a failing one
retried meanwhile: its server may be coming back)."""
CLOSE_TIMEOUT_S = 5.0
EVALUATION_FIELDS = frozenset({"eval_pass_at_k"})
"""Step record fields the evaluation logs itself (`eval/pass_at_<k>`): not logged twice."""


class TrackerClient(Protocol):
    def start(self) -> None: ...
    def send(self, ops: Sequence[Op]) -> None: ...
    def link(self) -> tuple[str, str] | None: ...


def make_tracker(settings: Tracker, run: TrackedRun) -> TrackerClient:
    """The tracker of `settings` (its library imported now)."""
    if settings.kind == "mlflow":
        from infra.tracking.mlflow_tracker import MlflowTracker

        return MlflowTracker(settings, run)
    if settings.kind == "tensorboard":
        from infra.tracking.tensorboard_tracker import TensorboardTracker

        return TensorboardTracker(settings, run)
    from infra.tracking.wandb_tracker import WandbTracker

    return WandbTracker(settings, run)


@dataclass
class _Open:
    name: str
    """`<kind>` (`<kind>-<i>` for a second tracker of a kind)."""
    tracker: TrackerClient
    channel: Channel
    linked: bool = False


@dataclass
class Trackers:
    """The run's trackers (none: every call does nothing)."""

    run_name: str = ""
    opened: list[_Open] = field(default_factory=list)
    metrics_logged: int = 0
    """Metric values handed to the trackers (each tracker gets them all)."""
    _closed: bool = False

    def log_params(self, config: Mapping[str, Any]) -> None:
        """The resolved configuration (`RunConfig.model_dump(mode="json")`) as flat parameters."""
        self._put(Params(flat_params(config)))

    def log_step(self, step: int, record: Mapping[str, Any]) -> None:
        """A step's record (`StepRecord.to_json()`): each of its numbers a metric at `step` (but
        `EVALUATION_FIELDS`, which the evaluation logs under `eval/`)."""
        self.log_metrics(step, {k: v for k, v in record.items() if k not in EVALUATION_FIELDS}, prefix="")

    def log_metrics(self, step: int, metrics: Mapping[str, Any], prefix: str = "eval/") -> None:
        """Numbers at `step`, each named `prefix + key` (nested mappings as `key/inner`)."""
        values = flat_metrics({k: v for k, v in metrics.items() if k != "step"}, prefix)
        if values:
            self.metrics_logged += len(values)
            self._put(Metrics(step, values))

    def log_artifacts(self, curves: Path | None, checkpoint: Path | None) -> None:
        """The curves PNG as a file, the final checkpoint's path as the text `final_checkpoint`."""
        if curves is not None and curves.exists():
            self._put(Artifact(curves))
        if checkpoint is not None:
            self._put(Text("final_checkpoint", str(checkpoint)))

    def finish(self, step: int, summary: Mapping[str, Any]) -> dict[str, int]:
        """Log the run summary's numbers (`summary/<key>` at `step`), end the trackers' runs, wait
        (up to `FINISH_TIMEOUT_S` in all) and close; what each dropped."""
        if not self.opened:
            return {}
        self.log_metrics(step, summary, prefix="summary/")
        self._put(Finish())
        deadline = time.monotonic() + FINISH_TIMEOUT_S
        for opened in self.opened:
            opened.channel.flush(max(0.0, deadline - time.monotonic()))
        self.publish_links()
        self.close()
        counts = {f"tracking_{o.name}_dropped": o.channel.dropped for o in self.opened}
        return {**counts, "tracking_metrics_logged": self.metrics_logged}

    def publish_links(self) -> None:
        """A Prefect link artifact to each tracker run not linked yet (it must exist: a tracker
        that could not start its run is linked at the end, once it has)."""
        from prefect.artifacts import create_link_artifact
        from prefect.context import FlowRunContext

        if FlowRunContext.get() is None:  # not in a flow run (a bench, a test): no page to link from
            return
        for opened in self.opened:
            link = None if opened.linked else opened.tracker.link()
            if link is None:
                continue
            url, description = link
            key = "".join(ch if ch.isalnum() else "-" for ch in f"{self.run_name}-{opened.name}".lower())
            try:
                create_link_artifact(link=url, link_text=f"{opened.name} run", key=key, description=description)
                opened.linked = True
            except Exception as error:  # the flow's page misses a link; the run goes on
                log.warning("tracker %s: no link artifact (%s)", opened.name, error)

    def close(self) -> None:
        """Stop every channel (what is left unsent is dropped and counted); idempotent."""
        if self._closed:
            return
        self._closed = True
        for opened in self.opened:
            opened.channel.close(CLOSE_TIMEOUT_S)

    def _put(self, op: Op) -> None:
        for opened in self.opened:
            opened.channel.put(op)


def open_trackers(settings: Sequence[Tracker], run_name: str, directory: Path, flow_run_id: str) -> Trackers:
    """Start each tracker's run (one that fails logs one warning and starts from its thread later)."""
    if not settings:
        return Trackers(run_name)
    state_file = directory / STATE_FILE
    saved: dict[str, Any] = json.loads(state_file.read_text()) if state_file.exists() else {}
    lock = threading.Lock()
    trackers = Trackers(run_name)
    kinds = [s.kind for s in settings]
    for index, entry in enumerate(settings):
        name = entry.kind if kinds.count(entry.kind) == 1 else f"{entry.kind}-{index}"

        def save(state: Mapping[str, Any], name: str = name) -> None:
            with lock:
                current = json.loads(state_file.read_text()) if state_file.exists() else {}
                state_file.parent.mkdir(parents=True, exist_ok=True)
                state_file.write_text(json.dumps({**current, name: dict(state)}, indent=1))

        run = TrackedRun(run_name, directory, flow_run_id, save, saved.get(name))
        tracker = make_tracker(entry, run)
        channel = Channel(name, tracker.send)
        try:
            tracker.start()
        except Exception as error:  # unreachable now: the channel's thread starts it when it can
            channel.note_failure(error)
        trackers.opened.append(_Open(name, tracker, channel))
    trackers.publish_links()
    return trackers
