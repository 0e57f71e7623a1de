"""`fabric.capacity`: the capacity policy's settings in a run configuration, and its errors."""

from __future__ import annotations

import pytest

from infra.providers.pool import PoolSpec
from infra.run.config import ConfigError, parse_config
from infra.run.fabric_config import CapacitySettings


def test_the_default_policy_is_marginal():
    config = parse_config("", "cfg.yaml")
    assert config.fabric.capacity.policy == "marginal"
    assert parse_config("fabric:\n  capacity:\n    policy: budget\n", "cfg.yaml").fabric.capacity.policy == "budget"


def test_a_bogus_policy_is_one_line_naming_the_field_and_the_choices():
    text = "fabric:\n  capacity:\n    policy: bogus\n"
    with pytest.raises(ConfigError) as info:
        parse_config(text, "cfg.yaml")
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    assert message.startswith("cfg.yaml:3: fabric.capacity.policy:"), message
    assert "'budget'" in message and "'marginal'" in message and "bogus" in message


def test_base_price_defaults_to_the_non_spot_pools():
    pools = tuple(
        PoolSpec.model_validate({"name": n, "capacity_class": c, "size": k, "machine_type": "m", "price_per_hour": p})
        for n, c, k, p in (("trainer", "reserved", 1, 30.0), ("od", "ondemand", 2, 5.0), ("spot", "spot", 4, 2.0))
    )
    assert CapacitySettings().base_price(pools) == 40.0
    assert CapacitySettings(base_price_per_hour=88.5).base_price(pools) == 88.5


def test_egress_prices_come_from_the_table_or_the_configured_price_and_a_bad_origin_is_one_line():
    pools = tuple(
        PoolSpec.model_validate(
            {"name": n, "provider": "gcp", "capacity_class": "spot", "size": 1, "machine_type": "g2-standard-8",
             "price_per_hour": 0.5, "gcp": {"project": "rollout-proj", "zones": [z], "image": "img"}}
        )
        for n, z in (("iowa", "us-central1-b"), ("belgium", "europe-west1-b"), ("virginia", "us-east4-a"))
    )  # fmt: skip
    local = PoolSpec.model_validate(
        {"name": "l", "capacity_class": "spot", "size": 1, "machine_type": "m", "price_per_hour": 0.0}
    )
    assert CapacitySettings().egress_prices((*pools, local)) == {"iowa": 0.0, "belgium": 0.0, "virginia": 0.0}
    from_iowa = CapacitySettings(egress_from="gcp:us-central1")
    assert from_iowa.egress_prices(pools) == {"iowa": 0.0, "belgium": 0.05, "virginia": 0.02}
    assert CapacitySettings(egress_from="azure:eastus").egress_prices(pools)["iowa"] == 0.087  # another cloud
    assert set(CapacitySettings(egress_usd_per_gb=0.01).egress_prices(pools).values()) == {0.01}
    with pytest.raises(ConfigError) as info:
        parse_config("fabric:\n  capacity:\n    egress_from: us-central1\n", "cfg.yaml")
    message = str(info.value)
    assert "\n" not in message and message.startswith("cfg.yaml:"), message
    assert "fabric.capacity.egress_from='us-central1' is not `gcp:<region>`" in message
