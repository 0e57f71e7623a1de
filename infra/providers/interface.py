"""The provider interface: instance handles and records, preemption events, `Provider`.

A `Provider` launches instances into pools (`infra.providers.pool.PoolSpec`), lists and
terminates them, reports preemptions and quotes prices. The local provider (real process groups)
implements it directly; the GCP and Azure providers share `infra.providers.zonal`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from infra.availability.capacity import CapacityClass
from infra.providers.pool import PoolSpec

StopReason = Literal["preempted", "preempted_silent", "scaled_down", "crashed"]
"""Why the provider (or its caller) stopped an instance; `crashed`: it failed (its worker ended, or
never registered) and is stopped to be replaced (`infra.fleet.instance_watch`)."""
TerminationReason = Literal["preempted", "preempted_silent", "scaled_down", "finished", "crashed"]
"""Why an instance ended: stopped (above), or its process exited by itself (0: finished, else crashed)."""
InstanceState = Literal["running", "terminating", "terminated"]


@dataclass(frozen=True)
class InstanceHandle:
    """One launched instance, as its launcher knows it."""

    instance_id: str
    pool: str
    capacity_class: CapacityClass
    machine_type: str
    price_per_hour: float
    launched_at: float
    """Provider clock (epoch seconds by default) when the instance was started."""


@dataclass(frozen=True)
class InstanceRecord(InstanceHandle):
    """An instance with its lifecycle so far (the cost ledger's input)."""

    state: InstanceState = "running"
    notice_at: float | None = None
    """When the instance was told to stop (SIGTERM, or the SIGKILL of a silent preemption)."""
    terminated_at: float | None = None
    reason: TerminationReason | None = None
    exit_code: int | None = None
    """Process exit status; negative: killed by that signal (-9: SIGKILL)."""
    zone: str | None = None
    """Cloud zone (Azure: location[-zone]) the instance runs in; None for a local instance."""
    launch_step: int | None = None
    """RL step during which a cloud instance was launched (its `rlboost-step` label)."""


@dataclass(frozen=True)
class PreemptionEvent:
    """An instance that the provider took back: notified at `at`, killed by `kill_at`."""

    instance_id: str
    pool: str
    at: float
    kill_at: float
    silent: bool
    """True when there was no notice (SIGKILL at once)."""


class Provider(ABC):
    """Launches, lists and stops instances of pools; reports preemptions and prices."""

    @abstractmethod
    def launch(self, pool: PoolSpec, count: int) -> list[InstanceHandle]:
        """Ask for `count` more instances of `pool`; returns those started now."""

    @abstractmethod
    def instances(self, live_only: bool = False) -> list[InstanceRecord]:
        """Every instance launched so far (or only those not yet terminated)."""

    @abstractmethod
    def describe(self, instance_id: str) -> InstanceRecord:
        """One instance's record; `KeyError` if unknown."""

    @abstractmethod
    def terminate(self, instance_id: str, reason: StopReason = "scaled_down") -> None:
        """Stop an instance (notice, then kill); a no-op if it is already stopping or gone."""

    @abstractmethod
    def preemptions(self) -> list[PreemptionEvent]:
        """Preemptions since the previous call."""

    @abstractmethod
    def quote(self, pool: PoolSpec) -> float:
        """Current price of one instance-hour of `pool`, USD."""

    def refresh(self, pools: Sequence[PoolSpec] = ()) -> None:
        """Bring `list()` and `preemptions()` up to date with what happened outside this process
        (a cloud preempting VMs), also looking for instances of `pools` left by an earlier
        controller. Providers that observe their instances directly (local) have nothing to do."""


OnChange = Callable[[InstanceRecord], None]
"""Called with an instance's new record after every lifecycle change (launch, notice, end)."""


@dataclass(frozen=True)
class BootFile:
    """A file the VM fetches from the store before it starts, checked against its sha256."""

    name: str
    """File name under `<install_dir>/boot/` (a wheel keeps its wheel file name)."""
    url: str
    """Where the VM fetches it: a path or `file://`, `gs://` (gcloud), `s3://` (aws), an Azure blob
    `https://<account>.blob.core.windows.net/...` (az, managed identity) or `http(s)://` (curl)."""
    sha256: str
    """Hex digest the downloaded file must have."""
    env: str | None = None
    """Environment variable that gets the file's local path (e.g. `RLBOOST_WHEEL`)."""


@dataclass(frozen=True)
class BootPlan:
    """What one instance's boot needs beyond its pool: files, variables, a GPU check."""

    files: tuple[BootFile, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    """Extra (non-secret) variables, e.g. `RLBOOST_FLOW_RUN_ID`."""
    require_gpu: bool = False
    """The pool's engine runs on CUDA: fail the boot when `nvidia-smi` does."""


class BootHooks(Protocol):
    """What must exist before a cloud instance boots (the Prefect flow run its worker picks up),
    and its undoing when the instance is never created."""

    def before_boot(self, pool: PoolSpec, instance_id: str) -> BootPlan | None:
        """Prepare the work of an instance about to be created and say what its boot needs (None:
        nothing beyond its pool); an error here creates no VM."""

    def never_booted(self, instance_id: str, why: str) -> None:
        """Undo `before_boot` for an instance the cloud did not create."""


def instance_work_queue(run_id: str, instance_id: str) -> str:
    """The Prefect work queue of an instance's `rollout-instance` flow run, polled by that
    instance's worker only."""
    return f"{run_id}-{instance_id}"
