"""`rlboost eval --run NAME [--checkpoint N]`: pass@k and avg@k of a run's checkpoint.

The run's configuration comes as for `rlboost train` (`--config`, `--set`; `eval.k`,
`eval.samples`, `eval.temperature` say what is estimated); the run is found under its
`run.output_dir` by name or run id (`infra.cli.export.find_run`), its checkpoint of step N or the
newest. With `fabric.enabled` the evaluation runs on the run's rollout pools, spot instances
included, its instances billed as eval $ (`infra.run.evaluation`); `--in-process` evaluates in
this process. A bad configuration (a k above `eval.samples`), an unknown run or checkpoint exits 2
with one line, before any model is loaded. The record goes to `<run>/evals/` and the run's
trackers (`tracking:`, under `eval/` at the checkpoint's step) and prints as JSON with `--json`.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from infra.cli.export import RunNotFound, find_run
from infra.cli.run_config import load_run_config

commands = typer.Typer()
"""This module's commands, added to `rlboost` by `infra.cli.app`."""


@commands.command(name="eval")
def evaluate(
    run: Annotated[str, typer.Option("--run", help="The run: its run.name (its directory), or its run id.")],
    checkpoint: Annotated[
        Optional[int], typer.Option("--checkpoint", help="The checkpoint's step (default: the newest).")
    ] = None,
    config: Annotated[
        Optional[Path], typer.Option("--config", "-c", help="The run's configuration YAML (default: the demo's).")
    ] = None,
    set_: Annotated[
        Optional[list[str]], typer.Option("--set", help="Override a field: --set eval.k=[1,4,8] (YAML value).")
    ] = None,
    in_process: Annotated[
        bool, typer.Option("--in-process", help="Evaluate in this process, not on the run's rollout fabric.")
    ] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the evaluation's record as one JSON line.")] = False,
) -> None:
    """pass@k and avg@k of a run's checkpoint, on the run's rollout fabric (spot instances included)."""
    console = Console()
    cfg = load_run_config(config, set_)
    from infra.run.evaluation import NoSuchCheckpoint, find_checkpoint

    try:
        directory = find_run(cfg.run.output_dir, run)
        path = find_checkpoint(directory, checkpoint)
    except (RunNotFound, NoSuchCheckpoint) as error:
        console.print(f"[red]eval: {error}[/red]", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": directory.name})})
    from transformers.utils import logging as hf_logging

    from infra.run.evaluation import evaluate_checkpoint, track

    hf_logging.disable_progress_bar()
    fabric = cfg.fabric.enabled and not in_process
    result = evaluate_checkpoint(cfg, path, fabric=fabric)
    track(cfg, result, f"eval-{uuid.uuid4().hex[:8]}")  # no flow run: the tracker run's name, if new
    if json_out:
        print(json.dumps(result.to_json()))
        return
    where = f"on the fabric: {result.preemptions} preemptions, eval ${result.cost_usd:.4f}" if fabric else "in process"
    console.print(f"{directory.name} {result.line()}, {where}, {result.seconds:.1f} s", markup=False, highlight=False)
