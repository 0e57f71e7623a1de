"""Fake price sources: the Cloud Billing Catalog (`v1/services/{service}/skus`, as
`google-cloud-billing` sends it over REST, paged) and the Azure Retail Prices API (`$filter`
checked against the exact OData expression the client must send, paged by `NextPageLink`)."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

from tests.fakes.http import FakeServer, Reply, Request, Violation

COMPUTE_SERVICE = "6F81-5844-456A"
AZURE_FILTER = re.compile(
    r"^serviceName eq 'Virtual Machines' and armRegionName eq '(?P<region>[a-z0-9]+)' "
    r"and armSkuName eq '(?P<sku>[A-Za-z0-9_]+)' and priceType eq 'Consumption'$"
)


def gcp_sku(description: str, usage: str, region: str, unit: str, usd: float, group: str) -> dict[str, Any]:
    """A Compute Engine SKU in the Catalog API's JSON form."""
    units, nanos = int(usd), round((usd - int(usd)) * 1e9)
    sku_id = hashlib.md5(f"{description}/{region}".encode()).hexdigest()[:12].upper()
    return {
        "name": f"services/{COMPUTE_SERVICE}/skus/{sku_id}",
        "skuId": sku_id,
        "description": description,
        "category": {
            "serviceDisplayName": "Compute Engine",
            "resourceFamily": "Compute",
            "resourceGroup": group,
            "usageType": usage,
        },
        "serviceRegions": [region],
        "pricingInfo": [
            {
                "effectiveTime": "2025-06-01T00:00:00Z",
                "pricingExpression": {
                    "usageUnit": unit,
                    "displayQuantity": 1,
                    "baseUnit": "s",
                    "baseUnitConversionFactor": 3600,
                    "tieredRates": [
                        {
                            "startUsageAmount": 0,
                            "unitPrice": {"currencyCode": "USD", "units": str(units), "nanos": nanos},
                        }
                    ],
                },
            }
        ],
        "serviceProviderName": "Google",
    }


@dataclass
class FakeBillingCatalog(FakeServer):
    skus: list[dict[str, Any]] = field(default_factory=list)
    page_size: int = 2

    def __post_init__(self) -> None:
        super().__init__()

    def routes(self):
        return [("GET", r"/v1/services/(?P<service>[^/]+)/skus", self._skus)]

    def _skus(self, request: Request, service: str) -> Reply:
        if service != COMPUTE_SERVICE:
            return Reply(
                404, {"error": {"code": 404, "message": f"service {service} not found", "status": "NOT_FOUND"}}
            )
        if request.query.get("currencyCode") != "USD":
            raise Violation(f"currencyCode {request.query.get('currencyCode')!r}")
        unknown = set(request.query) - {"currencyCode", "pageToken", "$alt"}
        if unknown:
            raise Violation(f"unknown query parameters {sorted(unknown)}")
        start = int(request.query.get("pageToken") or 0)
        page: dict[str, Any] = {"skus": self.skus[start : start + self.page_size]}
        if start + self.page_size < len(self.skus):
            page["nextPageToken"] = str(start + self.page_size)
        return Reply(200, page)


def azure_item(
    sku_name: str, product: str, region: str, arm_sku: str, usd: float, start: str = "2025-01-01T00:00:00Z"
) -> dict[str, Any]:
    """One Retail Prices API item."""
    return {
        "currencyCode": "USD",
        "tierMinimumUnits": 0.0,
        "retailPrice": usd,
        "unitPrice": usd,
        "armRegionName": region,
        "location": "US East",
        "effectiveStartDate": start,
        "meterName": sku_name,
        "productName": product,
        "skuName": sku_name,
        "serviceName": "Virtual Machines",
        "serviceFamily": "Compute",
        "unitOfMeasure": "1 Hour",
        "type": "Consumption",
        "isPrimaryMeterRegion": True,
        "armSkuName": arm_sku,
    }


@dataclass
class FakeRetailPrices(FakeServer):
    items: list[dict[str, Any]] = field(default_factory=list)
    page_size: int = 2

    def __post_init__(self) -> None:
        super().__init__()

    def routes(self):
        return [("GET", r"/api/retail/prices", self._prices)]

    @property
    def prices_url(self) -> str:
        return f"{self.url}/api/retail/prices"

    def _prices(self, request: Request) -> Reply:
        match = AZURE_FILTER.match(request.query.get("$filter", ""))
        if not match or set(request.query) - {"$filter", "$skip"}:
            raise Violation(f"query {request.query}")
        wanted = [i for i in self.items if i["armRegionName"] == match["region"] and i["armSkuName"] == match["sku"]]
        skip = int(request.query.get("$skip", "0"))
        page = {
            "BillingCurrency": "USD",
            "CustomerEntityId": "Default",
            "CustomerEntityType": "Retail",
            "Items": wanted[skip : skip + self.page_size],
            "Count": len(wanted[skip : skip + self.page_size]),
        }
        if skip + self.page_size < len(wanted):
            page["NextPageLink"] = (
                f"{self.prices_url}?{urlencode({'$filter': request.query['$filter'], '$skip': skip + self.page_size})}"
            )
        else:
            page["NextPageLink"] = None
        return Reply(200, page)
