"""Who a run is across its drivers (docs/internals.md §9): `<run>/identity.json`.

The first driver of a run directory makes the run's id (`<run.name>-<8 hex>`) and writes it, with
attempt 1, atomically (a temporary file, fsynced, renamed). Every later driver of the same
directory (a re-run after a crash, or more steps) reads it back and counts one more attempt, so
the run keeps one ledger run, one Redis keyspace (its token log and the controller's learned
offload state) and one identity for the operator. Only the instances are per attempt: a dead
attempt's `spot-0` and this one's must never be the same instance in the ledger or in the token
log, so instance ids of attempt 2 on carry `a<attempt>-` (`instance_prefix`).

It is read and written only under the run's driver lock (`infra.run.driver_lock`): two drivers
never count the same attempt.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

IDENTITY_FILE = "identity.json"


@dataclass(frozen=True)
class RunIdentity:
    run_id: str
    """The run's id in the ledger and its Redis keyspace (`rlb:{<run_id>}:`)."""
    attempt: int
    """1 for the run directory's first driver, one more for each later one."""

    @property
    def instance_prefix(self) -> str:
        """What this attempt's instance ids start with (nothing for the first attempt)."""
        return "" if self.attempt == 1 else f"a{self.attempt}-"

    @property
    def resumed(self) -> bool:
        """Whether an earlier driver ran this run."""
        return self.attempt > 1


def stored_identity(directory: Path) -> RunIdentity | None:
    """The identity an earlier driver of `directory` stored (None: a new run). An unreadable file
    is refused, naming it (its run id would be lost: the ledger and the token log know the run by
    it); preflight checks this before any work."""
    path = Path(directory) / IDENTITY_FILE
    if not path.exists():
        return None
    try:
        stored = json.loads(path.read_text())
        return RunIdentity(str(stored["run_id"]), int(stored["attempt"]))
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"{path} is damaged ({error}): it holds the run's id. Restore it, or remove it to start "
            "the run under a new id (the ledger and the token log then count a new run)"
        ) from None


def claim_identity(directory: Path, name: str) -> RunIdentity:
    """The run's identity for a new driver of `directory` (run name `name`): the stored one with
    one more attempt, or a new one."""
    stored = stored_identity(directory)
    if stored is None:
        identity = RunIdentity(f"{name}-{uuid.uuid4().hex[:8]}", 1)
    else:
        identity = RunIdentity(stored.run_id, stored.attempt + 1)
    _write_atomically(
        Path(directory) / IDENTITY_FILE, json.dumps({"run_id": identity.run_id, "attempt": identity.attempt}) + "\n"
    )
    return identity


def _write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".tmp")
    with temporary.open("w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
