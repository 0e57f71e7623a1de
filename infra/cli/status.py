"""`rlboost status --run NAME`: the fleet of a running run, read from its Redis, as a rich table.

One row per registered instance: its id, pool, the policy version it serves with the first
characters of the sha of the weights it decodes with (`!` after it: not the publisher's sha for
that version, so the token log refuses its tokens; `base`: the model it started on), the samples
it holds and its last heartbeat's age. Readable at 80 columns. The run is its `run.name` (its
directory under `--runs-dir`) or its run id; the Redis is `--redis-url`, else `$RLBOOST_REDIS_URL`,
else the embedded Redis the running run started (`<run>/redis.url`, `infra.run.redis_address`);
none, or one that cannot be reached, is one line and exit 2.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from rl import env_vars

if TYPE_CHECKING:  # the token log and Redis load when the command runs, not with `rlboost --help`
    from infra.rollout.registry import InstanceSnapshot

commands = typer.Typer()

SHA_CHARS = 10
"""Characters of a weights sha the table shows."""

RunOption = Annotated[
    str, typer.Option("--run", help="The run: its run.name (its directory under --runs-dir), or its run id.")
]
RedisOption = Annotated[
    Optional[str],
    typer.Option(
        "--redis-url",
        help=f"The run's Redis (default: ${env_vars.REDIS_URL}, else the embedded Redis the running run started).",
    ),
]
RunsDirOption = Annotated[
    Path, typer.Option("--runs-dir", help="Where the runs are: the run.output_dir they were trained with.")
]


def _age(snapshot: InstanceSnapshot, now: float) -> str:
    if snapshot.last_heartbeat is None:
        return "never"
    return f"{max(0.0, now - snapshot.last_heartbeat):.1f} s"


def _served(snapshot: InstanceSnapshot, expected: dict[int, str]) -> str:
    from infra.rollout.served import is_wrong

    if snapshot.policy_version is None:
        return "-"
    sha = "base" if snapshot.weights_sha is None else snapshot.weights_sha[:SHA_CHARS]
    return f"v{snapshot.policy_version} {sha}{' !' if is_wrong(snapshot, expected) else ''}"


def fleet_table(snapshots: list[InstanceSnapshot], expected: dict[int, str], now: float) -> Table:
    """The fleet as a table (`now`: the registry's clock, Unix seconds)."""
    from infra.rollout.served import served_weights

    served = served_weights(snapshots, expected)
    versions = ", ".join(f"v{v}: {n}" for v, n in served.versions.items())
    caption = f"{len(snapshots)} instances ({versions or 'none'}); {len(served.wrong)} serving wrong weights"
    table = Table(title="rollout fleet", caption=caption)
    table.add_column("instance", overflow="fold")
    table.add_column("pool", overflow="fold")
    table.add_column("served", no_wrap=True)
    table.add_column("held", justify="right")
    table.add_column("heartbeat", justify="right", no_wrap=True)
    for s in snapshots:
        table.add_row(
            s.spec.instance_id if s.alive else f"{s.spec.instance_id} (silent)",
            s.spec.pool,
            _served(s, expected),
            str(s.running),
            _age(s, now),
        )
    return table


def run_and_redis(run: str, redis_url: str | None, runs_dir: Path) -> tuple[str, str, Path | None]:
    """(the run id, the URL of its Redis, the run's `redis.url` file it came from or None) of `run`
    (a run.name or a run id); raises `ValueError` with the line to print when there is no Redis to
    read."""
    from infra.cli.export import RunNotFound, find_run
    from infra.run.identity import stored_identity
    from infra.run.redis_address import REDIS_URL_FILE, read_redis_url

    url = redis_url or os.environ.get(env_vars.REDIS_URL)
    try:
        directory = find_run(runs_dir, run)
    except RunNotFound as error:
        if url:
            return run, url, None  # a run id on a Redis the user named: no directory needed
        raise ValueError(f"{error}; or pass --redis-url (or set ${env_vars.REDIS_URL}) to the run's Redis") from None
    identity = stored_identity(directory)
    run_id = identity.run_id if identity else run
    if url:
        return run_id, url, None
    url = read_redis_url(directory)
    if not url:
        raise ValueError(
            f"run {run!r} has no embedded Redis running (no {directory / REDIS_URL_FILE}): pass --redis-url "
            f"or set ${env_vars.REDIS_URL} to the run's Redis"
        )
    return run_id, url, directory / REDIS_URL_FILE


@commands.command()
def status(run: RunOption, redis_url: RedisOption = None, runs_dir: RunsDirOption = Path("runs")) -> None:
    """The fleet of a running run: instance, pool, served version and weights sha, samples held, last heartbeat."""
    from infra.rollout.registry import InstanceRegistry
    from infra.rollout.tokenlog import TokenLog
    from infra.services.redis_embedded import RedisSettings, RedisUnavailable

    console = Console()
    try:
        run_id, url, address_file = run_and_redis(run, redis_url, runs_dir)
    except ValueError as error:
        console.print(str(error), markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    try:
        client = RedisSettings(url=url).client("--redis-url")
    except RedisUnavailable as error:
        line = str(error)
        if address_file is not None:  # the run's own Redis, gone with a driver that was killed
            line = f"run {run!r} is not running: its embedded Redis ({address_file}) does not answer"
        console.print(line, markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    with client:
        snapshots = InstanceRegistry(client, run_id).all()
        expected = TokenLog(client, run_id).expected_weights()
        seconds, micros = client.time()
    if not snapshots:
        console.print(f"run {run!r} has no registered instance in that Redis (check --run)", markup=False)
        raise typer.Exit(2)
    console.print(fleet_table(snapshots, expected, seconds + micros / 1e6))
