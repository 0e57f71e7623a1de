"""Migration benchmark: token-level resume against restart-from-scratch, under the same spot
preemptions, side by side in one run.

    .venv/bin/python bench/migration.py [--steps 3] [--prompts 16] [--group-size 8] [--max-new-tokens 192]
        [--slots 4] [--spot 3] [--mean-interval 3] [--silent-fraction 0.3] [--steal] [--seed 0]

Two rollout fabrics run the same workload (token-for-token the same responses) under one
deterministic preemption schedule (SIGTERM, or a silent SIGKILL): *resume* (the system: a
preempted or reaped sample continues elsewhere from its logged tokens) and *restart*
(`--restart-from-scratch` workers: it loses them). It measures the tokens each mode wastes and its
step time; target: resume wastes at most 1% of the generated tokens. Last line JSON:
{"resume_waste", "restart_waste", "resume_step_s", "restart_step_s", "preemptions" (the resume
mode's), "restart_preemptions", "silent_kills", "migrations", "restart_reclaims", "waste_ratio",
"step_time_ratio", "resume_waste_max", "restart_waste_max", "resume_tokens", "restart_tokens",
"identical_responses", "steps", "total_s"}. Method and what "wasted" counts: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from infra.availability.traces import AvailabilityTrace, TraceEvent, TraceSchedule  # noqa: E402
from infra.providers.interface import PreemptionEvent  # noqa: E402
from infra.providers.local import LocalProvider  # noqa: E402
from infra.providers.pool import PoolSpec  # noqa: E402
from infra.rollout.controller import StepReport  # noqa: E402
from infra.rollout.controller_config import ControllerConfig, OffloadSettings  # noqa: E402
from infra.rollout.policies import StealConfig  # noqa: E402
from infra.rollout.settings import WorkerSettings  # noqa: E402
from infra.run.fabric import RolloutFabric  # noqa: E402
from infra.run.fabric_config import FabricConfig  # noqa: E402
from rl.config import RolloutConfig  # noqa: E402
from rl.datasets import PromptRecord  # noqa: E402
from rl.engine_spec import EngineSpec  # noqa: E402
from rl.models import TinyLlamaShape, build_tiny_llama, save_model  # noqa: E402

MODES = (("resume", False), ("restart", True))


class RolloutClock:
    """The spot provider's clock: frozen between steps, running during one; `jump` sets it (only
    forward) while frozen, so each step can start at a multiple of the looping schedule's period."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._base = 0.0
        self._since: float | None = None

    def __call__(self) -> float:
        with self._lock:
            return self._base if self._since is None else self._base + time.monotonic() - self._since

    def jump(self, t: float) -> None:
        with self._lock:
            if self._since is not None or t < self._base:
                raise RuntimeError("the clock only jumps forward while frozen")
            self._base = t

    def run(self) -> None:
        with self._lock:
            self._since = time.monotonic()

    def freeze(self) -> None:
        now = self()
        with self._lock:
            self._base, self._since = now, None


def preemption_schedule(
    size: int, period: float, first: float, mean_interval: float, gap: float, seed: int
) -> tuple[TraceSchedule, list[float]]:
    """A spot pool of `size` slots over `period` seconds (looping): capacity drops by one at
    seeded exponential intervals from `first` on (never below zero), each slot back `gap`
    seconds later. Returns the schedule and its drop times."""
    rng = random.Random(seed)
    drops: list[float] = []
    t = first
    while t + gap < period:
        down = sum(1 for d in drops if d <= t < d + gap)
        if down < size:
            drops.append(round(t, 3))
        t += rng.expovariate(1.0 / mean_interval)
    changes = sorted([(d, -1) for d in drops] + [(d + gap, 1) for d in drops])  # drops first at a tie
    trace = AvailabilityTrace(
        f"migration-bench(seed={seed})",
        size,
        size,
        tuple(TraceEvent(t, delta) for t, delta in changes),
        period,
    )
    return TraceSchedule(trace, size, time_compression=1.0, loop=True), drops


def suppress_eos(model, eos_token_id: int) -> None:
    """Make `<eos>` (almost) never sampled by a random-init tiny Llama: residual channel 0 is +1 in
    every token embedding and -1 in `<eos>`'s; the embeddings are tied to the output head, so
    after the final RMSNorm that channel puts `<eos>`'s logit ~16 below every other token's."""
    with torch.no_grad():
        embeddings = model.get_input_embeddings().weight
        if model.get_output_embeddings().weight.data_ptr() != embeddings.data_ptr():
            raise RuntimeError("suppress_eos needs tied input and output embeddings")
        embeddings[:, 0] = 1.0
        embeddings[eos_token_id, 0] = -1.0


@dataclass
class Mode:
    name: str
    restart: bool
    fabric: RolloutFabric
    spot: LocalProvider
    clock: RolloutClock
    reports: list[StepReport] = field(default_factory=list)
    events: list[PreemptionEvent] = field(default_factory=list)
    responses: list[dict[str, list[int]]] = field(default_factory=list)

    def running_ids(self) -> set[str]:
        records = self.fabric.provider.instances(live_only=True) + self.spot.instances(live_only=True)
        return {r.instance_id for r in records if r.state == "running"}

    def wait_full(self, expected: int, timeout_s: float) -> None:
        """Until `expected` instances run and every one of them is registered and alive."""
        deadline = time.monotonic() + timeout_s
        while True:
            running = self.running_ids()
            alive = {s.spec.instance_id for s in self.fabric.registry.alive()}
            if len(running) == expected and running <= alive:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.name}: {len(running & alive)}/{expected} instances up after {timeout_s:.0f} s"
                )
            time.sleep(0.1)


def start_mode(
    name: str,
    restart: bool,
    args: argparse.Namespace,
    root: Path,
    model_dir: Path,
    schedule: TraceSchedule,
    stack: contextlib.ExitStack,
) -> Mode:
    run_dir = root / name
    steal = StealConfig() if args.steal else StealConfig(min_remaining_tokens=10**9)
    config = FabricConfig(
        enabled=True,
        pools=(
            PoolSpec(
                name="reserved",
                capacity_class="reserved",
                size=args.reserved,
                machine_type="local-cpu",
                price_per_hour=0.0,
            ),
        ),
        worker=WorkerSettings(
            slots=args.slots,
            flush_tokens=args.flush_tokens,
            flush_ms=args.flush_ms,
            heartbeat_s=0.5,
            ttl_s=2.0,
            restart_from_scratch=restart,
        ),
        controller=ControllerConfig(
            reap_timeout_s=args.reap_timeout,
            steal=steal,
            offload=OffloadSettings(initial_t_local_s=1e9),  # reserved instances never leave to train
        ),
    )
    fabric = RolloutFabric(config, f"migration-{name}", run_dir, model_dir, engine=EngineSpec(), trainer_device="cpu")
    stack.callback(fabric.close)
    clock = RolloutClock()
    # The spot pool lives in its own provider, on the rollout clock and the explicit schedule,
    # running the same worker command as the fabric's pools.
    spot = LocalProvider(
        fabric._worker_command,
        schedules={"spot": schedule},
        clock=clock,
        seed=args.seed,
        log_dir=run_dir / "instances",
        environment=fabric.worker_environment(),
    )
    stack.callback(spot.shutdown)  # runs before fabric.close
    spot.launch(
        PoolSpec(
            name="spot",
            capacity_class="spot",
            size=args.spot,
            machine_type="local-cpu",
            price_per_hour=0.0,
            notice_s=args.notice,
            silent_kill_fraction=args.silent_fraction,
        ),
        args.spot,
    )
    spot.start()
    return Mode(name, restart, fabric, spot, clock)


def summarize(mode: Mode, flush_tokens: int) -> dict:
    reports = mode.reports
    generated = sum(r.tokens_generated for r in reports)
    wasted = sum(r.tokens_wasted for r in reports)
    reaped = sum(r.reaped_samples for r in reports)
    tail = reaped * flush_tokens
    return {
        "steps": len(reports),
        "step_s": statistics.mean(r.step_time_s for r in reports),
        "generated": generated,
        "wasted": wasted,
        "waste": wasted / max(generated, 1),
        "tail_bound": tail,
        "waste_max": (wasted + tail) / max(generated + tail, 1),
        "preemptions": len(mode.events),
        "silent": sum(e.silent for e in mode.events),
        "migrations": sum(r.migrations for r in reports),
        "reaped_instances": sum(r.reaped_instances for r in reports),
        "reaped_samples": reaped,
        "rejected": sum(r.rejected_appends for r in reports),
        "dropped_groups": sum(len(r.groups_dropped) for r in reports),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="steps per mode")
    parser.add_argument("--prompts", type=int, default=16, help="prompts (groups) per step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--keep-eos", action="store_true", help="do not suppress <eos> in the random model")
    parser.add_argument("--reserved", type=int, default=1, help="reserved instances")
    parser.add_argument("--spot", type=int, default=3, help="spot instances")
    parser.add_argument("--slots", type=int, default=4, help="samples per instance")
    parser.add_argument("--flush-tokens", type=int, default=4)
    parser.add_argument("--flush-ms", type=float, default=100.0)
    parser.add_argument("--first", type=float, default=1.5, help="first capacity drop, s after step start")
    parser.add_argument("--mean-interval", type=float, default=3.0, help="mean s between capacity drops")
    parser.add_argument("--gap", type=float, default=1.0, help="s a lost spot slot stays unavailable")
    parser.add_argument(
        "--period", type=float, default=300.0, help="schedule length (loops); a step starts at the next multiple"
    )
    parser.add_argument("--notice", type=float, default=2.0, help="SIGTERM -> SIGKILL, s")
    parser.add_argument("--silent-fraction", type=float, default=0.3, help="preemptions that are a silent SIGKILL")
    parser.add_argument("--reap-timeout", type=float, default=3.0, help="s without heartbeat before a reap")
    parser.add_argument("--steal", action="store_true", help="token-level stealing on (both modes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--boot-timeout", type=float, default=180.0)
    parser.add_argument("--workdir", type=Path, default=None, help="keep run files (instance logs) here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()

    schedule, drops = preemption_schedule(args.spot, args.period, args.first, args.mean_interval, args.gap, args.seed)
    print(
        f"spot schedule ({args.spot} slots, seed {args.seed}): drops at "
        + ", ".join(f"{d:.1f}" for d in drops[:12])
        + (" ..." if len(drops) > 12 else "")
        + " s after each step start"
    )

    with contextlib.ExitStack() as stack:
        if args.workdir is None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rlboost-migration-")))
        else:
            root = args.workdir
            root.mkdir(parents=True, exist_ok=True)
        model, tokenizer = build_tiny_llama(
            TinyLlamaShape(
                hidden_size=64,
                num_layers=2,
                num_heads=2,
                intermediate_size=128,
                max_positions=max(256, args.max_new_tokens + 32),
            ),
            seed=0,
        )
        if not args.keep_eos:
            suppress_eos(model, tokenizer.eos_token_id)
        model_dir = root / "model"
        save_model(model, tokenizer, model_dir)
        rng = random.Random(args.seed)
        records = [
            PromptRecord(f"{rng.randint(10, 99)}+{rng.randint(10, 99)}=", "", i + 1) for i in range(args.prompts)
        ]
        rollout = RolloutConfig(
            prompts_per_step=args.prompts, group_size=args.group_size, max_new_tokens=args.max_new_tokens
        )

        modes = [start_mode(name, restart, args, root, model_dir, schedule, stack) for name, restart in MODES]
        expected = args.reserved + args.spot
        for mode in modes:
            mode.wait_full(expected, args.boot_timeout)
        print(f"{len(modes)} x {expected} instances up in {time.perf_counter() - started:.1f} s")

        for step in range(args.steps):
            for mode in modes if step % 2 == 0 else modes[::-1]:
                # the schedule's start (full capacity): the next multiple of the period
                mode.clock.jump(math.ceil(mode.clock() / args.period) * args.period)
                mode.wait_full(expected, args.boot_timeout)
                mode.clock.run()
                samples, report = mode.fabric.rollout(tokenizer, records, step, 0, rollout, args.seed)
                mode.clock.freeze()
                events = mode.spot.preemptions()
                mode.reports.append(report)
                mode.events += events
                mode.responses.append({s.sample_id: s.response_ids for s in samples})
                useful = sum(len(s.response_ids) for s in samples)
                print(
                    f"step {step} {mode.name:7s} {report.step_time_s:6.2f} s  "
                    f"generated {report.tokens_generated:6d}  wasted {report.tokens_wasted:5d} "
                    f"({report.tokens_wasted / max(report.tokens_generated, 1):6.2%})  delivered {useful:6d}  "
                    f"preempted {len(events)} ({sum(e.silent for e in events)} silent)  "
                    f"migrations {report.migrations:3d}  reaped {report.reaped_samples:2d}  "
                    f"groups {report.groups_done}/{args.prompts}",
                    flush=True,
                )
        lengths = [len(r) for m in modes for step in m.responses for r in step.values()]
        same = [a[sid] == b.get(sid) for a, b in zip(modes[0].responses, modes[1].responses) for sid in a]
    # every process is stopped and the run files removed here

    stats = {mode.name: summarize(mode, args.flush_tokens) for mode in modes}
    columns = [
        "steps",
        "step_s",
        "generated",
        "wasted",
        "waste",
        "waste_max",
        "preemptions",
        "silent",
        "migrations",
        "reaped_samples",
        "rejected",
        "dropped_groups",
    ]
    print()
    print(f"{'mode':8s}" + "".join(f"{c:>{max(len(c), 9) + 2}s}" for c in columns))
    for name, s in stats.items():
        cells = [
            f"{s[c]:.2%}" if c in ("waste", "waste_max") else f"{s[c]:.2f}" if c == "step_s" else str(s[c])
            for c in columns
        ]
        print(f"{name:8s}" + "".join(f"{v:>{max(len(c), 9) + 2}s}" for c, v in zip(columns, cells)))
    resume, restart = stats["resume"], stats["restart"]
    waste_ratio = restart["waste"] / resume["waste"] if resume["waste"] > 0 else None
    time_ratio = restart["step_s"] / resume["step_s"]
    print(
        f"responses: mean length {statistics.mean(lengths):.1f} tokens (max {args.max_new_tokens}); "
        f"identical in both modes: {sum(same)}/{len(same)}"
    )
    print(
        f"unlogged SIGKILL tails (not in StepReport), upper bound: resume {resume['tail_bound']}, "
        f"restart {restart['tail_bound']} tokens"
    )
    print(
        f"restart / resume: waste {'inf (resume wasted nothing)' if waste_ratio is None else f'{waste_ratio:.1f}x'} "
        f"({restart['waste']:.2%} vs {resume['waste']:.2%}), step time {time_ratio:.2f}x "
        f"({restart['step_s']:.2f} s vs {resume['step_s']:.2f} s)"
    )
    total = time.perf_counter() - started
    print(f"target resume waste <= 1%: {'met' if resume['waste'] <= 0.01 else 'MISSED'}; total {total:.0f} s")
    print(
        json.dumps(
            {
                "resume_waste": round(resume["waste"], 5),
                "restart_waste": round(restart["waste"], 5),
                "resume_step_s": round(resume["step_s"], 3),
                "restart_step_s": round(restart["step_s"], 3),
                "preemptions": resume["preemptions"],
                "restart_preemptions": restart["preemptions"],
                "silent_kills": resume["silent"] + restart["silent"],
                "migrations": resume["migrations"],
                "restart_reclaims": restart["migrations"],
                "waste_ratio": None if waste_ratio is None else round(waste_ratio, 2),
                "step_time_ratio": round(time_ratio, 3),
                "resume_waste_max": round(resume["waste_max"], 5),
                "restart_waste_max": round(restart["waste_max"], 5),
                "resume_tokens": resume["generated"],
                "restart_tokens": restart["generated"],
                "identical_responses": round(sum(same) / max(len(same), 1), 4),
                "steps": args.steps,
                "total_s": round(total, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
