"""`PoolSpec.colocated`: only the training cluster's own share (reserved, local, one instance)
may run inside the training process; anything else is refused naming the pool and the fix."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from infra.providers.pool import PoolSpec

RESERVED = {
    "name": "train",
    "capacity_class": "reserved",
    "size": 1,
    "machine_type": "a2-highgpu-1g",
    "price_per_hour": 3.67,
}


def test_a_reserved_local_pool_of_one_may_be_colocated():
    assert PoolSpec.model_validate({**RESERVED, "colocated": True}).colocated
    assert not PoolSpec.model_validate(RESERVED).colocated


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"capacity_class": "spot"},
            r"pool 'train'.*set `capacity_class: reserved` and `provider: local`.*spot, local",
        ),
        ({"capacity_class": "ondemand"}, r"pool 'train'.*capacity_class: reserved.*ondemand"),
        ({"size": 2}, r"pool 'train': a colocated pool runs one instance .*set `size: 1` \(it has 2\)"),
        (
            {
                "provider": "gcp",
                "gcp": {"project": "my-project-1", "zones": ["us-central1-a"], "image": "img"},
            },
            r"pool 'train'.*`provider: local`.*reserved, gcp",
        ),
    ],
)
def test_colocated_elsewhere_names_the_pool_and_the_fix(change, message):
    with pytest.raises(ValidationError, match=message):
        PoolSpec.model_validate({**RESERVED, "colocated": True, **change})
