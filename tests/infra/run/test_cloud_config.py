"""Cloud pools in run configurations: GCP and Azure settings, and clear errors (naming the pool and
the fix) for the mistakes a user makes first."""

from __future__ import annotations

import re

import pytest

from infra.providers.pool import PoolSpec
from infra.run.config import ConfigError, parse_config
from tests.helpers import REPO_ROOT

GCP_POOL = """\
fabric:
  pools:
    - name: l4-spot
      provider: gcp
      capacity_class: spot
      machine_type: n1-standard-8
      size: 8
      min_size: 2
      price_per_hour: 0.4
      max_price_per_hour: 1.0
      gcp:
        project: my-rl-project
        zones: [us-central1-b, us-central1-a, us-east4-c]
        image: projects/deeplearning-platform-release/global/images/family/common-cu128-ubuntu-2204-nvidia-570
        accelerator_type: nvidia-tesla-t4
        accelerator_count: 2
"""

AZURE_POOL = """\
fabric:
  pools:
    - name: t4-spot
      provider: azure
      capacity_class: spot
      machine_type: Standard_NC4as_T4_v3
      size: 4
      price_per_hour: 0.07
      azure:
        subscription_id: 0b1f6471-1bf0-4dda-aec3-111122223333
        resource_group: rlboost-rollout
        zones: [eastus-1, westeurope]
        image: microsoft-dsvm:ubuntu-hpc:2204:latest
        subnet_id: /subscriptions/0b1f6471-1bf0-4dda-aec3-111122223333/resourceGroups/net/providers/Microsoft.Network/virtualNetworks/v/subnets/rollout
        ssh_public_key: ssh-ed25519 AAAAC3Nza rollout@example
"""


def error_of(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(text, "cfg.yaml")
    return str(info.value)


def test_a_gcp_pool_loads_with_its_zones_in_failover_order():
    (pool,) = parse_config(GCP_POOL).fabric.pools
    assert (pool.provider, pool.min_size, pool.size, pool.max_price_per_hour) == ("gcp", 2, 8, 1.0)
    assert pool.zones == ("us-central1-b", "us-central1-a", "us-east4-c")
    assert (pool.gcp.accelerator_type, pool.gcp.accelerator_count, pool.gcp.boot_disk_gb) == ("nvidia-tesla-t4", 2, 100)
    assert pool.azure is None


def test_an_azure_pool_loads():
    (pool,) = parse_config(AZURE_POOL).fabric.pools
    assert (pool.provider, pool.zones, pool.azure.admin_username) == ("azure", ("eastus-1", "westeurope"), "rlboost")


def test_a_missing_project_names_the_pool_and_the_fix():
    message = error_of(GCP_POOL.replace("        project: my-rl-project\n", ""))
    assert message.startswith("cfg.yaml:3: fabric.pools.0: ")
    assert "pool 'l4-spot': gcp.project is missing" in message and "gcloud config get-value project" in message


@pytest.mark.parametrize("text,cloud", [(GCP_POOL, "gcp"), (AZURE_POOL, "azure")])
def test_an_empty_zone_list_names_the_pool_and_the_fix(text, cloud):
    message = error_of(re.sub(r"zones: \[.*\]", "zones: []", text))
    assert f"{cloud}.zones is missing or empty" in message and "failover order" in message
    assert "pool 'l4-spot'" in message or "pool 't4-spot'" in message


def test_a_cloud_provider_needs_its_section():
    message = error_of(GCP_POOL.split("      gcp:\n")[0])
    assert "pool 'l4-spot': `provider: gcp` needs a `gcp` section with project, zones, image" in message


def test_a_cloud_section_needs_its_provider():
    message = error_of(GCP_POOL.replace("provider: gcp", "provider: local"))
    assert "pool 'l4-spot': a `gcp` section needs `provider: gcp` (it has local)" in message


@pytest.mark.parametrize("bad", ["us-central1", "US-CENTRAL1-A", "eastus-1"])
def test_gcp_zones_must_be_zones(bad):
    message = error_of(GCP_POOL.replace("us-east4-c", bad))
    assert "fabric.pools.0.gcp" in message and "not GCP zones" in message and bad in message


def test_azure_settings_are_checked():
    assert "subscription_id" in error_of(AZURE_POOL.replace("0b1f6471-1bf0-4dda-aec3-111122223333\n", "my-sub\n"))
    assert "neither `publisher:offer:sku:version`" in error_of(
        AZURE_POOL.replace("ubuntu-hpc:2204:latest", "ubuntu-hpc")
    )
    assert "not Azure locations" in error_of(AZURE_POOL.replace("westeurope", "West Europe"))


def test_cloud_pools_refuse_simulated_preemptions():
    message = error_of(GCP_POOL + "      availability: {poisson: {mean_life_s: 10, mean_gap_s: 5}}\n")
    assert "pool 'l4-spot'" in message and "gcp preempts its own instances" in message
    assert "silent_kill_fraction" in error_of(GCP_POOL + "      silent_kill_fraction: 0.5\n")


def test_min_size_cannot_exceed_size():
    assert "min_size 9 exceeds size 8" in error_of(GCP_POOL.replace("min_size: 2", "min_size: 9"))


def test_a_cloud_pool_name_must_fit_vm_names():
    assert "start it with a letter" in error_of(GCP_POOL.replace("name: l4-spot", "name: 4l-spot"))
    assert "50 characters" in error_of(GCP_POOL.replace("name: l4-spot", "name: " + "a" * 51))


def test_local_pools_are_unchanged():
    pool = PoolSpec(name="1st", capacity_class="spot", size=2, machine_type="g2-standard-8", price_per_hour=0.3)
    assert (pool.provider, pool.zones, pool.min_size, pool.gcp, pool.azure) == ("local", (), 0, None, None)


def test_the_docs_cloud_pools_example_is_valid():
    page = (REPO_ROOT / "docs" / "cloud-pools.md").read_text()
    example = page.split("```yaml\n", 1)[1].split("```", 1)[0]
    pools = parse_config(example, "docs/cloud-pools.md").fabric.pools
    assert [p.provider for p in pools] == ["local", "gcp", "azure"]
