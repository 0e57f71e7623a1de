"""GPU placement of local instances (`PoolSpec.gpus_per_instance` on a node's inventory): the
plan, the engine each placed instance runs, and the `CUDA_VISIBLE_DEVICES` real instance
processes start with, kept disjoint while spot instances are preempted and replaced."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from infra.providers import LocalProvider, PoolSpec
from infra.providers.placement import GpuSlot, PlacementError, node_devices, place, plan_node
from rl.config import VLLMOptions
from rl.engine_spec import EngineSpec
from tests.helpers import wait_for


def pool(name: str, size: int, gpus: float, capacity_class: str = "reserved", **more: object) -> PoolSpec:
    fields = {
        "name": name,
        "capacity_class": capacity_class,
        "size": size,
        "machine_type": "a3-highgpu-8g",
        "price_per_hour": 1.0,
        "gpus_per_instance": gpus,
        "notice_s": 0.5,
    }
    return PoolSpec.model_validate(fields | more)


EIGHT = tuple(str(i) for i in range(8))


def devices_of(plan: dict[str, tuple[GpuSlot, ...]]) -> dict[str, list[tuple[str, ...]]]:
    return {name: [slot.devices for slot in slots] for name, slots in plan.items()}


def test_four_tensor_parallel_2_engines_get_disjoint_pairs_of_an_8_gpu_node():
    plan = place([pool("reserved", 4, 2)], EIGHT)
    assert devices_of(plan) == {"reserved": [("0", "1"), ("2", "3"), ("4", "5"), ("6", "7")]}
    spec = pool("reserved", 4, 2).engine_spec(EngineSpec(kind="vllm"))
    assert spec.vllm.tensor_parallel_size == 2 and spec.vllm.gpu_memory_utilization == 0.9


def test_shares_pack_onto_one_gpu_beside_the_in_process_engine_on_the_first():
    colocated = pool("train", 1, 1 / 3, colocated=True)
    spot = pool("spot", 2, 1 / 3, "spot")
    plan = place([spot, colocated], ("0",))
    assert devices_of(plan) == {"spot": [("0",), ("0",)], "train": [("0",)]}
    run = EngineSpec(kind="vllm", vllm=VLLMOptions(gpu_memory_utilization=0.6))
    assert spot.engine_spec(run).vllm.gpu_memory_utilization == pytest.approx(0.2)
    assert spot.engine_spec(run).vllm.tensor_parallel_size == 1


def test_whole_gpus_go_first_then_shares_fill_what_is_left():
    plan = place([pool("spot", 3, 0.5, "spot"), pool("reserved", 2, 1), pool("cpu", 2, 0)], ("0", "1", "2", "3"))
    assert devices_of(plan) == {"spot": [("2",), ("2",), ("3",)], "reserved": [("0",), ("1",)]}


def test_cloud_and_unplaced_pools_take_nothing_from_the_node():
    gcp = {"project": "my-project-123", "zones": ["us-central1-a"], "image": "projects/p/global/images/i"}
    vm = pool("vms", 10, 8, "spot", provider="gcp", gcp=gcp)
    assert place([vm, pool("cpu", 4, 0), pool("reserved", 1, 8)], EIGHT) == {"reserved": (GpuSlot(EIGHT, 1.0),)}
    assert vm.engine_spec(EngineSpec(kind="vllm")).vllm.tensor_parallel_size == 8


@pytest.mark.parametrize(
    ("pools", "message"),
    [
        (
            [pool("reserved", 4, 2), pool("spot", 1, 1, "spot")],
            r"^fabric.pools\[1\] \(spot\).gpus_per_instance: 1 instances of 1 GPUs each do not fit on this node's "
            r"8 GPUs \(fabric.node_gpus\) beside the other local pools \(9 GPUs asked for in all\): lower size",
        ),
        ([pool("reserved", 5, 2)], r"^fabric.pools\[0\] \(reserved\).gpus_per_instance: 5 instances of 2 GPUs"),
        (
            [pool("reserved", 8, 1), pool("spot", 1, 0.25, "spot")],
            r"^fabric.pools\[1\] \(spot\).gpus_per_instance: 1 instances of 0.25 GPUs",
        ),
    ],
)
def test_an_oversubscribed_node_is_refused_naming_the_pool(pools, message):
    with pytest.raises(PlacementError, match=message) as refused:
        place(pools, EIGHT)
    assert "\n" not in str(refused.value)


def test_the_inventory_is_declared_or_counted_and_named_through_cuda_visible_devices():
    def never() -> int:
        raise AssertionError("a declared inventory is not counted")

    assert node_devices(4, None, never) == ("0", "1", "2", "3")
    assert node_devices(None, None, lambda: 2) == ("0", "1")
    assert node_devices(None, "4, 5,6", lambda: 3) == ("4", "5", "6")
    assert node_devices(2, "GPU-a,GPU-b,GPU-c", never) == ("GPU-a", "GPU-b")
    with pytest.raises(PlacementError, match=r"fabric.node_gpus: 4 GPUs declared, but .*names 2 \(6,7\)"):
        node_devices(4, "6,7", never)
    assert plan_node([pool("cpu", 4, 0)], None, never) == {}  # nothing to place: nothing counted


def test_a_gpu_count_that_is_neither_whole_nor_a_share_is_refused():
    with pytest.raises(ValidationError, match=r"pool 'reserved': gpus_per_instance 1.5 is neither whole GPUs"):
        pool("reserved", 1, 1.5)


DUMP = r"""
import os, pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1]) / os.environ["RLBOOST_INSTANCE_ID"]
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
(out.parent / f"{out.name}.pid").write_text(str(os.getpid()))
partial = out.parent / f"{out.name}.tmp"
partial.write_text(os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"))
partial.rename(out)  # whole or not at all: the test reads it as soon as it exists
while True:
    signal.pause()
"""


def started(out: Path) -> dict[str, str]:
    return {path.name: path.read_text() for path in out.iterdir() if path.suffix not in (".pid", ".tmp")}


def test_replacements_wait_for_the_gpus_of_the_instance_they_replace(tmp_path):
    spot = pool("spot", 2, 2, "spot")
    plan = place([pool("reserved", 2, 2), spot], EIGHT)
    provider = LocalProvider(
        lambda p, instance_id: [sys.executable, "-S", "-c", DUMP, str(tmp_path)],
        placement=plan,
        environment={"CUDA_VISIBLE_DEVICES": "leaked"},  # the owner's own is replaced by the slot's
    )
    with provider:
        provider.launch(spot, 2)
        wait_for(lambda: len(started(tmp_path)) == 2, "two spot instances")
        assert started(tmp_path) == {"spot-0": "4,5", "spot-1": "6,7"}
        # A preemption: the replacement may start only once the preempted instance has exited.
        blocker = int((tmp_path / "spot-0.pid").read_text())
        os.kill(blocker, signal.SIGSTOP)  # it cannot exit until it is continued
        provider.terminate("spot-0", reason="preempted")
        provider.tick()
        assert [r.instance_id for r in provider.instances() if r.state == "running"] == ["spot-1"]
        os.kill(blocker, signal.SIGCONT)
        wait_for(lambda: (provider.tick(), len(started(tmp_path)))[1] == 3, "the replacement")
        assert started(tmp_path)["spot-2"] == "4,5"
