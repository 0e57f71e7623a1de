"""`rlboost export --run NAME [--merge] --output DIR`: a run's latest checkpoint as a model other
tools load.

The run is found under `--runs-dir` (the `run.output_dir` it was trained with, `runs` by
default) by its `run.name` (its directory) or by its run id (`identity.json`, the id `rlboost cost
--run` takes). Its base model is the one its driver recorded (`<run>/model.json`,
`infra.run.model_record`); its checkpoint the newest complete one (`rl.checkpoint.latest_checkpoint`).
A LoRA run exports a PEFT adapter directory, or with `--merge` the adapters merged into the base as
a plain Hugging Face model directory; a full fine-tuning run exports that model directory
(`rl.export`). An unknown run, a run without a checkpoint or a model record, a damaged checkpoint
or an output that may not be written exits 2 with one line saying what to do, before anything is
written.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from infra.run.identity import IDENTITY_FILE, stored_identity
from infra.run.model_record import NoModelRecord, read_model

CHECKPOINTS = "checkpoints"
"""A run's checkpoint root under its directory (`TrainingSession.checkpoint_dir`)."""

RunOption = Annotated[
    str, typer.Option("--run", help="The run: its run.name (its directory under --runs-dir), or its run id.")
]
OutputOption = Annotated[Path, typer.Option("--output", "-o", help="The directory to write.")]
MergeOption = Annotated[
    bool,
    typer.Option(
        help="LoRA runs: merge the adapters into the base and write a plain Hugging Face model directory "
        "(without: a PEFT adapter directory). A full fine-tuning run always exports the whole model: "
        "--merge changes nothing there."
    ),
]
RunsDirOption = Annotated[
    Path, typer.Option("--runs-dir", help="Where the runs are: the run.output_dir they were trained with.")
]
ForceOption = Annotated[bool, typer.Option(help="Replace a non-empty output directory.")]


class RunNotFound(ValueError):
    """No run of that name or id under the runs directory; the message lists the runs there."""


class NoCheckpoint(ValueError):
    """A run without a complete checkpoint to export; the message says why."""


def find_run(runs_dir: Path, run: str) -> Path:
    """The directory of run `run` (its name or its run id) under `runs_dir`."""
    if not runs_dir.is_dir():
        raise RunNotFound(f"no runs directory {runs_dir}: give --runs-dir, the run.output_dir the run was trained with")
    known: dict[str, Path] = {}
    for directory in sorted(p for p in runs_dir.iterdir() if p.is_dir() and (p / IDENTITY_FILE).exists()):
        known[directory.name] = directory
        try:
            identity = stored_identity(directory)
        except ValueError:  # a damaged identity: the run is still known by its name
            continue
        if identity is not None:
            known.setdefault(identity.run_id, directory)
    if run in known:
        return known[run]
    names = sorted(p.name for p in set(known.values()))
    listed = f"the runs there are {', '.join(names)}" if names else "it holds no run (no */identity.json)"
    raise RunNotFound(f"no run {run!r} in {runs_dir} (by run.name or run id): {listed}")


commands = typer.Typer()
"""This module's commands, added to `rlboost` by `infra.cli.app`."""


@commands.command()
def export(
    run: RunOption,
    output: OutputOption,
    merge: MergeOption = False,
    runs_dir: RunsDirOption = Path("runs"),
    force: ForceOption = False,
) -> None:
    """Write a run's latest checkpoint as a PEFT adapter directory (LoRA) or a Hugging Face model directory (--merge, or a full fine-tuning run)."""
    from transformers.utils import logging as hf_logging

    from rl.export import ExportError, export_checkpoint

    hf_logging.disable_progress_bar()
    console = Console()
    try:
        directory = find_run(runs_dir, run)
        model = read_model(directory)
        checkpoint, skipped = _checkpoint(directory)
        result = export_checkpoint(checkpoint, model.path, model.gguf_file, output, merge=merge, force=force)
    except (RunNotFound, NoModelRecord, NoCheckpoint, ExportError) as error:
        console.print(f"[red]export: {error}[/red]", markup=True, highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    if skipped:
        console.print(f"[yellow]{skipped}[/yellow]", highlight=False, soft_wrap=True)
    what = {
        "adapter": "a PEFT adapter directory (LoRA adapters)",
        "merged": "a Hugging Face model directory (LoRA adapters merged into the base, fp32)",
        "full": "a Hugging Face model directory (fp32)",
    }[result.kind]
    console.print(
        f"exported run {directory.name} at step {result.step} -> {result.output}: {what}, "
        f"{_size(result.bytes)} ({result.seconds:.1f} s)",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    for line in load_commands(result.kind, result.output, model.path, model.gguf_file):
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def _checkpoint(directory: Path) -> tuple[Path, str | None]:
    """The run's newest complete checkpoint, and a note when a newer one was damaged and skipped."""
    from rl.checkpoint import LATEST, CorruptCheckpoint, damage, latest_checkpoint

    root = directory / CHECKPOINTS
    checker = logging.getLogger("rl.checkpoint")
    level = checker.level
    checker.setLevel(logging.ERROR)  # a skipped checkpoint is said once, in the note
    try:
        checkpoint = latest_checkpoint(root)
    except CorruptCheckpoint:
        newest = root / (root / LATEST).read_text().strip()
        raise NoCheckpoint(
            f"run {directory.name} has no complete checkpoint: {damage(newest)}; restore the file to export it"
        ) from None
    finally:
        checker.setLevel(level)
    if checkpoint is None:
        raise NoCheckpoint(
            f"run {directory.name} has no checkpoint yet ({root}): a run writes one every run.checkpoint_every "
            "steps and after its last step; export it once it has one"
        )
    newest = root / (root / LATEST).read_text().strip()
    if newest == checkpoint or not newest.exists():
        return checkpoint, None
    return (
        checkpoint,
        f"skipped checkpoint {newest.name}, which is damaged ({damage(newest)}): exported {checkpoint.name}",
    )


def load_commands(kind: str, output: Path, base: Path, gguf_file: str | None) -> list[str]:
    """How to load what was exported: Python lines, and vLLM's command for a model directory."""
    if kind == "adapter":
        gguf = f", gguf_file={gguf_file!r}" if gguf_file else ""
        return [
            "load it with: from transformers import AutoModelForCausalLM; from peft import PeftModel; "
            f"model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({str(base)!r}{gguf}), {str(output)!r})"
        ]
    return [
        "load it with: from transformers import AutoModelForCausalLM, AutoTokenizer; "
        f"model = AutoModelForCausalLM.from_pretrained({str(output)!r}); "
        f"tokenizer = AutoTokenizer.from_pretrained({str(output)!r})",
        f"or serve it: vllm serve {output}",
    ]


def _size(count: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"
