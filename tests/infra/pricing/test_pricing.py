"""The price catalog: GCP change points as step functions, the bundled Azure table, clear misses."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from infra.pricing import PriceNotFound, default_catalog, price, region_of
from infra.pricing.catalog import AZURE_TABLE, GCP_HISTORY, Catalog, load_azure_table, load_gcp_history

HEADER = (
    "effective_from_utc,source_commit,machine_type,gpu_type,gpu_count,region,ondemand_usd_per_hour,spot_usd_per_hour\n"
)
HISTORY = HEADER + (
    "2024-01-01T00:00:00Z,aaa,g2-standard-8,l4,1,us-east1,0.90,0.30\n"
    "2024-01-01T00:00:00Z,aaa,g2-standard-8,l4,1,europe-west4,0.99,0.33\n"
    "2024-03-01T00:00:00Z,bbb,g2-standard-8,l4,1,us-east1,0.90,0.20\n"
    "2024-05-01T00:00:00Z,ccc,g2-standard-8,,,us-east1,REMOVED,REMOVED\n"
    "2024-07-01T00:00:00Z,ddd,g2-standard-8,l4,1,us-east1,0.95,0.40\n"
)


def at(day: str) -> datetime:
    return datetime.fromisoformat(day).replace(tzinfo=UTC)


@pytest.fixture
def catalog(tmp_path) -> Catalog:
    path = tmp_path / "changes.csv"
    path.write_text(HISTORY)
    return Catalog([load_gcp_history(path), load_azure_table()])


def test_a_gcp_price_holds_from_its_change_point_until_the_next(catalog):
    assert catalog.price("gcp", "g2-standard-8", "us-east1", "spot", at("2024-01-01")) == 0.30
    assert catalog.price("gcp", "g2-standard-8", "us-east1", "spot", at("2024-02-29T23:59:59")) == 0.30
    assert catalog.price("gcp", "g2-standard-8", "us-east1", "spot", at("2024-03-01")) == 0.20
    assert catalog.price("gcp", "g2-standard-8", "us-east1", "ondemand", at("2024-03-15")) == 0.90
    assert (
        catalog.price("gcp", "g2-standard-8", "us-east1", "reserved", at("2024-03-15")) == 0.90
    )  # on-demand list price
    assert catalog.price("gcp", "g2-standard-8", "us-east1", "spot", at("2024-08-01")) == 0.40  # back after REMOVED
    assert catalog.price("gcp", "g2-standard-8", "us-east1", "spot") == 0.40  # latest
    assert (
        catalog.price("gcp", "g2-standard-8", "europe-west4", "spot", at("2030-01-01")) == 0.33
    )  # the last step holds


def test_removed_pairs_and_dates_before_the_first_price_are_not_priced(catalog):
    with pytest.raises(PriceNotFound, match="left the price list on 2024-05-01"):
        catalog.price("gcp", "g2-standard-8", "us-east1", "spot", at("2024-06-01"))
    with pytest.raises(PriceNotFound, match="first listed price is from 2024-01-01"):
        catalog.price("gcp", "g2-standard-8", "us-east1", "spot", at("2023-12-31"))


def test_zones_reduce_to_regions_and_local_pools_use_the_reference_region(catalog):
    assert region_of("gcp", "us-east1-c") == "us-east1" and region_of("gcp", "us-east1") == "us-east1"
    assert region_of("azure", "eastus2-1") == "eastus2" and region_of("azure", None) == "eastus"
    assert catalog.price("gcp", "g2-standard-8", "europe-west4-a", "spot", at("2024-02-01")) == 0.33
    assert catalog.price("local", "Standard_NC24ads_A100_v4", None, "spot") == 0.444433  # azure, eastus
    assert catalog.cloud_of("local", "g2-standard-8") == "gcp" and catalog.cloud_of("azure", "g2-standard-8") is None


def test_the_azure_table_is_dated_list_prices_with_its_source():
    header = AZURE_TABLE.read_text().splitlines()[:8]
    assert any("LIST PRICES AS OF 2026-11-29" in line for line in header)
    assert any("skypilot-catalog" in line for line in header) and any("prices.azure.com" in line for line in header)
    table = load_azure_table()
    assert table.source.startswith("Azure list prices as of 2026-11-29")
    assert {"Standard_NC4as_T4_v3", "Standard_NC24ads_A100_v4", "Standard_ND96isr_H100_v5"} <= set(
        table.machine_types()
    )
    azure = Catalog([table])
    assert azure.price("azure", "Standard_NC4as_T4_v3", "westus2", "ondemand") == 0.526
    assert azure.price("azure", "Standard_ND96isr_H100_v5", "eastus", "ondemand") == 98.32
    with pytest.raises(PriceNotFound, match="azure source lists no spot price"):
        azure.price("azure", "Standard_ND96isr_H100_v5", "eastus", "spot")


def test_an_unknown_machine_type_or_region_says_where_prices_come_from_and_how_to_fix(catalog):
    with pytest.raises(PriceNotFound) as unknown:
        catalog.price("local", "cpu-laptop", None, "spot")
    message = str(unknown.value)
    assert "no spot price for machine type 'cpu-laptop'" in message and "does not list this machine type" in message
    assert "changes.csv" in message and str(AZURE_TABLE) in message
    assert (
        "Fix: set the pool's price_per_hour" in message
        and "g2-standard-8" in message
        and "Standard_NC4as_T4_v3" in message
    )
    with pytest.raises(
        PriceNotFound, match=r"in region mars1 .*listed in 2 other regions, e.g. europe-west4, us-east1"
    ):
        catalog.price("gcp", "g2-standard-8", "mars1", "ondemand")


def test_the_default_catalog_reads_the_traces_directory(tmp_path, monkeypatch):
    # Values from the shipped history: a2-highgpu-1g in us-central1.
    assert price("gcp", "a2-highgpu-1g", "us-central1-a", "spot", at("2025-06-01")) == 1.442955
    assert price("gcp", "a2-highgpu-1g", "us-central1", "spot", at("2023-06-22T03:58:19")) == 1.21219
    assert price("local", "a2-highgpu-1g", None, "ondemand") == 3.673385
    (tmp_path / GCP_HISTORY).parent.mkdir(parents=True)
    (tmp_path / GCP_HISTORY).write_text(HISTORY)
    monkeypatch.setenv("RLBOOST_TRACES_DIR", str(tmp_path))
    assert default_catalog().price("gcp", "g2-standard-8", "us-east1", "spot", at("2024-03-02")) == 0.20


def test_without_the_traces_the_gcp_prices_are_reported_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("RLBOOST_TRACES_DIR", str(tmp_path))
    assert default_catalog().price("azure", "Standard_NC8as_T4_v3", "eastus", "spot") == 0.089638
    with pytest.raises(PriceNotFound, match=r"GCP list-price history missing at .* \(set \$RLBOOST_TRACES_DIR\)"):
        price("gcp", "a2-highgpu-1g", "us-central1", "spot")


def test_a_malformed_history_row_names_the_file_and_line(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text(HISTORY + "2024-09-01T00:00:00Z,eee,g2-standard-8,l4,1,us-east1,cheap,0.1\n")
    with pytest.raises(ValueError, match=r"bad\.csv:7: expected a price in USD per hour, got 'cheap'"):
        load_gcp_history(path)
