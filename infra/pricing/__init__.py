"""Prices of cloud machine types (see `infra.pricing.catalog`): `price(...)`, `PriceNotFound`."""

from infra.pricing.catalog import Catalog, PriceNotFound, default_catalog, price, region_of

__all__ = ["Catalog", "PriceNotFound", "default_catalog", "price", "region_of"]
