"""`python -m infra.cli ...`: the `rlboost` command line."""

from infra.cli.app import app

app()
