"""The `rlboost` command line (typer + rich): `app` assembles the commands, `cost` and `stack` hold
their own. Importing it sets the Prefect defaults before Prefect loads; it imports no torch."""

import infra.services.prefect_defaults  # noqa: F401
