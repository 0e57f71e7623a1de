"""The provider interface: pools, instance handles and records, preemption events.

A **pool** (`PoolSpec`) is one kind of capacity (provider, machine type, capacity class) with a
price, a preemption notice period and an availability model. A `Provider` launches instances into
pools, lists and terminates them, reports preemptions and quotes prices. The local provider (real
process groups) implements it; GCP and Azure providers are to implement the same interface.
"""

from __future__ import annotations

import builtins
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from infra.traces import PoissonLifetimes, TraceSchedule, load_trace

CapacityClass = Literal["reserved", "ondemand", "spot"]
StopReason = Literal["preempted", "preempted_silent", "scaled_down"]
"""Why the provider (or its caller) stopped an instance."""
TerminationReason = Literal["preempted", "preempted_silent", "scaled_down", "finished", "crashed"]
"""Why an instance ended: stopped (above), or its process exited by itself (0: finished, else crashed)."""
InstanceState = Literal["running", "terminating", "terminated"]

POISSON_HORIZON_CYCLES = 1000
"""A synthetic Poisson timeline spans this many mean life+gap cycles, then loops."""


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)


class TraceAvailability(_Spec):
    """Replay a recorded availability trace (see `infra.traces.load_trace`)."""

    trace: str = Field(min_length=1)
    """Trace reference: `bamboo/g4dn`, `bamboo/p3`, `bamboo/gcloud/<name>`, `skynomad/h100/<zone>`,
    `spotserve/<segment>`."""
    time_compression: float = Field(1.0, gt=0)
    """Trace seconds per wall second (1440 replays a day in a minute); also divides `notice_s` locally."""
    offset_s: float = Field(0.0, ge=0)
    """Trace time (seconds) at which the replay starts."""
    loop: bool = True
    """Wrap around at the trace's end (else its last capacity holds)."""

    def schedule(self, max_size: int) -> TraceSchedule:
        """The pool's capacity schedule for `max_size` instances."""
        return TraceSchedule(load_trace(self.trace), max_size, self.time_compression, self.offset_s, self.loop)


class PoissonParams(_Spec):
    """Exponential instance lifetimes and gaps (calibrate from `infra.traces.summarize`)."""

    mean_life_s: float = Field(gt=0)
    """Mean time an instance slot stays available, in seconds before compression."""
    mean_gap_s: float = Field(gt=0)
    """Mean time a preempted slot stays unavailable, in seconds before compression."""
    seed: int = 0
    """Seed of the synthetic timeline."""


class PoissonAvailability(_Spec):
    """Synthetic availability: every slot alternates exponential lifetimes and gaps."""

    poisson: PoissonParams
    """The lifetime and gap model."""
    time_compression: float = Field(1.0, gt=0)
    """Model seconds per wall second; also divides `notice_s` locally."""

    def schedule(self, max_size: int) -> TraceSchedule:
        """The pool's capacity schedule for `max_size` instances."""
        p = self.poisson
        model = PoissonLifetimes(p.mean_life_s, p.mean_gap_s, p.seed)
        horizon = POISSON_HORIZON_CYCLES * (p.mean_life_s + p.mean_gap_s)
        return TraceSchedule(model.trace(max_size, horizon), max_size, self.time_compression)


class PoolSpec(_Spec):
    """One pool of interchangeable instances."""

    name: str = Field(pattern=r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")
    """Pool name (lowercase letters, digits, dashes); instance ids are `<name>-<n>`."""
    provider: Literal["local"] = "local"
    """Who runs the instances: `local` (process groups on this machine)."""
    capacity_class: CapacityClass
    """`reserved` (never preempted), `ondemand` or `spot`."""
    size: int = Field(ge=1)
    """Most instances the pool may hold (its target when fully launched)."""
    machine_type: str = Field(min_length=1)
    """The cloud machine type the instances stand for, e.g. `g2-standard-8` (priced and recorded)."""
    price_per_hour: float = Field(ge=0)
    """Price of one instance-hour in USD."""
    notice_s: float = Field(30.0, ge=0)
    """Preemption notice (SIGTERM -> SIGKILL), seconds: GCP 30, Azure 30, AWS 120. Local pools divide
    it by the availability's `time_compression`."""
    silent_kill_fraction: float = Field(0.0, ge=0, le=1)
    """Fraction of preemptions that are a SIGKILL with no notice."""
    availability: TraceAvailability | PoissonAvailability | None = None
    """When capacity comes and goes: `{trace: ...}`, `{poisson: {...}}`, or none (never preempted)."""

    @model_validator(mode="after")
    def _reserved_is_never_preempted(self) -> Self:
        if self.capacity_class == "reserved" and self.availability is not None:
            raise ValueError("a reserved pool is never preempted: remove `availability`")
        return self

    def schedule(self) -> TraceSchedule | None:
        """The capacity schedule of this pool, or None if its capacity never changes."""
        return None if self.availability is None else self.availability.schedule(self.size)


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
    def launch(self, pool: PoolSpec, count: int) -> builtins.list[InstanceHandle]:
        """Ask for `count` more instances of `pool`; returns those started now."""

    @abstractmethod
    def list(self, live_only: bool = False) -> builtins.list[InstanceRecord]:
        """Every instance launched so far (or only those not yet terminated)."""

    @abstractmethod
    def describe(self, instance_id: str) -> InstanceRecord:
        """One instance's record; `KeyError` if unknown."""

    @abstractmethod
    def terminate(self, instance_id: str, reason: StopReason = "scaled_down") -> None:
        """Stop an instance (notice, then kill); a no-op if it is already stopping or gone."""

    @abstractmethod
    def preemptions(self) -> builtins.list[PreemptionEvent]:
        """Preemptions since the previous call."""

    @abstractmethod
    def quote(self, pool: PoolSpec) -> float:
        """Current price of one instance-hour of `pool`, USD."""
