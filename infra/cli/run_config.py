"""The run configuration as the CLI's commands take it: `--config FILE` and `--set key=value`
overrides, with a configuration error printed and exit status 2 (bad input). A command's
`reward.function` and `environment.class` import from the current directory too, as `python -m`
would (after the installed packages, which a module there cannot shadow)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer
import yaml
from rich.console import Console

from infra.run.config import ConfigError, load_config


def parse_overrides(pairs: list[str] | None) -> dict:
    """`--set` pairs as a dict of dotted keys to YAML values."""
    overrides = {}
    for pair in pairs or []:
        key, equals, value = pair.partition("=")
        if not equals or not key.strip():
            raise ConfigError(f"--set {pair!r}: expected key=value, e.g. --set run.steps=20")
        overrides[key.strip()] = yaml.safe_load(value)
    return overrides


def load_run_config(config: Path | None, pairs: list[str] | None):
    """The configuration of `config` (None: the demo's) with `pairs` applied; a configuration error
    is printed and ends the command with exit status 2."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.append(here)
    try:
        return load_config(config, parse_overrides(pairs))
    except ConfigError as error:
        console = Console()
        console.print("[red]configuration error[/red]")
        console.print(str(error), markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
