"""Egress prices: what one GB sent from a cloud region to another place costs, from the bundled
table `infra/pricing/data/egress_prices.csv` (list prices, first volume tier; sources in its header
and docs/CALIBRATION.md).

`egress_usd_per_gb(source_cloud, source_region, dest_cloud, dest_region)` is billed by the source:
0 within one region, the `continent` price between regions of one continent, `intercontinental`
across continents (or a region whose continent is not known), `internet` to another cloud. A
`local` source (the trainer on its own machine) pays no cloud egress.
"""

from __future__ import annotations

import csv
from functools import lru_cache
from pathlib import Path

from infra.pricing.catalog import REFERENCE_REGIONS, region_of

EGRESS_TABLE = Path(__file__).resolve().parent / "data" / "egress_prices.csv"
SCOPES = ("region", "continent", "intercontinental", "internet")

_AZURE_CONTINENTS = {
    "NA": ("us", "canada", "mexico"),
    "SA": ("brazil",),
    "EU": ("europe", "uk", "france", "germany", "norway", "sweden", "switzerland", "poland", "italy", "spain"),
    "ASIA": ("asia", "japan", "korea", "india", "singapore"),
    "OC": ("australia", "newzealand"),
    "ME": ("uae", "qatar", "israel", "saudi"),
    "AF": ("southafrica",),
}
_GCP_CONTINENTS = {
    "us": "NA",
    "northamerica": "NA",
    "southamerica": "SA",
    "europe": "EU",
    "asia": "ASIA",
    "australia": "OC",
    "me": "ME",
    "africa": "AF",
}


@lru_cache(maxsize=1)
def egress_table(path: Path = EGRESS_TABLE) -> dict[tuple[str, str], float]:
    """(cloud, scope) -> USD per GB; `#` lines are comments."""
    with path.open(newline="") as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    table = {}
    for line, row in enumerate(rows, start=2):
        if row["scope"] not in SCOPES:
            raise ValueError(f"{path}: row {line}: unknown scope {row['scope']!r} (known: {', '.join(SCOPES)})")
        table[row["cloud"], row["scope"]] = float(row["usd_per_gb"])
    return table


def continent(cloud: str, region: str) -> str | None:
    """The continent of a region (`us-central1` -> NA, `westeurope` -> EU); None if not known."""
    if cloud == "gcp":
        return _GCP_CONTINENTS.get(region.split("-", 1)[0])
    name = region.lower()
    for code, keys in _AZURE_CONTINENTS.items():
        if any(key in name for key in keys):
            return code
    return None


def egress_usd_per_gb(source_cloud: str, source_region: str | None, dest_cloud: str, dest_region: str | None) -> float:
    """USD per GB sent from `source_cloud`/`source_region` to `dest_cloud`/`dest_region` (regions
    or zones; None: the cloud's reference region)."""
    if source_cloud == "local":
        return 0.0
    table = egress_table()
    if (source_cloud, "internet") not in table:
        raise LookupError(f"no egress prices for cloud {source_cloud!r} in {EGRESS_TABLE}: add its rows there")
    if dest_cloud != source_cloud:
        return table[source_cloud, "internet"]
    for cloud, region in ((source_cloud, source_region), (dest_cloud, dest_region)):
        if region is None and cloud not in REFERENCE_REGIONS:
            raise LookupError(f"egress between regions of {cloud!r} needs both regions, and one is not given")
    source, dest = region_of(source_cloud, source_region), region_of(dest_cloud, dest_region)
    if source == dest:
        return table[source_cloud, "region"]
    a, b = continent(source_cloud, source), continent(dest_cloud, dest)
    return table[source_cloud, "continent" if a is not None and a == b else "intercontinental"]
