"""Live prices of cloud instances, with an offline fallback.

- **GCP**: the Cloud Billing Catalog (`google-cloud-billing` `CloudCatalogClient.list_skus` of the
  Compute Engine service). A machine type is priced from its parts: vCPUs x the family's core SKU,
  memory (GiB) x its RAM SKU, and each GPU x its GPU SKU, in the zone's region, from the `Preemptible`
  SKUs for spot pools and the `OnDemand` ones otherwise (`gce_hourly_price`).
- **Azure**: the Retail Prices API (`https://prices.azure.com/api/retail/prices`) filtered with
  OData `$filter` on region and VM size; the Linux `... Spot` meter for spot pools, the plain one
  otherwise (`azure_hourly_price`).
- **Offline** (`offline_price`): the bundled catalog of `infra.pricing`, else the pool's own
  `price_per_hour`.

`QuoteBook` caches one quote per (pool, zone) and falls back to the offline price (logged once per
retry period) when the live source fails or does not list the machine type.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from infra.pricing.catalog import PriceNotFound
from infra.pricing.catalog import price as catalog_price
from infra.providers.errors import CloudError
from infra.providers.pool import PoolSpec

log = logging.getLogger(__name__)

COMPUTE_ENGINE_SERVICE = "services/6F81-5844-456A"
"""The Cloud Billing Catalog's id of Compute Engine."""
AZURE_RETAIL_PRICES_URL = "https://prices.azure.com/api/retail/prices"
AZURE_MAX_PAGES = 20
"""Pages of the Retail Prices API followed for one VM size (a size has a few dozen meters)."""


class PriceUnavailable(LookupError):
    """The live source has no usable price for this machine type and region."""


def offline_price(pool: PoolSpec, zone: str) -> float:
    """The bundled catalog's price of the pool's machine type in the zone's region, else the pool's
    configured `price_per_hour`."""
    try:
        return catalog_price(pool.provider, pool.machine_type, zone, pool.capacity_class)
    except PriceNotFound:
        return pool.price_per_hour


class QuoteBook:
    """Quotes per (pool, zone): live when possible, cached for `ttl_s`; after a failed live lookup the
    offline price, kept for `retry_s` before the live source is asked again."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.time,
        ttl_s: float = 3600.0,
        retry_s: float = 600.0,
        offline: Callable[[PoolSpec, str], float] = offline_price,
    ) -> None:
        self._clock = clock
        self._ttl_s = ttl_s
        self._retry_s = retry_s
        self._offline = offline
        self._cache: dict[tuple[str, str], tuple[float, float]] = {}
        """(pool, zone) -> (price, expires at)."""

    def quote(self, pool: PoolSpec, zone: str, live: Callable[[], float] | None) -> float:
        """The cached price, else `live()` (None: offline only). A `CloudError` (the pool's
        configuration, its credentials) propagates; any other failure falls back to offline."""
        now = self._clock()
        cached = self._cache.get((pool.name, zone))
        if cached is not None and now < cached[1]:
            return cached[0]
        if live is None:
            price, ttl = self._offline(pool, zone), self._ttl_s
        else:
            try:
                price, ttl = live(), self._ttl_s
            except CloudError:
                raise
            except Exception as error:  # the live source is best effort: any failure means "offline"
                price, ttl = self._offline(pool, zone), self._retry_s
                log.warning(
                    "pool %s: no live price in %s (%s: %s); using the offline price %.4f USD/h for %.0f s",
                    pool.name,
                    zone,
                    type(error).__name__,
                    error,
                    price,
                    ttl,
                )
        self._cache[pool.name, zone] = (price, now + ttl)
        return price


# -- GCP: the Cloud Billing Catalog ----------------------------------------------------------------


@dataclass(frozen=True)
class GceShape:
    """What a Compute Engine machine type is made of (from the `machineTypes` API)."""

    family: str
    """Machine family, e.g. `n1`, `g2`, `a2` (the prefix of the type name)."""
    vcpus: int
    memory_gib: float
    accelerators: tuple[tuple[str, int], ...] = ()
    """(accelerator type, count): the machine type's own GPUs plus the ones a pool attaches."""


def _money(rate: Any) -> float:
    return int(rate.unit_price.units) + rate.unit_price.nanos / 1e9


def _sku_price(skus: Sequence[Any], pattern: re.Pattern[str], unit: str, region: str, usage: str) -> float:
    """USD per `unit` of the one SKU of `region` and `usage` type whose description matches."""
    for sku in skus:
        if sku.category.usage_type != usage or region not in sku.service_regions or not pattern.match(sku.description):
            continue
        expression = sku.pricing_info[0].pricing_expression
        if expression.usage_unit != unit:
            continue
        return _money(max(expression.tiered_rates, key=lambda rate: rate.start_usage_amount))
    raise PriceUnavailable(f"no {usage} SKU matching {pattern.pattern!r} (unit {unit}) in {region}")


def _gpu_words(accelerator_type: str) -> str:
    """`nvidia-tesla-t4` -> `T4`, `nvidia-a100-80gb` -> `A100 80GB`: how SKU descriptions name it."""
    words = [w for w in accelerator_type.split("-") if w not in ("nvidia", "tesla")]
    return " ".join(words).upper()


def gce_hourly_price(skus: Sequence[Any], region: str, shape: GceShape, spot: bool) -> float:
    """USD per hour of one instance of `shape` in `region`, from Compute Engine `skus`."""
    usage = "Preemptible" if spot else "OnDemand"
    prefix = r"^(?:Spot )?(?:Preemptible )?"
    family = re.escape(shape.family.upper())
    core = re.compile(rf"{prefix}{family} (?:Predefined )?Instance Core running in ")
    ram = re.compile(rf"{prefix}{family} (?:Predefined )?Instance Ram running in ")
    total = shape.vcpus * _sku_price(skus, core, "h", region, usage)
    total += shape.memory_gib * _sku_price(skus, ram, "GiBy.h", region, usage)
    for accelerator_type, count in shape.accelerators:
        gpu = re.compile(rf"{prefix}Nvidia (?:Tesla )?{re.escape(_gpu_words(accelerator_type))} GPU running in ", re.I)
        total += count * _sku_price(skus, gpu, "h", region, usage)
    return total


class GcpCatalogPrices:
    """Compute Engine prices from the Cloud Billing Catalog (the SKU list is fetched once per `ttl_s`)."""

    def __init__(
        self,
        client: Any,
        *,
        clock: Callable[[], float] = time.time,
        ttl_s: float = 3600.0,
        timeout_s: float = 60.0,
    ) -> None:
        """`client`: a `google.cloud.billing_v1.CloudCatalogClient`."""
        self._client = client
        self._clock = clock
        self._ttl_s = ttl_s
        self._timeout_s = timeout_s
        self._skus: list[Any] = []
        self._fetched_at = float("-inf")

    def skus(self) -> list[Any]:
        """Every Compute Engine SKU (USD), all pages."""
        now = self._clock()
        if now - self._fetched_at >= self._ttl_s:
            request = {"parent": COMPUTE_ENGINE_SERVICE, "currency_code": "USD"}
            self._skus = list(self._client.list_skus(request=request, timeout=self._timeout_s, retry=None))
            self._fetched_at = now
        return self._skus

    def hourly_price(self, region: str, shape: GceShape, spot: bool) -> float:
        return gce_hourly_price(self.skus(), region, shape, spot)


# -- Azure: the Retail Prices API -------------------------------------------------------------------


def azure_hourly_price(items: Iterable[dict[str, Any]], spot: bool) -> float:
    """USD per hour of the Linux consumption meter (`... Spot` for spot) among Retail Prices `items`."""
    meters = [
        item
        for item in items
        if item.get("type") == "Consumption"
        and item.get("unitOfMeasure") == "1 Hour"
        and "Windows" not in item.get("productName", "")
        and "Low Priority" not in item.get("skuName", "")
        and item.get("skuName", "").endswith(" Spot") == spot
    ]
    if not meters:
        raise PriceUnavailable(f"no Linux {'spot' if spot else 'pay-as-you-go'} meter among the listed prices")
    latest = max(meters, key=lambda item: item.get("effectiveStartDate", ""))
    return float(latest["retailPrice"])


def _odata_string(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


class AzureRetailPrices:
    """VM prices from the Azure Retail Prices API (public, no credentials)."""

    def __init__(self, url: str = AZURE_RETAIL_PRICES_URL, *, timeout_s: float = 30.0) -> None:
        self.url = url
        self._timeout_s = timeout_s

    def hourly_price(self, location: str, vm_size: str, spot: bool) -> float:
        odata = (
            f"serviceName eq 'Virtual Machines' and armRegionName eq {_odata_string(location)} "
            f"and armSkuName eq {_odata_string(vm_size)} and priceType eq 'Consumption'"
        )
        items: list[dict[str, Any]] = []
        with httpx.Client(timeout=self._timeout_s) as http:
            response = http.get(self.url, params={"$filter": odata})
            for _ in range(AZURE_MAX_PAGES):
                response.raise_for_status()
                page = response.json()
                items.extend(page.get("Items", []))
                if not page.get("NextPageLink"):
                    break
                response = http.get(page["NextPageLink"])
        return azure_hourly_price(items, spot)
