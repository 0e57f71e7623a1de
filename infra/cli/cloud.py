"""`rlboost cloud sweep`: delete, by hand, the VMs whose run is not alive (`infra.run.sweep`).

It sweeps the scopes (GCP projects and zones, Azure resource groups) of the cloud pools of a run
configuration (`--config`, `--set`), judging each VM labelled `rlboost-run` against the ledger
(`--db`, default the configuration's `ledger.url`) with the configuration's `fabric.cloud.sweep`
settings. `--dry-run` lists every VM with what would happen to it and why, and changes nothing.
A configuration error, or one with no cloud pools, exits 2; a cloud or ledger error exits 1 with
its message.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

cloud = typer.Typer(help="Cloud VMs of rlboost runs.", no_args_is_help=True)


@cloud.command()
def sweep(
    config: Annotated[
        Optional[Path], typer.Option("--config", "-c", help="Run configuration whose cloud pools' scopes to sweep.")
    ] = None,
    set_: Annotated[
        Optional[list[str]], typer.Option("--set", help="Override a field: --set fabric.cloud.sweep.stale_after_s=600.")
    ] = None,
    db: Annotated[
        Optional[str], typer.Option("--db", help="Ledger database URL (default: the configuration's ledger.url).")
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="List what would be deleted and why; delete nothing.")
    ] = False,
) -> None:
    """Delete the VMs (found by their rlboost-run label) whose run ended or whose driver is gone, and record them in the ledger."""
    from infra.cli.run_config import load_run_config
    from infra.ledger.db import LedgerUnavailable
    from infra.ledger.recorder import Ledger
    from infra.providers.errors import CloudError
    from infra.run.fabric import cloud_options
    from infra.run.sweep import CloudSweep

    console = Console()
    run_config = load_run_config(config, set_)
    fabric = run_config.fabric
    if not fabric.cloud_pools:
        console.print(
            f"{config or 'the demo configuration'} has no cloud pools (provider: gcp|azure): nothing to sweep; "
            "give the configuration of the runs whose VMs to sweep with --config",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(2)
    try:
        with Ledger(db or run_config.ledger.resolved_url()) as ledger:
            sweeper = CloudSweep(fabric.pools, ledger, fabric.cloud.sweep, options=cloud_options(fabric.cloud))
            items = sweeper.plan() if dry_run else sweeper.sweep()
    except (CloudError, LedgerUnavailable) as error:
        console.print(f"[red]rlboost cloud sweep failed[/red]: {error}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    table = Table(title="VMs labelled rlboost-run" + (" (dry run: nothing deleted)" if dry_run else ""))
    for column in ("provider", "zone", "VM", "run", "pool", "action", "why"):
        table.add_column(column)
    for item in items:
        action = item.verdict.action
        shown = ("would delete" if dry_run else "deleted") if action == "delete" else action
        vm = item.vm
        table.add_row(vm.provider, vm.zone, vm.name, vm.run_label, vm.pool_label, shown, item.verdict.why)
    Console(width=max(console.width, 160)).print(table)
    deleted = sum(1 for item in items if item.verdict.action == "delete")
    verb = "would delete" if dry_run else "deleted (recorded in the ledger)"
    console.print(f"{len(items)} labelled VMs; {verb}: {deleted}", highlight=False)
