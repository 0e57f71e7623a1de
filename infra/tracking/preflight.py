"""Checks of a run's `tracking:` before any work (`check_tracking`): each tracker's library is
installed (else the `pip install 'rlboost[<kind>]'` line), and its destination answers now: an
MLflow server's `/health`, W&B's API for `mode: online`; an MLflow file store needs
`MLFLOW_ALLOW_FILE_STORE` (MLflow 3 refuses it otherwise). A `required` tracker that fails a check
stops the run with one line naming the entry and the fix; another is a warning, and the run goes on.
Standard library only: the tracker libraries are not imported here.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import urllib.error
import urllib.request
from collections.abc import Sequence

from infra.tracking.config import LIBRARIES, MlflowTracking, Tracker, WandbTracking, tracker_label

log = logging.getLogger("rlboost.tracking")

PROBE_TIMEOUT_S = 3.0
WANDB_DEFAULT_URL = "https://api.wandb.ai"


class TrackingUnavailable(ValueError):
    """A required tracker that cannot be used; the message names the entry and the fix."""


def check_tracking(trackers: Sequence[Tracker]) -> list[str]:
    """Raise `TrackingUnavailable` for a required tracker that cannot work; return (and log) the
    warnings of the others."""
    warnings = []
    for index, tracker in enumerate(trackers):
        label = tracker_label(index)
        library = LIBRARIES[tracker.kind]
        if importlib.util.find_spec(library) is None:
            raise TrackingUnavailable(
                f"{label}.kind: the {tracker.kind} tracker needs the {library} library: "
                f"pip install 'rlboost[{tracker.kind}]' (or remove this entry from tracking)"
            )
        problem = _unreachable(label, tracker)
        if problem is None:
            continue
        if tracker.required:
            raise TrackingUnavailable(problem)
        warnings.append(f"{problem}; tracking[{index}].required is false: the run goes on, the tracker retries")
        log.warning(warnings[-1])
    return warnings


def _unreachable(label: str, tracker: Tracker) -> str | None:
    """Why the tracker's destination cannot be used now (None: it can)."""
    if isinstance(tracker, MlflowTracking) and tracker.uri:
        uri = tracker.uri
        if uri.startswith(("http://", "https://")):
            why = _no_answer(uri.rstrip("/") + "/health")
            if why:
                return (
                    f"{label}.uri: no MLflow server answers at {uri} ({why}): start it (`mlflow server --host "
                    "127.0.0.1 --port 5000`), fix the uri, or leave uri out for a local store in the run's directory"
                )
        elif (uri.startswith("file:") or "://" not in uri) and os.environ.get("MLFLOW_ALLOW_FILE_STORE") != "true":
            return (
                f"{label}.uri: {uri} is an MLflow file store, which MLflow 3 refuses: leave uri out (a local "
                "SQLite store in the run's directory), use sqlite:///PATH, or export MLFLOW_ALLOW_FILE_STORE=true"
            )
    if isinstance(tracker, WandbTracking) and tracker.mode == "online":
        url = os.environ.get("WANDB_BASE_URL", WANDB_DEFAULT_URL)
        why = _no_answer(url, any_status=True)
        if why:
            return f"{label}: W&B at {url} does not answer ({why}): check the network or WANDB_BASE_URL, or set mode: offline"
    return None


def _no_answer(url: str, any_status: bool = False) -> str | None:
    """Why `url` gives no answer within `PROBE_TIMEOUT_S` (None: it answered; a 2xx unless
    `any_status`)."""
    try:
        with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S):
            return None
    except urllib.error.HTTPError as error:
        return None if any_status else f"HTTP {error.code}"
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        return str(getattr(reason, "strerror", None) or reason)
