"""What every tracker is told of the rl-train run it tracks (`TrackedRun`), and the parameters of
a configuration as flat `key: text` pairs (`flat_params`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PARAM_CHARS = 6000
"""The longest parameter value kept (MLflow refuses longer ones)."""


@dataclass(frozen=True)
class TrackedRun:
    """The rl-train run a tracker's run records."""

    name: str
    """`run.name`."""
    directory: Path
    """The run's directory (`run.output_dir / run.name`): default stores, `tracking.json`."""
    flow_run_id: str
    """The Prefect flow run of this invocation: in the tracker run's name and tags."""
    save: Callable[[Mapping[str, Any]], None]
    """Persist the tracker's own state (its run id) for a resumed run (`tracking.json`)."""
    saved: Mapping[str, Any] | None = None
    """What `save` kept in an earlier invocation of the run (None: a new run)."""

    @property
    def label(self) -> str:
        """The tracker run's name: the run's name and the Prefect flow run that started it."""
        return f"{self.name}-{self.flow_run_id}"


def flat_params(values: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """`{"a": {"b": 1}}` as `{"a.b": "1"}`: sections flattened, lists as JSON, None as "None"."""
    flat: dict[str, str] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flat_params(value, f"{name}."))
        else:
            text = json.dumps(value) if isinstance(value, (list, tuple, Mapping)) else str(value)
            flat[name] = text[:PARAM_CHARS]
    return flat


def flat_metrics(values: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of `values` (a step record's JSON: `StepRecord.to_json()`), nested mappings as
    `key/inner` (a histogram, counts by kind); None, text and lists are left out."""
    flat: dict[str, float] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flat_metrics(value, f"{name}/"))
        elif isinstance(value, (int, float)):  # bool included: 0 or 1
            flat[name] = float(value)
    return flat
