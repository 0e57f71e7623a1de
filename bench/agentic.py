"""Agentic benchmark: the tiny model learning the calculator environment through the fabric with
spot preemptions (issue 37). Pretrains the calculator demo's base model if it is missing, then:

1. GRPO through the rl-train flow on the demo's fabric (`deployments/configs/calculator.yaml`), the
   environment a calculator whose tool fails as the infrastructure does for a few (sample, turn)
   keys (`FlakyCalculator`: once, then retried; or on every try, the trajectory masked out);
2. a side run: one rollout of the same seeds on the base model, undisturbed (one reserved instance)
   and preempted (two spot instances, each preempted while it holds trajectories), token by token.

    .venv/bin/python bench/agentic.py [--steps 60] [--side-prompts 32] [--set key=value ...]

Last line JSON: {"reward_first5", "reward_last5", "gain", "turns_mean", "tool_calls",
"tool_wait_fraction", "migrated_mid_turn", "infra_failed", "infra_failed_scored",
"identical_to_undisturbed", "minutes", ...}; method and figures: docs/environments.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")

import yaml  # noqa: E402

from bench.preempt_in_flight import InFlightPreempter  # noqa: E402
from rl.environments.calculator import Calculator  # noqa: E402
from rl.environments.protocol import StepKey, StepResult, ToolCall  # noqa: E402

CONFIG = REPO / "deployments" / "configs" / "calculator.yaml"
FLAKY = "bench.agentic:FlakyCalculator"
ONCE, ALWAYS = 0.04, 0.01
"""Fractions of (sample, turn) keys whose tool call fails once (then succeeds when retried in the
same process) and on every try (the trajectory fails as the infrastructure's, after its retries)."""
_FAILED_ONCE: set[StepKey] = set()


def draw(key: StepKey) -> float:
    """A uniform number in [0, 1) of the key alone (the same in every process)."""
    digest = hashlib.blake2b(f"{key.sample_id}|{key.turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


class FlakyCalculator(Calculator):
    """The calculator whose tool call raises (an infrastructure failure, never a reward) for the keys
    that `draw` puts below `always` (every try) or below `always + once` (the first try here)."""

    def __init__(self, once: float = ONCE, always: float = ALWAYS) -> None:
        super().__init__()
        self.once, self.always = once, always
        self._key: StepKey | None = None

    def step(self, turn_text: str, key: StepKey) -> StepResult:
        self._key = key
        return super().step(turn_text, key)

    def call_tool(self, call: ToolCall) -> str:
        key = self._key
        assert key is not None, "step() sets the key before a call"
        if draw(key) < self.always:
            raise RuntimeError("the tool's backend is down")
        if draw(key) < self.always + self.once and key not in _FAILED_ONCE:
            _FAILED_ONCE.add(key)
            raise RuntimeError("the tool's backend hiccuped")
        return super().call_tool(call)


def leaked(samples: list, tokenizer) -> int:
    """Trained samples with a tool result at a key whose call always fails: a failure that reached
    the loss with a reward (none may)."""
    from rl.environments.tool_calls import TextToolFormat

    format, count = TextToolFormat(), 0
    for sample in samples:
        for turn, (start, end, _) in enumerate(sample.model_turns()[:-1]):
            text = tokenizer.decode(sample.response_ids[start:end], skip_special_tokens=True)
            try:
                call = format.parse(text)
            except ValueError:
                call = None
            if call is not None and draw(StepKey(sample.sample_id, turn)) < ALWAYS:
                count += 1
                break
    return count


def main_run(base: Path, workdir: Path, steps: int, sets: dict[str, Any]) -> dict[str, Any]:
    """GRPO on the flaky calculator through the flow; the per-step figures from metrics.json."""
    from flows.rl_train import run_training
    from rl.models import load_tokenizer
    from rl.rollout import read_samples

    overrides = {
        "model.path": str(base),
        "run.output_dir": str(workdir / "runs"),
        "run.name": "agentic",
        "run.steps": steps,
        "run.checkpoint_every": steps,
        "eval.every": steps,
        "environment": {"class": FLAKY, "max_turns": 3, "retries": 1},
        "training.infra_failed": "renormalize",
        **sets,
    }
    run_training(CONFIG, overrides)
    root = workdir / "runs" / "agentic" / "steps"
    rows = [json.loads((root / f"{s:06d}" / "metrics.json").read_text()) for s in range(1, steps + 1)]
    tokenizer = load_tokenizer(base)
    scored = sum(leaked(read_samples(root / f"{s:06d}" / "rollout.jsonl"), tokenizer) for s in range(1, steps + 1))
    first, last = [r["reward"] for r in rows[:5]], [r["reward"] for r in rows[-5:]]
    return {
        "reward_first5": sum(first) / len(first),
        "reward_last5": sum(last) / len(last),
        "gain": sum(last) / len(last) - sum(first) / len(first),
        "turns_mean": sum(r["turns_mean"] for r in rows) / len(rows),
        "tool_calls": sum(r["tool_calls"] for r in rows),
        "tool_wait_fraction": sum(r["tool_wait_fraction"] for r in rows) / len(rows),
        "migrated_mid_turn": sum(r["migrated_mid_turn"] for r in rows),
        "infra_failed": sum(sum(r["infra_failed"].values()) for r in rows),
        "infra_failed_scored": scored,
        "preemptions": rows[-1]["preemptions"],
        "migrations": sum(r["migrations"] for r in rows),
        "eval_accuracy_last": rows[-1]["eval_accuracy"],
    }


SPOT = {
    "name": "spot",
    "capacity_class": "spot",
    "size": 2,
    "machine_type": "a2-highgpu-1g",
    "price_per_hour": 1.10,
    "notice_s": 0.5,
}
"""The preempted side run's pool: two spot worker processes (`InFlightPreempter` preempts them)."""
SPOT_SLOTS = 4
"""Trajectories a spot instance of the side run holds at once."""
PREEMPTIONS = 6
"""Preemptions of the side run, alternately with notice (SIGTERM, 0.5 s) and silent (SIGKILL)."""
GAP_S = 1.0
"""Seconds between two preemptions of the side run."""
RESERVED = {
    "name": "reserved",
    "capacity_class": "reserved",
    "size": 1,
    "machine_type": "a2-highgpu-1g",
    "price_per_hour": 3.67,
}
"""The undisturbed side run's pool: one reserved worker process."""


def side_rollout(base: Path, workdir: Path, name: str, pool: dict[str, Any], prompts: int, preempt: int = 0) -> list:
    """One rollout (step 1, the run's seeds) of the base model on `pool` alone; its samples.
    `preempt`: preemptions of its spot instances while they hold trajectories."""
    from infra.run.config import load_config
    from infra.run.session import TrainingSession
    from rl.rollout import read_samples

    overrides = {
        "model.path": str(base),
        "run.output_dir": str(workdir / "side"),
        "run.name": name,
        "rollout.prompts_per_step": prompts,
        "fabric.pools": [pool],
        "fabric.worker.slots": SPOT_SLOTS if preempt else 64,
        "ledger.url": f"sqlite:///{workdir / f'{name}.sqlite'}",
    }
    session = TrainingSession(load_config(CONFIG, overrides))
    preempter = InFlightPreempter(session.fabric, 1, preempt, ("preempted", "preempted_silent"), GAP_S, 0.05)
    try:
        preempter.start()
        return read_samples(Path(session.rollout(1)["path"]))
    finally:
        preempter.stop.set()
        preempter.join()
        session.close()


def side_run(base: Path, workdir: Path, prompts: int) -> dict[str, Any]:
    """The same trajectories undisturbed and preempted: the fraction identical token for token."""
    undisturbed = {s.sample_id: s for s in side_rollout(base, workdir, "undisturbed", RESERVED, prompts)}
    preempted = side_rollout(base, workdir, "preempted", SPOT, prompts, PREEMPTIONS)
    same = [
        s.response_ids == undisturbed[s.sample_id].response_ids and s.turns == undisturbed[s.sample_id].turns
        for s in preempted
    ]
    return {
        "identical_to_undisturbed": sum(same) / len(same),
        "side_trajectories": len(same),
        "side_migrated_mid_turn": sum(s.migrated_mid_turn for s in preempted),
        "side_migrated_trajectories": sum(s.migrated_mid_turn > 0 for s in preempted),
    }


def base_model(sets: dict[str, Any]) -> tuple[Path, float]:
    """The calculator demo's base model (pretrained now if missing) and the minutes that took."""
    from infra.run.config import load_config

    config = load_config(CONFIG, sets)
    if (config.pretrain.output / "config.json").exists():
        return config.pretrain.output, 0.0
    from rl.pretrain import pretrain

    started = time.perf_counter()
    pretrain(config.pretrain, config.model, threads=config.run.torch_threads)
    return config.pretrain.output, (time.perf_counter() - started) / 60


def cpu_name() -> str:
    """The CPU's model name (Linux), else the machine's architecture."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--side-prompts", type=int, default=32)
    parser.add_argument("--workdir", type=Path, default=REPO / "runs" / f"bench-agentic-{int(time.time())}")
    parser.add_argument("--set", action="append", default=[], dest="sets")
    args = parser.parse_args()
    sets = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.sets)}
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    import flows  # noqa: F401  (Prefect defaults before Prefect is imported)

    started = time.perf_counter()
    base, pretrain_minutes = base_model(sets)
    figures = main_run(base, args.workdir, args.steps, sets)
    figures.update(side_run(base, args.workdir, args.side_prompts))
    figures.update(
        minutes=(time.perf_counter() - started) / 60,
        pretrain_minutes=pretrain_minutes,
        steps=args.steps,
        date=time.strftime("%Y-%m-%d"),
        cpu=cpu_name(),
    )
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}))


if __name__ == "__main__":
    main()
