"""Which Prefect API this process talks to, and a check that it answers.

`current_api_url()` reads the API URL from Prefect's settings (environment, profile or a test
harness's temporary settings). `check_api(url)` asks the server's `/health` once and fails with
`PrefectApiUnreachable`, whose message names the URL, what went wrong and how to fix it.
`current_api_key()` and `current_auth_string()` are the credentials Prefect's settings hold
(Prefect Cloud's key; a self-hosted server's basic auth).
`start_guarded_ephemeral_server(log)` starts the ephemeral server Prefect would start on first use
and puts it under this process's guardian (`infra.services.guardian`); its output goes to `log`.
It takes a free port of Prefect's range itself, and starts one server at a time per Prefect home
(an flock beside its database: the first start copies the migrated seed of `prefect_seed` there,
or migrates it). One that cannot start (its database written by another Prefect version, no free
port) raises `PrefectServerCannotStart`, whose message is one line saying why and the fix
(`check_ephemeral_database()` checks the database alone).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import logging
import os
import random
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import httpx

from infra.services.prefect_home import HOME_ENV, sqlite_path
from infra.services.prefect_seed import seed_database

logger = logging.getLogger(__name__)

START_HINT = (
    "start a local server with `rlboost up` and `export PREFECT_API_URL=...` as it prints, "
    "or point PREFECT_API_URL at a running Prefect server"
)


EPHEMERAL_START_ATTEMPTS = 2
"""Server processes one start may launch: Prefect starts another on a new port when one exits during
start-up (its port taken); one that fails again fails for another reason, every time."""


class PrefectApiUnreachable(RuntimeError):
    """No Prefect API answers where the settings point; the message says where and how to fix it."""


class PrefectServerCannotStart(RuntimeError):
    """The ephemeral Prefect server cannot start; the message, one line, says why and how to fix it.
    `bad_database`: the cause is its database (the user's to fix, like other bad local state)."""

    def __init__(self, message: str, *, bad_database: bool) -> None:
        super().__init__(message)
        self.bad_database = bad_database


def current_api_url() -> str | None:
    """`PREFECT_API_URL` as Prefect resolves it here (None: Prefect would start an ephemeral server)."""
    from prefect.settings import get_current_settings

    return get_current_settings().api.url


def current_api_key() -> str | None:
    """`PREFECT_API_KEY` as Prefect resolves it here (None: a server without authentication)."""
    from prefect.settings import get_current_settings

    key = get_current_settings().api.key
    return key.get_secret_value() if key else None


def current_auth_string() -> str | None:
    """`PREFECT_API_AUTH_STRING` as Prefect resolves it here: `user:password` of a self-hosted
    server that requires basic auth (`PREFECT_SERVER_API_AUTH_STRING`; `rlboost up --host`)."""
    from prefect.settings import get_current_settings

    auth = get_current_settings().api.auth_string
    return auth.get_secret_value() if auth else None


def basic_auth_header(auth_string: str) -> str:
    """The `Authorization` header value of a Prefect server's basic auth."""
    return "Basic " + base64.b64encode(auth_string.encode()).decode()


def _auth_headers() -> dict[str, str]:
    auth, key = current_auth_string(), current_api_key()
    if auth:  # Prefect's own clients prefer the auth string too
        return {"Authorization": basic_auth_header(auth)}
    return {"Authorization": f"Bearer {key}"} if key else {}


def check_api(url: str | None, timeout_s: float = 5.0, *, purpose: str = "this command") -> str:
    """`url` if a Prefect server answers its health check there; else `PrefectApiUnreachable`."""
    if not url:
        raise PrefectApiUnreachable(
            f"{purpose} needs a running Prefect server, but PREFECT_API_URL is not set; {START_HINT}"
        )
    try:
        response = httpx.get(f"{url.rstrip('/')}/health", headers=_auth_headers(), timeout=timeout_s)
    except httpx.HTTPError as error:
        raise PrefectApiUnreachable(
            f"cannot reach the Prefect API at {url} (PREFECT_API_URL) for {purpose}: "
            f"{type(error).__name__}: {error or 'no answer'}; {START_HINT}"
        ) from None
    if response.status_code != 200:
        raise PrefectApiUnreachable(
            f"the Prefect API at {url} (PREFECT_API_URL) answered its health check with HTTP "
            f"{response.status_code}; is it a Prefect server's /api URL? {START_HINT}"
        )
    return url


def _ephemeral_database_url() -> str:
    from prefect.settings import get_current_settings

    url = get_current_settings().server.database.connection_url
    return url.get_secret_value() if url is not None else ""


def check_ephemeral_database() -> None:
    """`PrefectServerCannotStart` if the ephemeral server could not start on its database, found
    without starting it (`infra.services.prefect_home.database_problem`)."""
    import prefect

    from infra.services.prefect_home import database_problem

    problem = database_problem(_ephemeral_database_url(), prefect.__version__, f"set {HOME_ENV} to another directory")
    if problem:
        raise PrefectServerCannotStart(f"cannot start the embedded Prefect server: {problem}", bad_database=True)


def _launch_with_output_to(server, log: Path) -> None:
    """Make `server` (Prefect's `SubprocessASGIServer`, which starts its process with this one's
    stdout and stderr) start its processes writing to `log`, at most `EPHEMERAL_START_ATTEMPTS`."""
    launch, attempts = server._run_uvicorn_command, 0

    def launch_logging():
        nonlocal attempts
        attempts += 1
        if attempts > EPHEMERAL_START_ATTEMPTS:
            raise RuntimeError(f"the server exited during start-up {attempts - 1} times")
        log.parent.mkdir(parents=True, exist_ok=True)
        sys.stdout.flush(), sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        try:
            with log.open("ab") as out:
                os.dup2(out.fileno(), 1), os.dup2(out.fileno(), 2)  # the child inherits them
                return launch()
        finally:
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            os.close(saved[0]), os.close(saved[1])

    server._run_uvicorn_command = launch_logging


def start_guarded_ephemeral_server(log: Path | None = None) -> str:
    """Start now the ephemeral API server that Prefect starts on first use when no PREFECT_API_URL is
    set, and hand it to this process's guardian: Prefect stops it only when this process exits
    normally, and a driver killed by a signal would leave it running. Returns its API URL.

    With `log`, the server's output goes there, not to this process's console, and a server that
    cannot start raises `PrefectServerCannotStart` (its traceback in `log`)."""
    import prefect
    from prefect.server.api.server import SubprocessASGIServer

    from infra.services.guardian import guardian

    if log is not None:
        check_ephemeral_database()
    server = SubprocessASGIServer()  # the instance Prefect's clients use in ephemeral mode
    if log is not None and not server.running:
        _launch_with_output_to(server, log)
        if server.port is None:
            server.port = _free_port_of(server)
    try:
        with _one_start_at_a_time():
            _seed_ephemeral_database(server)
            server.start()
    except Exception as error:
        if log is None:
            raise
        with log.open("a") as out:
            traceback.print_exc(file=out)
        reason = " ".join(f"{type(error).__name__}: {error}".split())[:200]
        raise PrefectServerCannotStart(
            f"the embedded Prefect server (Prefect {prefect.__version__}, database "
            f"{_ephemeral_database_url() or 'its default'}) did not start: {reason}; its log: {log}. "
            f"Point PREFECT_API_URL at a running server (`rlboost up`), or set {HOME_ENV} to "
            f"another directory for a fresh database",
            bad_database=False,
        ) from None
    assert server.server_process is not None
    guardian().watch(server.server_process.pid)
    return server.api_url


def _seed_ephemeral_database(server) -> None:
    """Give a server about to start on a SQLite database that does not exist yet a migrated copy of
    the seed (`infra.services.prefect_seed`): it then skips Prefect's migrations."""
    database = sqlite_path(_ephemeral_database_url())
    if not server.running and database is not None:
        seed_database(database, logger)


START_LOCK_FILE = "ephemeral-server.lock"
"""In the Prefect home: held while an ephemeral server starts (and migrates the home's database)."""


@contextlib.contextmanager
def _one_start_at_a_time() -> Iterator[None]:
    """Hold the Prefect home's start lock: two drivers starting at the same instant on one home
    would run Prefect's SQLite migrations at once (one fails). Waits at most the start-up timeout
    (then starts anyway: Prefect's own failure says what happened)."""
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, get_current_settings

    home = Path(get_current_settings().home)
    home.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + float(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())
    with open(home / START_LOCK_FILE, "a") as handle:
        while True:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        yield  # closing the file releases the lock


def _free_port_of(server) -> int:
    """A free loopback port in the range Prefect's ephemeral server uses; `PrefectServerCannotStart`
    when every one is in use (Prefect itself tries ten at random and fails with a bare RuntimeError)."""
    ports = list(server._port_range)
    random.shuffle(ports)
    for port in ports:
        if server.is_port_available(port):
            return port
    raise PrefectServerCannotStart(
        f"the embedded Prefect server needs a free port on 127.0.0.1 in {ports and min(ports)}-{ports and max(ports)} "
        "(Prefect's range) and every one is in use: stop what holds them, or point PREFECT_API_URL at a running "
        "Prefect server (`rlboost up`)",
        bad_database=False,
    )
