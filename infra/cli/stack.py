"""`rlboost up` and `rlboost down`: start and stop the local Prefect stack (`infra.stack.stack`).

`up` prints each piece as it becomes ready and ends with the `export PREFECT_API_URL=...` line to
run in the user's shell; a bad option, an unknown pool, a stack that is already up or a piece that
fails to start exits with status 1 and a message saying what, where and how to fix it (the stack
then stops whatever it had started). `down` stops exactly the process groups `up` recorded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

commands = typer.Typer()
"""This module's commands, added to `rlboost` by `infra.cli.app`."""

StateDirOption = Annotated[
    Optional[Path],
    typer.Option(
        "--state-dir", help="Where the stack keeps stack.json, logs and the SQLite database (default .rlboost/stack)."
    ),
]


@commands.command()
def up(
    port: Annotated[
        Optional[int],
        typer.Option(
            help="Port of the Prefect server and UI on 127.0.0.1 (default 4200, or a free one if it is taken)."
        ),
    ] = None,
    database_url: Annotated[
        Optional[str],
        typer.Option(
            "--database-url",
            help="PostgreSQL URL of the Prefect server's database, e.g. postgresql://user:password@host:5432/prefect (default: SQLite in the state directory).",
        ),
    ] = None,
    config: Annotated[
        Optional[Path],
        typer.Option(
            "--config",
            "-c",
            help="Run configuration whose local pools must have rollout-instance deployments (default: the demo config).",
        ),
    ] = None,
    zombie_after_s: Annotated[
        Optional[float],
        typer.Option(
            "--zombie-after-s",
            help="Seconds without a heartbeat before a flow run is marked Crashed (default: the automation file's 90; more than the 30 s heartbeat).",
        ),
    ] = None,
    redis_appendfsync: Annotated[
        str,
        typer.Option(
            "--redis-appendfsync",
            help="When Redis fsyncs its append-only file: always, everysec (a crash loses at most the last second) or no (the OS decides); off: no persistence.",
        ),
    ] = "everysec",
    host: Annotated[
        str,
        typer.Option(
            "--host",
            help="Interface of the Prefect server (default 127.0.0.1: this machine only). Any other, e.g. 0.0.0.0 for cloud VMs, turns on basic auth with a credential kept in <state dir>/prefect-auth (mode 0600).",
        ),
    ] = "127.0.0.1",
    state_dir: StateDirOption = None,
) -> None:
    """Start a local Prefect server, Redis, the work pools, the zombie-run automation and a worker, and deploy prefect.yaml."""
    from infra.fleet.prefect_local import UnknownPool
    from infra.run.config import ConfigError
    from infra.stack.stack import DEFAULT_STATE_DIR, StackError, StackInputError
    from infra.stack.stack import up as start_stack

    if redis_appendfsync not in ("always", "everysec", "no", "off"):
        raise typer.BadParameter(
            f"{redis_appendfsync!r}: expected always, everysec, no or off", param_hint="--redis-appendfsync"
        )
    console = Console()
    try:
        state = start_stack(
            state_dir=state_dir or DEFAULT_STATE_DIR,
            port=port,
            database=database_url,
            config_path=config,
            zombie_after_s=zombie_after_s,
            redis_appendfsync=None if redis_appendfsync == "off" else redis_appendfsync,
            host=host,
            echo=lambda line: console.print(line, markup=False, highlight=False, soft_wrap=True),
        )
    except (StackError, UnknownPool, ConfigError, FileNotFoundError) as error:
        console.print(f"[red]rlboost up failed[/red]: {error}", highlight=False, soft_wrap=True)
        bad_input = isinstance(error, (StackInputError, UnknownPool, ConfigError, FileNotFoundError))
        raise typer.Exit(2 if bad_input else 1) from None
    console.print(f"\nThe stack is up (stop it with `rlboost down`). UI: {state.ui_url}")
    console.print("Point the Prefect CLI at it, then start a training run:", highlight=False)
    console.print(f"export PREFECT_API_URL={state.api_url}", markup=False, highlight=False, soft_wrap=True)
    if state.auth_file is not None:
        console.print(
            f"The server listens on {state.host} and requires basic auth: every client (this shell, the "
            f"training machine, each VM's Prefect profile) sends the credential in {state.auth_file} (mode 0600; "
            "it is not printed):",
            highlight=False,
            soft_wrap=True,
        )
        console.print(
            f'export PREFECT_API_AUTH_STRING="$(cat {state.auth_file})"', markup=False, highlight=False, soft_wrap=True
        )
        console.print(
            "Its traffic is plain HTTP: put a TLS proxy in front of it before VMs use it across networks "
            "(docs/security.md: Encryption and authentication).",
            highlight=False,
            soft_wrap=True,
        )


@commands.command()
def down(state_dir: StateDirOption = None) -> None:
    """Stop exactly what `rlboost up` started."""
    from infra.stack.stack import DEFAULT_STATE_DIR
    from infra.stack.stack import down as stop_stack

    console = Console()
    directory = state_dir or DEFAULT_STATE_DIR
    state = stop_stack(directory, echo=lambda line: console.print(line, markup=False, highlight=False, soft_wrap=True))
    if state is None:
        console.print(f"no stack is up (no {directory / 'stack.json'}); nothing to stop", highlight=False)
        return
    console.print(
        f"the stack of {state.ui_url} is down (its logs and database stay in {state.state_dir})",
        highlight=False,
        soft_wrap=True,
    )
