"""Tracking benchmark: the demo configuration with the experiment trackers (by default all three:
MLflow on a real local `mlflow server`, TensorBoard, W&B offline) against none, alternating,
through the real `rl-train` flow (pretraining the base model if missing); in each tracked run the
MLflow server is killed (SIGKILL) after a quarter of the steps and started again at once.

    .venv/bin/python bench/tracking.py [--steps 20] [--pairs 2] [--trackers mlflow,tensorboard,wandb]
                                       [--set key=value ...]

One JSON line per run, then {"overhead_s_per_step", "overhead_fraction", "metrics_logged",
"mlflow_server_restart_survived"}: the tracked runs' mean `step_s` (but the steps while the server
restarted beside them, and the one after) minus the untracked runs', that over the untracked mean,
the metric values MLflow holds for the last tracked run (without MLflow: those handed to the
trackers), and whether every tracked run completed with every step in MLflow after the restart
(true without MLflow among `--trackers`: one tracker's cost measured alone). Goal: overhead <= 2%
of step time (docs/tracking.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")

import yaml  # noqa: E402

import flows  # noqa: E402,F401  (Prefect defaults before Prefect is imported)
from infra.run.config import load_config  # noqa: E402
from infra.tracking.local_server import MlflowServer  # noqa: E402

TRACKERS = ("mlflow", "tensorboard", "wandb")


def tracking(kinds: list[str], server: MlflowServer) -> list[dict]:
    """The `tracking` entries of `kinds`: MLflow on `server`, W&B offline."""
    entries = {
        "mlflow": {"kind": "mlflow", "uri": server.url},
        "tensorboard": {"kind": "tensorboard"},
        "wandb": {"kind": "wandb", "mode": "offline"},
    }
    return [entries[kind] for kind in kinds]


def steps_done(run_dir: Path) -> int:
    return len(list((run_dir / "steps").glob("*/metrics.json")))


def step_seconds(run_dir: Path, outage: range = range(0)) -> list[float]:
    """The run's `step_s`, but those of the steps in `outage` (the MLflow server restarting beside
    them on the same cores: its start's CPU, not the trackers')."""
    rows = [json.loads(p.read_text()) for p in sorted((run_dir / "steps").glob("*/metrics.json"))]
    return [row["step_s"] for row in rows if isinstance(row.get("step_s"), (int, float)) and row["step"] not in outage]


def kill_and_restart(server: MlflowServer, run_dir: Path, steps: int, done: threading.Event, log: dict) -> None:
    """Kill the server once a quarter of the steps are done and start it again at once: it is down
    while it starts (10 to 60 s on a 2-core machine, several steps)."""
    while steps_done(run_dir) < max(1, steps // 4):
        if done.wait(0.1):
            return
    server.stop()
    log["killed_after_step"] = steps_done(run_dir)
    server.start()
    log["back_after_step"] = steps_done(run_dir)


def mlflow_steps(server: MlflowServer, run_dir: Path) -> tuple[list[int], int]:
    """(the steps MLflow holds `reward` for, all metric values it holds) of the run."""
    from mlflow.tracking import MlflowClient

    saved = json.loads((run_dir / "tracking.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=server.url)
    run = client.get_run(saved["run_id"])
    values = sum(len(client.get_metric_history(run.info.run_id, key)) for key in run.data.metrics)
    return sorted({m.step for m in client.get_metric_history(run.info.run_id, "reward")}), values


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--config", default=None, help="run configuration (default: the demo's)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--pairs", type=int, default=2, help="tracked/untracked pairs, alternating")
    parser.add_argument("--trackers", default=",".join(TRACKERS), help="the tracked runs' trackers, comma-separated")
    parser.add_argument("--set", action="append", default=[], dest="sets", help="a config override, key=value")
    args = parser.parse_args()
    kinds = args.trackers.split(",")
    if unknown := set(kinds) - set(TRACKERS):
        parser.error(f"--trackers: unknown {sorted(unknown)}; known: {', '.join(TRACKERS)}")
    overrides = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.sets)}
    overrides["run.steps"] = args.steps
    config = load_config(args.config, overrides)
    if not (config.model.path / "config.json").exists():
        from rl.pretrain import pretrain

        pretrain(config.pretrain, config.model, threads=config.run.torch_threads)

    from infra.services.prefect_api import current_api_url, start_guarded_ephemeral_server

    if current_api_url() is None:
        start_guarded_ephemeral_server()
    from flows.rl_train import run_training

    stamp, results, survived, logged = int(time.time()), {True: [], False: []}, True, 0
    with tempfile.TemporaryDirectory() as scratch, MlflowServer(Path(scratch) / "mlflow") as server:
        for pair in range(args.pairs):
            for tracked in (True, False) if pair % 2 == 0 else (False, True):
                name = f"bench-tracking-{stamp}-{pair}-{'on' if tracked else 'off'}"
                run = {**overrides, "run.name": name}
                if tracked:
                    run["tracking"] = tracking(kinds, server)
                run_dir = load_config(args.config, run).run.directory
                done, restarts = threading.Event(), {}
                chaos = threading.Thread(target=kill_and_restart, args=(server, run_dir, args.steps, done, restarts))
                with_mlflow = tracked and "mlflow" in kinds
                if with_mlflow:
                    chaos.start()
                started = time.perf_counter()
                try:
                    summary = run_training(args.config, run)
                finally:
                    done.set()
                    if with_mlflow:
                        chaos.join()
                outage = range(restarts.get("killed_after_step", 0) + 1, restarts.get("back_after_step", 0) + 2)
                seconds = step_seconds(run_dir, outage)
                results[tracked].append(statistics.fmean(seconds))
                line = {"tracked": tracked, "run_s": round(time.perf_counter() - started, 2)}
                line["step_s_mean"] = round(statistics.fmean(seconds), 4)
                if with_mlflow:
                    if server.process is None:  # the run ended before the restart point
                        server.start()
                    held, logged = mlflow_steps(server, run_dir)
                    survived &= held == list(range(1, args.steps + 1)) and "back_after_step" in restarts
                    line |= {"mlflow_steps": len(held), "metrics_logged": logged, "server": restarts}
                elif tracked:
                    logged = summary.get("tracking_metrics_logged", 0)
                if tracked:
                    line |= {k: v for k, v in summary.items() if k.startswith("tracking_")}
                print(json.dumps(line), flush=True)
    on, off = statistics.fmean(results[True]), statistics.fmean(results[False])
    print(
        json.dumps(
            {
                "overhead_s_per_step": round(on - off, 4),
                "overhead_fraction": round((on - off) / off, 4),
                "metrics_logged": logged,
                "mlflow_server_restart_survived": survived,
            }
        )
    )


if __name__ == "__main__":
    main()
