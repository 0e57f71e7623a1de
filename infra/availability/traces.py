"""Spot availability traces: parsing recorded traces, synthetic Poisson timelines, replay schedules.

This module owns the *capacity timeline* of a spot pool: how many instances it may hold at each
moment, and when instances are preempted. Everything is pure (no clock; a trace file is read
once); local pools and the simulator drive it with their own clocks.

- `AvailabilityTrace`: a step function *trace time -> capacity*, an initial capacity plus signed
  change events (a negative one preempts that many instances); `summarize` describes one.
- `load_trace(ref)`: `bamboo/g4dn`, `bamboo/p3`, `bamboo/gcloud/<name>`, `skynomad/h100/<zone>`,
  `spotserve/<segment>` (each loader's docstring gives its format), from `traces_dir()`: the copy
  shipped in `infra/data/traces/` (origins and licences in its README) or `$RLBOOST_TRACES_DIR`; a
  file `NAME` may be stored as `NAME.gz`. A malformed row raises `TraceError` naming file and line.
- `PoissonLifetimes`: a synthetic timeline, exponential lifetimes and gaps per slot.
- `TraceSchedule`: replays a trace for a pool of `max_size` in wall time, compressed by
  `time_compression` from `offset_s`, looping. Where they are used: docs/internals.md §3 and §11.
"""

from __future__ import annotations

import csv
import gzip
import json
import math
import os
import random
from bisect import bisect_right
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path
from typing import TextIO

from rl import env_vars

TRACES_DIR_ENV = env_vars.TRACES_DIR
SKYNOMAD_ROUND_S = 600.0
"""Seconds between two SkyNomad probe rounds: each count holds this long."""


class TraceError(ValueError):
    """A trace that cannot be used; the message names the file (and line) and the reason."""


SHIPPED_TRACES_DIR = Path(__file__).resolve().parent.parent / "data" / "traces"
"""The traces and price history installed with the package (see its README for origins)."""


def traces_dir() -> Path:
    """The traces directory: `$RLBOOST_TRACES_DIR`, else the copy shipped with the package."""
    override = os.environ.get(TRACES_DIR_ENV)
    return Path(override) if override else SHIPPED_TRACES_DIR


def data_file(path: Path) -> Path | None:
    """`path`, or its gzip-compressed copy `path.gz`, whichever exists; None if neither does."""
    for candidate in (path, path.with_name(path.name + ".gz")):
        if candidate.is_file():
            return candidate
    return None


def open_text(path: Path) -> TextIO:
    """Open a data file as UTF-8 text, reading `path.gz` transparently when only it exists.

    Raises FileNotFoundError naming `path` when neither exists.
    """
    found = data_file(path)
    if found is None:
        raise FileNotFoundError(path)
    if found.suffix == ".gz":
        return gzip.open(found, "rt", newline="", encoding="utf-8")
    return found.open(newline="", encoding="utf-8")


@dataclass(frozen=True)
class TraceEvent:
    """A change of capacity at trace time `t` (seconds): `delta < 0` preempts `-delta` instances."""

    t: float
    delta: int


@dataclass(frozen=True)
class AvailabilityTrace:
    """Capacity over trace time: `initial` instances at t=0, then the `events`, up to `duration_s`."""

    name: str
    slots: int
    """Nominal pool size of the trace (instances requested / peak); capacities lie in [0, slots]."""
    initial: int
    events: tuple[TraceEvent, ...]
    duration_s: float
    _times: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _caps: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.slots < 1 or self.duration_s <= 0 or not 0 <= self.initial <= self.slots:
            raise ValueError(f"{self.name}: needs slots >= 1, duration_s > 0, 0 <= initial <= slots")
        times, caps, cap, last_t = [0.0], [self.initial], self.initial, 0.0
        for ev in self.events:
            if not last_t <= ev.t <= self.duration_s or ev.delta == 0:
                raise ValueError(f"{self.name}: event {ev} out of order, out of range or empty")
            cap += ev.delta
            if not 0 <= cap <= self.slots:
                raise ValueError(f"{self.name}: capacity {cap} at t={ev.t} outside [0, {self.slots}]")
            if ev.t == times[-1]:
                caps[-1] = cap
            else:
                times.append(ev.t)
                caps.append(cap)
            last_t = ev.t
        object.__setattr__(self, "_times", tuple(times))
        object.__setattr__(self, "_caps", tuple(caps))

    @property
    def steps(self) -> tuple[tuple[float, int], ...]:
        """The step function as `(t, capacity from t on)` pairs, the first at t=0."""
        return tuple(zip(self._times, self._caps, strict=True))

    @property
    def preemptions(self) -> tuple[TraceEvent, ...]:
        """The preemption events (capacity drops)."""
        return tuple(ev for ev in self.events if ev.delta < 0)

    def capacity_at(self, t: float) -> int:
        """Capacity at trace time `t` (the last value holds after `duration_s`)."""
        return self._caps[max(bisect_right(self._times, t) - 1, 0)]


@dataclass(frozen=True)
class TraceSummary:
    """Per-trace statistics, e.g. to calibrate `PoissonLifetimes` (`summary.poisson()`)."""

    duration_s: float
    slots: int
    mean_capacity: float
    """Time-weighted mean of the capacity."""
    preemptions: int
    """Instances preempted (a drop by k counts k)."""
    preemptions_per_hour: float
    """Pool-level preemption rate."""
    mean_lifetime_s: float
    """Instance-seconds alive per preemption: the exponential (censoring-aware) mean lifetime."""
    mean_gap_s: float
    """Empty-slot-seconds per capacity return: the mean time a slot stays unavailable."""

    def poisson(self, seed: int = 0) -> PoissonLifetimes:
        """A synthetic model with this trace's mean lifetime and gap."""
        return PoissonLifetimes(self.mean_lifetime_s, self.mean_gap_s, seed)


def summarize(trace: AvailabilityTrace) -> TraceSummary:
    """Mean capacity, preemption rate, mean lifetime and mean gap of `trace`."""
    steps = trace.steps
    ends = [t for t, _ in steps[1:]] + [trace.duration_s]
    alive_s = sum(cap * (end - t) for (t, cap), end in zip(steps, ends, strict=True))
    empty_s = trace.slots * trace.duration_s - alive_s
    removed = sum(-ev.delta for ev in trace.events if ev.delta < 0)
    returned = sum(ev.delta for ev in trace.events if ev.delta > 0)
    return TraceSummary(
        duration_s=trace.duration_s,
        slots=trace.slots,
        mean_capacity=alive_s / trace.duration_s,
        preemptions=removed,
        preemptions_per_hour=removed * 3600.0 / trace.duration_s,
        mean_lifetime_s=alive_s / removed if removed else math.inf,
        mean_gap_s=empty_s / returned if returned else math.inf,
    )


@dataclass(frozen=True)
class PoissonLifetimes:
    """Synthetic availability: each slot lives ~Exp(mean_life_s), then is gone ~Exp(mean_gap_s)."""

    mean_life_s: float
    mean_gap_s: float
    seed: int = 0

    def __post_init__(self) -> None:
        if not (0 < self.mean_life_s < math.inf and 0 < self.mean_gap_s < math.inf):
            raise ValueError(f"mean_life_s and mean_gap_s must be positive and finite: {self}")

    def trace(self, slots: int, duration_s: float) -> AvailabilityTrace:
        """A timeline of `slots` instances, all alive at t=0, over `duration_s` trace seconds."""
        rng = random.Random(self.seed)
        changes: list[tuple[float, int]] = []
        for _ in range(slots):
            t = rng.expovariate(1.0 / self.mean_life_s)
            while t < duration_s:
                changes.append((t, -1))
                t += rng.expovariate(1.0 / self.mean_gap_s)
                if t >= duration_s:
                    break
                changes.append((t, +1))
                t += rng.expovariate(1.0 / self.mean_life_s)
        changes.sort()
        name = f"poisson(life={self.mean_life_s:g}s, gap={self.mean_gap_s:g}s, seed={self.seed})"
        return AvailabilityTrace(name, slots, slots, _merge(changes), duration_s)


@dataclass(frozen=True)
class CapacityChange:
    """A change of a pool's capacity at wall time `t` (seconds since the schedule began)."""

    t: float
    capacity: int
    delta: int


@dataclass(frozen=True)
class TraceSchedule:
    """A trace replayed for a pool of `max_size` instances, in wall seconds since the schedule began.

    Wall time `t` maps to trace time `offset_s + t * time_compression` (wrapping at the trace's
    end when `loop`). The pool holds the trace's share of its slots:
    `round(trace capacity * max_size / trace.slots)`.
    """

    trace: AvailabilityTrace
    max_size: int
    time_compression: float = 1.0
    offset_s: float = 0.0
    loop: bool = True
    _times: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _caps: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.max_size < 0 or self.time_compression <= 0 or self.offset_s < 0:
            raise ValueError(f"need max_size >= 0, time_compression > 0, offset_s >= 0: {self}")
        times: list[float] = []
        caps: list[int] = []
        for t, cap in self.trace.steps:
            scaled = math.floor(cap * self.max_size / self.trace.slots + 0.5)
            if not caps or scaled != caps[-1]:
                times.append(t)
                caps.append(scaled)
        object.__setattr__(self, "_times", tuple(times))
        object.__setattr__(self, "_caps", tuple(caps))

    def trace_time(self, t: float) -> float:
        """Trace time (unwrapped) at wall time `t`."""
        if t < 0:
            raise ValueError(f"wall time must be >= 0, got {t}")
        return self.offset_s + t * self.time_compression

    def capacity_at(self, t: float) -> int:
        """Instances the pool may hold at wall time `t`."""
        return self._capacity(self.trace_time(t))

    def events_between(self, t0: float, t1: float) -> list[CapacityChange]:
        """Capacity changes at wall times in `(t0, t1]`, in order."""
        lo, hi = self.trace_time(t0), self.trace_time(t1)
        out: list[CapacityChange] = []
        previous = self._capacity(lo)
        for tt in self._change_times(lo, hi):
            cap = self._capacity(tt)
            if cap != previous:
                wall = (tt - self.offset_s) / self.time_compression
                out.append(CapacityChange(wall, cap, cap - previous))
                previous = cap
        return out

    def _capacity(self, tt: float) -> int:
        duration = self.trace.duration_s
        tt = tt % duration if self.loop else min(tt, duration)
        return self._caps[bisect_right(self._times, tt) - 1]

    def _change_times(self, lo: float, hi: float) -> list[float]:
        """Trace times in `(lo, hi]` where the (unwrapped) step function may change."""
        duration = self.trace.duration_s
        if not self.loop:
            return [t for t in self._times if lo < t <= hi]
        periods = range(int(lo // duration), int(hi // duration) + 1)
        return [k * duration + t for k in periods for t in self._times if t < duration and lo < k * duration + t <= hi]


def _merge(changes: list[tuple[float, int]]) -> tuple[TraceEvent, ...]:
    """Sorted `(t, delta)` pairs as events, one per time and sign (so drops stay countable)."""
    merged: dict[tuple[float, bool], int] = {}
    for t, delta in changes:
        merged[t, delta > 0] = merged.get((t, delta > 0), 0) + delta
    # Per time: removals first, so capacity never exceeds the slots transiently.
    return tuple(TraceEvent(t, d) for (t, _), d in sorted(merged.items()) if d)


def _events_from_nodes(
    path: Path, rows: list[tuple[int, float, str, list[str]]]
) -> tuple[int, tuple[TraceEvent, ...], int, float]:
    """`(line, t_s, add|remove, nodes)` rows -> initial capacity, events, peak, duration."""
    alive: set[str] = set()
    changes: list[tuple[float, int]] = []
    peak, last_t = 0, 0.0
    for line, t, kind, nodes in rows:
        if t < last_t:
            raise TraceError(f"{path}:{line}: time {t:g}s goes backwards (previous {last_t:g}s)")
        for node in nodes:
            if kind == "add":
                if node in alive:
                    raise TraceError(f"{path}:{line}: node {node!r} added while alive")
                alive.add(node)
                changes.append((t, 1))
            else:
                if node not in alive:
                    raise TraceError(f"{path}:{line}: node {node!r} removed while not alive")
                alive.remove(node)
                changes.append((t, -1))
        peak, last_t = max(peak, len(alive)), t
    initial = sum(d for t, d in changes if t == 0)
    events = _merge([(t, d) for t, d in changes if t > 0])
    return initial, events, peak, last_t


def load_bamboo(path: Path) -> AvailabilityTrace:
    """Bamboo event CSV: `t_ms,add|remove,node_id` rows, no header, in time order."""
    rows = []
    with _open(path) as f:
        reader = csv.reader(f)
        for row in reader:
            line = reader.line_num
            if not row:
                continue
            if len(row) != 3 or row[1] not in ("add", "remove"):
                raise TraceError(f"{path}:{line}: expected `t_ms,add|remove,node_id`, got {row!r}")
            rows.append((line, _number(path, line, row[0], "t_ms") / 1000.0, row[1], [row[2]]))
    return _node_trace(path, f"bamboo/{path.stem.removesuffix('-trace')}", rows)


def load_spotserve(path: Path) -> AvailabilityTrace:
    """SpotServe JSON lines `[t_ms, "add"|"remove"|"DONE", {"nodes": [...]}]`; DONE ends it."""
    rows = []
    with _open(path) as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                t_ms, kind, payload = json.loads(text)
                nodes = [] if kind == "DONE" else list(payload["nodes"])
                t = float(t_ms) / 1000.0
            except (ValueError, TypeError, KeyError) as exc:
                raise TraceError(f"{path}:{line}: expected [t_ms, kind, {{nodes: [...]}}]: {exc}") from None
            if kind not in ("add", "remove", "DONE") or not math.isfinite(t) or t < 0:
                raise TraceError(f"{path}:{line}: bad time or kind {kind!r}")
            rows.append((line, t, kind, nodes))
    return _node_trace(path, f"spotserve/{path.stem.removeprefix('trace_').removesuffix('_real')}", rows)


def load_gcloud_log(path: Path) -> AvailabilityTrace:
    """Bamboo GCP pool log: `YYYY-MM-DD, HH:MM:SS, N` lines (any order; sorted by time here)."""
    samples = []
    with _open(path) as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            parts = [p.strip() for p in text.split(",")]
            try:
                when = datetime.fromisoformat(f"{parts[0]}T{parts[1]}").replace(tzinfo=UTC).timestamp()
                count = int(parts[2])
            except (ValueError, IndexError):
                raise TraceError(f"{path}:{line}: expected `YYYY-MM-DD, HH:MM:SS, N`, got {text.strip()!r}") from None
            if count < 0 or len(parts) != 3:
                raise TraceError(f"{path}:{line}: expected `YYYY-MM-DD, HH:MM:SS, N`, got {text.strip()!r}")
            samples.append((when, count))
    samples.sort(key=lambda s: s[0])  # stable, so the last line logged for a timestamp wins
    return _count_trace(path, f"bamboo/gcloud/{path.stem}", samples, None, hold_last_s=0.0)


_SKYNOMAD_COLUMNS = ("scheduled_at_utc", "zone", "instances_requested", "instances_created")


def load_skynomad_h100(path: Path, zone: str) -> AvailabilityTrace:
    """SkyNomad H100 probe CSV, one zone: capacity = instances created, held per 10-min round."""
    samples: list[tuple[float, int]] = []
    zones: set[str] = set()
    slots = 0
    with _open(path) as f:
        reader = csv.DictReader(f)
        missing = [c for c in _SKYNOMAD_COLUMNS if c not in (reader.fieldnames or ())]
        if missing:
            raise TraceError(f"{path}:1: missing columns {missing}")
        for row in reader:
            line = reader.line_num
            zones.add(row["zone"])
            if row["zone"] != zone:
                continue
            try:
                when = datetime.fromisoformat(row["scheduled_at_utc"]).timestamp()
                requested, created = int(row["instances_requested"]), int(row["instances_created"])
            except (ValueError, TypeError):
                raise TraceError(f"{path}:{line}: bad time or count in {row!r}") from None
            if not 0 <= created <= requested:
                raise TraceError(f"{path}:{line}: instances_created {created} not in [0, {requested}]")
            if samples and when < samples[-1][0]:
                raise TraceError(f"{path}:{line}: round {row['scheduled_at_utc']} goes backwards")
            samples.append((when, created))
            slots = max(slots, requested)
    if not samples:
        raise TraceError(f"{path}: no rows for zone {zone!r}; zones: {', '.join(sorted(zones))}")
    return _count_trace(path, f"skynomad/h100/{zone}", samples, slots, hold_last_s=SKYNOMAD_ROUND_S)


def load_trace(ref: str, root: Path | None = None) -> AvailabilityTrace:
    """Load a trace by reference (see the module docstring), from `root` or `traces_dir()`."""
    return _load_trace(ref, (root or traces_dir()).resolve())


@lru_cache(maxsize=64)
def _load_trace(ref: str, root: Path) -> AvailabilityTrace:
    match ref.split("/"):
        case ["bamboo", "gcloud", name]:
            return load_gcloud_log(root / "bamboo" / "traces" / "gcloud" / f"{name}.txt")
        case ["bamboo", name]:
            return load_bamboo(root / "bamboo" / "traces" / f"{name}-trace.csv")
        case ["skynomad", "h100", zone]:
            return load_skynomad_h100(root / "skynomad" / "h100_16_probe_counts.csv", zone)
        case ["spotserve", segment]:
            segments = root / "spotserve" / "elastic-switch" / "trace" / "trace_seg"
            return load_spotserve(segments / f"trace_{segment}_real.txt")
    raise TraceError(
        f"unknown trace {ref!r}: expected bamboo/<g4dn|p3>, bamboo/gcloud/<name>, "
        "skynomad/h100/<zone> or spotserve/<segment>"
    )


def _node_trace(path: Path, name: str, rows: list[tuple[int, float, str, list[str]]]) -> AvailabilityTrace:
    if not rows:
        raise TraceError(f"{path}: no events")
    initial, events, peak, duration = _events_from_nodes(path, rows)
    if duration <= 0 or peak == 0:
        raise TraceError(f"{path}: trace has no duration or never holds an instance")
    return AvailabilityTrace(name, peak, initial, events, duration)


def _count_trace(
    path: Path, name: str, samples: list[tuple[float, int]], slots: int | None, hold_last_s: float
) -> AvailabilityTrace:
    """Absolute-time `(timestamp, count)` samples, sorted -> a trace starting at the first sample."""
    if not samples:
        raise TraceError(f"{path}: no samples")
    samples = list(dict(samples).items())  # one sample per timestamp: the last one wins
    start = samples[0][0]
    duration = samples[-1][0] - start + hold_last_s
    if duration <= 0:
        raise TraceError(f"{path}: trace has no duration")
    changes = [(t - start, count - prev) for (_, prev), (t, count) in zip(samples, samples[1:]) if count != prev]
    peak = max(count for _, count in samples)
    return AvailabilityTrace(name, slots or peak, samples[0][1], _merge(changes), duration)


def _number(path: Path, line: int, text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise TraceError(f"{path}:{line}: {what} {text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise TraceError(f"{path}:{line}: {what} {text!r} must be finite and >= 0")
    return value


def _open(path: Path) -> TextIO:
    try:
        return open_text(path)
    except FileNotFoundError:
        raise TraceError(f"{path}: trace file not found (set ${TRACES_DIR_ENV} to the traces directory)") from None
