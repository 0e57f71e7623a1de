"""Cloud list prices of GPU machine types: the GCP price history and a bundled Azure table.

This module owns *what one instance-hour of a machine type costs* in a region, at a date, in a
capacity class; `default_catalog()` loads both sources into one `Catalog`, whose `price(...)` answers:
- **GCP**: `gcp-spot-prices-cyclenerd/gcp_gpu_spot_price_changes.csv` (shipped gzipped) in
  `infra.availability.traces.traces_dir()`: change points per (machine type, region), each price
  holding until the pair's next row (a `REMOVED` row: off the list then; before its first row: no
  price). GPU machine types only (a2, a3, g2, g4).
- **Azure**: `infra/pricing/data/azure_gpu_prices.csv`, list prices as of its header's date, any date.

`spot` reads the spot price; `ondemand` and `reserved` the on-demand list price (no committed-use
discounts). `region` may be a zone (`us-central1-a`, `eastus2-1`) or None (`REFERENCE_REGIONS`);
provider `local` is priced by the cloud that lists the machine type. A miss raises `PriceNotFound`
naming machine type, region and class, where prices come from and the fix. Live prices:
`infra.providers.prices_live`; how the ledger uses them: docs/internals.md §7.
"""

from __future__ import annotations

import csv
import re
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path

from infra.availability.capacity import CapacityClass
from infra.availability.traces import data_file, open_text, traces_dir
from rl import env_vars

GCP_HISTORY = Path("gcp-spot-prices-cyclenerd") / "gcp_gpu_spot_price_changes.csv"
"""The GCP price history, relative to the traces directory."""
AZURE_TABLE = Path(__file__).resolve().parent / "data" / "azure_gpu_prices.csv"
REFERENCE_REGIONS = {"gcp": "us-central1", "azure": "eastus"}
"""Region used when none is known (local pools): the cheapest common US region of each cloud."""
REMOVED = "REMOVED"
BEGINNING = datetime.min.replace(tzinfo=UTC)
EXAMPLES_SHOWN = 10
"""Machine types named per cloud in a `PriceNotFound` message."""

_GCP_ZONE = re.compile(r"^([a-z]+-[a-z]+\d+)-[a-z]$")
_AZURE_ZONE = re.compile(r"^([a-z]+\d*)-\d$")
_AS_OF = re.compile(r"AS OF (\d{4}-\d{2}-\d{2})")


class PriceNotFound(LookupError):
    """No price for a (provider, machine type, region, class, date); the message says how to fix it."""


@dataclass(frozen=True)
class PriceStep:
    """The prices of one (machine type, region) from `since` until the next step."""

    since: datetime
    ondemand: float | None
    spot: float | None
    removed: bool = False
    """The pair left the price list at `since`."""


@dataclass(frozen=True)
class PriceTable:
    """One cloud's prices: a step function per (machine type, region)."""

    cloud: str
    source: str
    """Where the prices come from, for error messages."""
    series: Mapping[tuple[str, str], tuple[PriceStep, ...]]
    """Steps in time order per (machine type, region)."""

    def machine_types(self) -> list[str]:
        return sorted({machine_type for machine_type, _ in self.series})

    def regions(self, machine_type: str) -> list[str]:
        return sorted(region for listed, region in self.series if listed == machine_type)


class _Unpriced(Exception):
    """Internal: why a table has no price (turned into a `PriceNotFound` by the catalog)."""


def _usd(cell: str, path: Path, line: int) -> float | None:
    if cell == "":
        return None
    try:
        value = float(cell)
    except ValueError:
        raise ValueError(f"{path}:{line}: expected a price in USD per hour, got {cell!r}") from None
    if value < 0:
        raise ValueError(f"{path}:{line}: negative price {value}")
    return value


def load_gcp_history(path: Path) -> PriceTable:
    """The GCP change-point CSV as step functions (see the module docstring)."""
    series: dict[tuple[str, str], list[PriceStep]] = defaultdict(list)
    with open_text(path) as f:
        for line, row in enumerate(csv.DictReader(f), start=2):
            try:
                since = datetime.fromisoformat(row["effective_from_utc"]).astimezone(UTC)
                ondemand, spot = row["ondemand_usd_per_hour"], row["spot_usd_per_hour"]
                key = (row["machine_type"], row["region"])
            except (KeyError, TypeError, ValueError) as error:
                raise ValueError(f"{path}:{line}: not a price change row ({error})") from None
            if ondemand == REMOVED:
                series[key].append(PriceStep(since, None, None, removed=True))
            else:
                series[key].append(PriceStep(since, _usd(ondemand, path, line), _usd(spot, path, line)))
    ordered = {key: tuple(sorted(steps, key=lambda step: step.since)) for key, steps in series.items()}
    return PriceTable("gcp", f"GCP list-price history {path}", ordered)


def load_azure_table(path: Path = AZURE_TABLE) -> PriceTable:
    """The bundled Azure table (`#` lines are comments): one price per (size, region), any date."""
    series: dict[tuple[str, str], tuple[PriceStep, ...]] = {}
    with path.open(newline="") as f:
        lines = list(enumerate(f, start=1))
    rows = [(line, text) for line, text in lines if not text.startswith("#")]
    as_of = next((m.group(1) for _, text in lines if (m := _AS_OF.search(text))), "an unstated date")
    reader = csv.DictReader(text for _, text in rows)
    for (line, _), row in zip(rows[1:], reader, strict=True):
        step = PriceStep(
            BEGINNING, _usd(row["ondemand_usd_per_hour"], path, line), _usd(row["spot_usd_per_hour"], path, line)
        )
        series[row["machine_type"], row["region"]] = (step,)
    return PriceTable("azure", f"Azure list prices as of {as_of} in {path}", series)


def region_of(cloud: str, region_or_zone: str | None) -> str:
    """The region of a zone (`us-central1-a` -> `us-central1`); None -> the cloud's reference region."""
    if region_or_zone is None:
        return REFERENCE_REGIONS[cloud]
    pattern = _GCP_ZONE if cloud == "gcp" else _AZURE_ZONE
    match = pattern.match(region_or_zone)
    return match.group(1) if match else region_or_zone


class Catalog:
    """Prices from several clouds' tables, looked up by provider, machine type, region, class, date."""

    def __init__(self, tables: Iterable[PriceTable], missing: Iterable[str] = ()) -> None:
        """`missing` describes sources that could not be loaded (named in error messages)."""
        self.tables = {table.cloud: table for table in tables}
        self.missing = tuple(missing)

    def cloud_of(self, provider: str, machine_type: str) -> str | None:
        """The cloud whose table prices `machine_type` for `provider` (None if none does)."""
        if provider in self.tables:
            return provider if self._lists(provider, machine_type) else None
        if provider == "local":
            return next((cloud for cloud in self.tables if self._lists(cloud, machine_type)), None)
        return None

    def price(
        self,
        provider: str,
        machine_type: str,
        region: str | None = None,
        capacity_class: CapacityClass = "ondemand",
        at: datetime | None = None,
    ) -> float:
        """USD per instance-hour at `at` (None: the latest price); `PriceNotFound` if unknown."""
        cloud = self.cloud_of(provider, machine_type)
        where = f"in region {region}" if region else "(no region given)"
        try:
            if cloud is None:
                raise _Unpriced("the catalog does not list this machine type")
            resolved = region_of(cloud, region)
            where = f"in region {resolved}" + ("" if region else " (the reference region)")
            step = self._step(self.tables[cloud], machine_type, resolved, at)
            value = step.spot if capacity_class == "spot" else step.ondemand
            if value is None:
                raise _Unpriced(f"the {cloud} source lists no {_label(capacity_class)} price for it")
            return value
        except _Unpriced as reason:
            when = "latest" if at is None else at.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")
            raise PriceNotFound(
                f"no {_label(capacity_class)} price for machine type {machine_type!r} {where} "
                f"(provider {provider}, {when}): {reason}. Prices come from: {self._sources()}. "
                f"Fix: set the pool's price_per_hour, or pick a machine_type (and region) the catalog lists "
                f"({self._examples()})."
            ) from None

    def _lists(self, cloud: str, machine_type: str) -> bool:
        return any(listed == machine_type for listed, _ in self.tables[cloud].series)

    @staticmethod
    def _step(table: PriceTable, machine_type: str, region: str, at: datetime | None) -> PriceStep:
        steps = table.series.get((machine_type, region))
        if steps is None:
            regions = table.regions(machine_type)
            raise _Unpriced(f"it is listed in {len(regions)} other regions, e.g. {', '.join(regions[:5])}")
        if at is None:
            step = steps[-1]
        else:
            index = bisect_right([s.since for s in steps], at.astimezone(UTC)) - 1
            if index < 0:
                raise _Unpriced(f"its first listed price is from {steps[0].since:%Y-%m-%d}")
            step = steps[index]
        if step.removed:
            raise _Unpriced(f"it left the price list on {step.since:%Y-%m-%d}")
        return step

    def _sources(self) -> str:
        return "; ".join([table.source for table in self.tables.values()] + list(self.missing))

    def _examples(self) -> str:
        parts = []
        for cloud, table in self.tables.items():
            types = table.machine_types()
            more = f" and {len(types) - EXAMPLES_SHOWN} more" if len(types) > EXAMPLES_SHOWN else ""
            parts.append(f"{cloud}: {', '.join(types[:EXAMPLES_SHOWN])}{more}")
        return "; ".join(parts)


def _label(capacity_class: str) -> str:
    return "spot" if capacity_class == "spot" else "on-demand"


@lru_cache(maxsize=4)
def _load_catalog(gcp_history: Path) -> Catalog:
    tables, missing = [load_azure_table()], []
    if data_file(gcp_history) is not None:
        tables.insert(0, load_gcp_history(gcp_history))
    else:
        missing.append(f"GCP list-price history missing at {gcp_history} (set ${env_vars.TRACES_DIR})")
    return Catalog(tables, missing)


def default_catalog() -> Catalog:
    """The GCP history from the traces directory plus the bundled Azure table (loaded once)."""
    return _load_catalog((traces_dir() / GCP_HISTORY).resolve())


def price(
    provider: str,
    machine_type: str,
    region: str | None = None,
    capacity_class: CapacityClass = "ondemand",
    at: datetime | None = None,
) -> float:
    """`default_catalog().price(...)`: USD per instance-hour, or `PriceNotFound`."""
    return default_catalog().price(provider, machine_type, region, capacity_class, at)
