"""`rlboost trainer-node`: join this machine to a run's DeepSpeed trainer group (`trainer.nodes` > 1).

A thin command over `rl.distributed.node.serve_node`: it checks `--rendezvous`, puts the agent's
output in `--log-file`, and ends with one line: exit 0 when the training process closed the trainer,
2 for bad input, 3 when no trainer group was there to join within `--join-timeout`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

commands = typer.Typer()
"""This module's commands, added to `rlboost` by `infra.cli.app`."""


@commands.command()
def trainer_node(
    rendezvous: Annotated[
        str,
        typer.Option("--rendezvous", help="host:port of the run's trainer.rendezvous (the training process's node)."),
    ],
    run_id: Annotated[str, typer.Option("--run-id", help="The run's run.name (torchrun's rendezvous id).")],
    nproc_per_node: Annotated[
        int, typer.Option("--nproc-per-node", min=1, help="Ranks on this node: trainer.world_size / trainer.nodes.")
    ] = 1,
    nodes: Annotated[int, typer.Option("--nodes", min=2, help="The run's trainer.nodes.")] = 2,
    join_timeout: Annotated[
        float,
        typer.Option("--join-timeout", min=1, help="Seconds to wait for a trainer group (again after each one ends)."),
    ] = 1800.0,
    local_addr: Annotated[
        Optional[str],
        typer.Option("--local-addr", help="This node's address that the others reach (default: its hostname)."),
    ] = None,
    log_file: Annotated[
        Optional[Path],
        typer.Option("--log-file", help="The agent's and ranks' output (default .rlboost/trainer-node/RUN.log)."),
    ] = None,
) -> None:
    """Join this machine to a run's DeepSpeed trainer group (trainer.nodes > 1), again after each failure, until the run closes it."""
    from rl.config import split_endpoint
    from rl.distributed.node import NoTrainerGroup, serve_node

    console = Console()

    def end(code: int, line: str) -> None:
        console.print(line, style="red", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(code)

    try:
        split_endpoint(rendezvous, "--rendezvous")
    except ValueError as error:
        end(2, str(error))
    log_path = log_file or Path(".rlboost") / "trainer-node" / f"{run_id}.log"
    environment = {} if _has_cuda() else {"DS_ACCELERATOR": "cpu"}
    try:
        code = serve_node(
            rendezvous,
            run_id,
            nodes=nodes,
            nproc_per_node=nproc_per_node,
            join_timeout_s=join_timeout,
            log_path=log_path,
            local_addr=local_addr,
            environment=environment,
            say=lambda line: console.print(line, markup=False, highlight=False, soft_wrap=True),
        )
    except NoTrainerGroup as error:
        end(3, str(error))
    except OSError as error:  # the log file cannot be written
        end(2, f"cannot write the agent's log {log_path} ({error}): give a writable --log-file")
    raise typer.Exit(code)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
