"""Which Prefect API this process talks to, and a check that it answers.

`current_api_url()` reads the API URL from Prefect's settings (environment, profile or a test
harness's temporary settings). `check_api(url)` asks the server's `/health` once and fails with
`PrefectApiUnreachable`, whose message names the URL, what went wrong and how to fix it.
`current_api_key()` and `current_auth_string()` are the credentials Prefect's settings hold
(Prefect Cloud's key; a self-hosted server's basic auth).
`start_guarded_ephemeral_server()` starts the ephemeral server Prefect would start on first use
and puts it under this process's guardian (`infra.services.guardian`).
"""

from __future__ import annotations

import base64

import httpx

START_HINT = (
    "start a local server with `rlboost up` and `export PREFECT_API_URL=...` as it prints, "
    "or point PREFECT_API_URL at a running Prefect server"
)


class PrefectApiUnreachable(RuntimeError):
    """No Prefect API answers where the settings point; the message says where and how to fix it."""


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


def start_guarded_ephemeral_server() -> str:
    """Start now the ephemeral API server that Prefect starts on first use when no PREFECT_API_URL is
    set, and hand it to this process's guardian: Prefect stops it only when this process exits
    normally, and a driver killed by a signal would leave it running. Returns its API URL."""
    from prefect.server.api.server import SubprocessASGIServer

    from infra.services.guardian import guardian

    server = SubprocessASGIServer()  # the instance Prefect's clients use in ephemeral mode
    server.start()
    assert server.server_process is not None
    guardian().watch(server.server_process.pid)
    return server.api_url
