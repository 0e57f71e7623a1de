"""Where the cost ledger lives: the `ledger` section of a run configuration, and URL resolution.

One ledger holds many runs. The URL is, first that applies: the explicit one (`ledger.url`, or
`rlboost cost --db`), `$RLBOOST_LEDGER_URL`, then `sqlite:///.rlboost/ledger.sqlite` (relative to
the working directory, beside the default base model in `.rlboost/`).
"""

from __future__ import annotations

import os

from rl.config import Section

LEDGER_URL_ENV = "RLBOOST_LEDGER_URL"
DEFAULT_LEDGER_URL = "sqlite:///.rlboost/ledger.sqlite"


def resolve_ledger_url(url: str | None = None) -> str:
    """`url` if given, else `$RLBOOST_LEDGER_URL`, else `DEFAULT_LEDGER_URL`."""
    return url or os.environ.get(LEDGER_URL_ENV) or DEFAULT_LEDGER_URL


class LedgerConfig(Section):
    """Where the cost ledger is recorded."""

    url: str | None = None
    """SQLAlchemy URL of the ledger database: `sqlite:///PATH` or `postgresql+psycopg://USER@HOST/DB`
    (`postgresql://` also means psycopg). Default: `$RLBOOST_LEDGER_URL`, else
    `sqlite:///.rlboost/ledger.sqlite`."""

    def resolved_url(self) -> str:
        """The URL the run records to (see `resolve_ledger_url`)."""
        return resolve_ledger_url(self.url)
