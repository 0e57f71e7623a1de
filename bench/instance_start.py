"""Instance start benchmark: local rollout instances forked from the fork template against instances
started as new interpreters, side by side in one run.

    .venv/bin/python bench/instance_start.py [--instances 3] [--rounds 3]

Each mode runs a rollout fabric of one local spot pool of `--instances` `hf` instances on a tiny
model: `forked` (`fabric.fork_instances: true`, the default) and `fresh` (false). It times the
first start (fabric made to every instance registered: a fresh instance imports torch and
transformers, the template does once), then `--rounds` times preempts every instance (SIGTERM,
the target kept) and times until as many replacements have registered: what a spot pool waits for
after a preemption. CPU: the whole process tree's, the fabric closed and the template ended. Last line JSON:
{"forked_replace_s", "fresh_replace_s", "replace_speedup", "forked_first_s", "fresh_first_s",
"forked_cpu_s", "fresh_cpu_s", "cpu_ratio", "instances", "rounds"} (replace: the mean of the rounds).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from infra.run.config import RunConfig  # noqa: E402
from infra.run.fabric import RolloutFabric  # noqa: E402
from infra.run.fabric_config import FabricConfig  # noqa: E402
from rl.models import TinyLlamaShape, build_tiny_llama, save_model  # noqa: E402
from rl.warm_fork.client import retire_templates  # noqa: E402

TIMEOUT_S = 300.0


@dataclass(frozen=True)
class ModeResult:
    first_s: float
    """The fabric made to every instance registered."""
    replace_s: list[float]
    """Each round: every instance preempted to as many replacements registered."""
    cpu_s: float
    """The process tree's CPU seconds."""


def registered(fabric: RolloutFabric, count: int, besides: set[str]) -> set[str]:
    """Wait until `count` instances not in `besides` are registered and alive; their ids."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        alive = {i.spec.instance_id for i in fabric.registry.alive()} - besides
        if len(alive) >= count:
            return alive
        time.sleep(0.05)
    raise TimeoutError(f"{count} instances did not register within {TIMEOUT_S:.0f} s")


def run_mode(fork: bool, model: Path, root: Path, instances: int, rounds: int) -> ModeResult:
    config = FabricConfig.model_validate(
        {
            "enabled": True,
            "fork_instances": fork,
            "worker": {"heartbeat_s": 0.2, "ttl_s": 2.0},
            "pools": [
                {
                    "name": "spot",
                    "capacity_class": "spot",
                    "size": instances,
                    "machine_type": "a2-highgpu-1g",
                    "price_per_hour": 1.1,
                }
            ],
        }
    )
    run = RunConfig()
    cpu_before = _children_cpu()
    began = time.monotonic()
    name = "forked" if fork else "fresh"
    fabric = RolloutFabric(config, name, root / name, model, engine=run.engine_spec(), trainer_device="cpu")
    replace_s = []
    try:
        seen = registered(fabric, instances, set())
        first_s = time.monotonic() - began
        for _ in range(rounds):
            started = time.monotonic()
            for instance_id in seen:
                fabric.provider.terminate(instance_id, "preempted")
            seen |= registered(fabric, instances, seen)
            replace_s.append(time.monotonic() - started)
    finally:
        fabric.close()
        retire_templates()  # the template ends (it would with this process): its CPU is counted
    return ModeResult(first_s, replace_s, _children_cpu() - cpu_before)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description="Instance start: forked against fresh, side by side.")
    parser.add_argument("--instances", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="instance-start-") as tmp:
        root = Path(tmp)
        model, tokenizer = build_tiny_llama(TinyLlamaShape(), seed=0)
        save_model(model, tokenizer, root / "model")
        results = {}
        for name, fork in (("forked", True), ("fresh", False)):
            results[name] = run_mode(fork, root / "model", root, args.instances, args.rounds)
            print(f"{name}: {json.dumps(asdict(results[name]))}", flush=True)
    forked, fresh = results["forked"], results["fresh"]
    forked_replace, fresh_replace = statistics.mean(forked.replace_s), statistics.mean(fresh.replace_s)
    line = {
        "forked_replace_s": round(forked_replace, 2),
        "fresh_replace_s": round(fresh_replace, 2),
        "replace_speedup": round(fresh_replace / forked_replace, 2),
        "forked_first_s": round(forked.first_s, 2),
        "fresh_first_s": round(fresh.first_s, 2),
        "forked_cpu_s": round(forked.cpu_s, 1),
        "fresh_cpu_s": round(fresh.cpu_s, 1),
        "cpu_ratio": round(fresh.cpu_s / forked.cpu_s, 2),
        "instances": args.instances,
        "rounds": args.rounds,
    }
    print(json.dumps(line))


if __name__ == "__main__":
    main()
