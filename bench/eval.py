"""pass@k of a checkpoint in process against through the rollout fabric with spot preemptions (issue 38).

Takes the demo's pretrained base model (`--model`, pretrained by the demo's recipe when missing)
as a run's checkpoint, then evaluates it twice with the same `eval` settings: in this process (one
engine), and on a fabric of one co-located reserved instance and `--spot` spot worker processes.
Once the spot instances have registered, the bench preempts one as soon as it holds a sample with
logged tokens, `--preemptions` times (alternately SIGKILL and SIGTERM with a 1 s notice; the
provider starts a replacement each time): those samples continue elsewhere from their logged
tokens. The keyed sampler draws every sample by its id, so the goal is identical estimates.

    .venv/bin/python bench/eval.py [--size 64] [--samples 8] [--k 1,4,8] [--preemptions 3] [--smoke]

Last line JSON: {"pass_at_k", "pass_at_k_fabric", "identical", "avg_at_k", "avg_at_k_fabric",
"seconds_in_process", "seconds_fabric", "preemptions", "migrations", "eval_usd", ...}.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.preempt_in_flight import InFlightPreempter  # noqa: E402

STEP = 1
"""The checkpoint's step: the evaluation's step on the fabric."""


@contextmanager
def preempted(fabric: Any, spot: int, count: int) -> Iterator[None]:
    """The fabric's rollout once its `spot` instances registered, `count` of them preempted in it."""
    while len(fabric.registry.alive()) < spot + 1:  # the co-located one and the spot processes
        time.sleep(0.1)
    preempter = InFlightPreempter(fabric, STEP, count, ("preempted_silent", "preempted"))
    preempter.start()
    try:
        yield
    finally:
        preempter.stop.set()
        preempter.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", type=Path, default=REPO / ".rlboost" / "base-model")
    parser.add_argument("--size", type=int, default=64, help="held-out problems")
    parser.add_argument("--samples", type=int, default=8, help="responses per problem (n)")
    parser.add_argument("--k", default="1,4,8")
    parser.add_argument("--spot", type=int, default=2, help="spot worker processes")
    parser.add_argument("--preemptions", type=int, default=3, help="spot instances preempted inside samples")
    parser.add_argument("--smoke", action="store_true", help="8 problems, 4 samples, k 1,2,4")
    args = parser.parse_args()
    if args.smoke:
        args.size, args.samples, args.k = 8, 4, "1,2,4"

    from infra.run.config import load_config
    from infra.run.evaluation import evaluate_checkpoint
    from rl.checkpoint import save_checkpoint
    from rl.models import load_model
    from rl.pretrain import pretrain
    from rl.trainer import Trainer

    work = Path(tempfile.mkdtemp(prefix="rlboost-bench-eval-"))
    overrides = {
        "model.path": str(args.model),
        "pretrain.output": str(args.model),
        "run.name": "bench-eval",
        "run.output_dir": str(work / "runs"),
        "ledger.url": f"sqlite:///{work / 'ledger.sqlite'}",
        "eval.size": args.size,
        "eval.samples": args.samples,
        "eval.k": [int(k) for k in args.k.split(",")],
        "fabric.pools": [
            {
                "name": "reserved",
                "capacity_class": "reserved",
                "size": 1,
                "machine_type": "a2-highgpu-1g",
                "price_per_hour": 3.67,
                "colocated": True,
            },
            {
                "name": "spot",
                "capacity_class": "spot",
                "size": args.spot,
                "machine_type": "a2-highgpu-1g",
                "price_per_hour": 1.10,
                "notice_s": 1.0,
            },
        ],
        "fabric.worker": {"slots": 4, "flush_tokens": 1, "flush_ms": 20, "heartbeat_s": 0.3, "ttl_s": 1.5},
        "fabric.controller": {"reap_timeout_s": 1.5},
    }
    config = load_config(None, overrides)
    if not (args.model / "config.json").exists():
        pretrain(config.pretrain, config.model)
    model, tokenizer = load_model(args.model)
    trainer = Trainer(
        model, tokenizer.pad_token_id, config.grpo, config.optim, temperature=1.0, gradient_checkpointing=False
    )
    trainer.step = STEP
    checkpoint = save_checkpoint(config.run.directory / "checkpoints", trainer, {"cursor": 0})

    local = evaluate_checkpoint(config, checkpoint, fabric=False)
    remote = evaluate_checkpoint(
        config, checkpoint, fabric=True, during=lambda fabric: preempted(fabric, args.spot, args.preemptions)
    )
    print(
        json.dumps(
            {
                "pass_at_k": local.pass_at_k,
                "pass_at_k_fabric": remote.pass_at_k,
                "identical": local.pass_at_k == remote.pass_at_k and local.avg_at_k == remote.avg_at_k,
                "avg_at_k": local.avg_at_k,
                "avg_at_k_fabric": remote.avg_at_k,
                "seconds_in_process": round(local.seconds, 2),
                "seconds_fabric": round(remote.seconds, 2),
                "preemptions": remote.preemptions,
                "migrations": remote.migrations,
                "eval_usd": remote.cost_usd,
                "problems": local.problems,
                "samples": local.samples,
                "smoke": args.smoke,
                "cpu": platform.processor() or platform.machine(),
                "date": time.strftime("%Y-%m-%d"),
            }
        )
    )


if __name__ == "__main__":
    main()
