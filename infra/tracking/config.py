"""The `tracking:` section: a list of experiment trackers, one entry per tracker, by `kind`.

Runtime-free (pydantic and the standard library): loading a configuration imports no tracker
library. An entry whose `kind` is none of `TRACKER_KINDS` is refused with one line naming them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BeforeValidator, Field

from rl.config import Section

LIBRARIES = {"mlflow": "mlflow", "tensorboard": "tensorboard", "wandb": "wandb"}
"""The library (module) each tracker kind needs: the extra `rlboost[<kind>]` installs it."""

TRACKER_KINDS = tuple(LIBRARIES)


class _Tracker(Section):
    required: bool = True
    """Refuse to start the run when this tracker is unreachable at the start (false: warn and run
    on; the tracker retries in the background, `tracking_<kind>_dropped` counts what it lost)."""


class MlflowTracking(_Tracker):
    """An MLflow run per rl-train run: every step's metrics, the configuration as parameters, the curves and final checkpoint path as artifacts."""

    kind: Literal["mlflow"]
    """`mlflow`: which tracker the entry is."""
    uri: str | None = None
    """MLflow tracking URI: `http(s)://` a server, `sqlite:///...`, ... (default: a local store,
    `sqlite:///<run directory>/mlflow.db`, with artifacts in `<run directory>/mlflow-artifacts`)."""
    experiment: str = "rlboost"
    """The MLflow experiment the run goes in (made when missing)."""


class TensorboardTracking(_Tracker):
    """TensorBoard event files: every step's metrics as scalars, the configuration and final checkpoint as text, the curves as an image."""

    kind: Literal["tensorboard"]
    """`tensorboard`: which tracker the entry is."""
    dir: Path | None = None
    """The log directory (`tensorboard --logdir` it; default: `<run directory>/tensorboard`); the
    run writes in a subdirectory named after its Prefect flow run."""


class WandbTracking(_Tracker):
    """A Weights & Biases run: every step's metrics, the configuration as its config, the curves as an image, the final checkpoint in its summary."""

    kind: Literal["wandb"]
    """`wandb`: which tracker the entry is."""
    mode: Literal["online", "offline"] = "online"
    """`online` sends to W&B (`WANDB_BASE_URL`, `WANDB_API_KEY`); `offline` writes the run's files
    under `<run directory>/wandb`, for `wandb sync` later."""
    project: str = "rlboost"
    """The W&B project the run goes in."""
    entity: str | None = None
    """W&B entity (user or team; default: the API key's)."""


def _known_kind(entry: Any) -> Any:
    kind = entry.get("kind") if isinstance(entry, dict) else getattr(entry, "kind", None)
    if kind not in TRACKER_KINDS:
        raise ValueError(
            f"unknown tracker kind {kind!r}: set kind to one of {', '.join(TRACKER_KINDS)} (docs/tracking.md)"
        )
    return entry


TrackerConfig = Annotated[
    Union[MlflowTracking, TensorboardTracking, WandbTracking],
    Field(discriminator="kind"),
    BeforeValidator(_known_kind),
]
"""One entry of `tracking:`."""

Tracker = Union[MlflowTracking, TensorboardTracking, WandbTracking]


def tracker_label(index: int) -> str:
    """`tracking[i]`: how a message names an entry."""
    return f"tracking[{index}]"
