"""Every `RLBOOST_*` environment variable, spelled once: a constant each, with what it holds and
who sets it. Code reads and writes them through these constants (a test keeps `RLBOOST_` literals
out of the rest of the code); docs/environment.md is generated from them (`python -m rl.env_vars`
writes it, a test keeps it current). In `rl`, the bottom layer, so that every package may import
it; it imports nothing.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Who = Literal["you", "rlboost"]


@dataclass(frozen=True)
class Variable:
    name: str
    description: str
    set_by: Who
    """`you`: a setting a user may give; `rlboost`: set by rlboost for the processes it starts."""


VARIABLES: list[Variable] = []
"""In definition order (the page's order)."""


def _variable(name: str, set_by: Who, description: str) -> str:
    VARIABLES.append(Variable(name, description, set_by))
    return name


# --- settings a user may give ---------------------------------------------------------------------

REDIS_URL = _variable(
    "RLBOOST_REDIS_URL",
    "you",
    "The run's Redis (a redis:// or rediss:// URL, password included) when `fabric.redis_url` is "
    "unset; `rlboost up` gives it to its workers, the fabric to the instances it starts.",
)
LEDGER_URL = _variable(
    "RLBOOST_LEDGER_URL",
    "you",
    "The cost ledger's database URL when neither `ledger.url` nor `rlboost cost --db` gives one "
    "(default `sqlite:///.rlboost/ledger.sqlite`).",
)
PREFECT_HOME = _variable(
    "RLBOOST_PREFECT_HOME",
    "you",
    "The Prefect home of `rlboost demo` and `rlboost train` (the ephemeral server's SQLite database; "
    "default `.rlboost/prefect`); it wins over the user's own Prefect settings ([prefect.md](prefect.md)).",
)
PREFECT_SEED_CACHE = _variable(
    "RLBOOST_PREFECT_SEED_CACHE",
    "you",
    "Where the migrated Prefect SQLite database a new Prefect home starts from is kept, one per Prefect "
    "version (default `$XDG_CACHE_HOME/rlboost/prefect-seeds`, else `~/.cache/rlboost/prefect-seeds`).",
)
TRACES_DIR = _variable(
    "RLBOOST_TRACES_DIR",
    "you",
    "The spot availability traces and list-price histories (default: the copy shipped with the package).",
)
MODEL_CACHE = _variable(
    "RLBOOST_MODEL_CACHE", "you", "Where downloaded base models are kept (default `~/.cache/rlboost/models`)."
)
WHEEL_CACHE = _variable(
    "RLBOOST_WHEEL_CACHE",
    "you",
    "Where the wheels built for cloud instances are kept (default `~/.cache/rlboost/wheels`).",
)
WEIGHTS_SECRET = _variable(
    "RLBOOST_WEIGHTS_SECRET",
    "you",
    "The shared secret of the weight peer endpoints, at least 16 characters, the same on the trainer "
    "and every instance (the default of `weights.secret_env`, which names the variable to read).",
)
AZURE_IMDS_URL = _variable(
    "RLBOOST_AZURE_IMDS_URL",
    "you",
    "The Azure Instance Metadata Service's address for the preemption watcher (a proxy, or a "
    "test's fake; default `http://169.254.169.254`).",
)

# --- set by rlboost for the processes it starts -------------------------------------------------

RUN_ID = _variable("RLBOOST_RUN_ID", "rlboost", "A rollout instance's run id.")
POOL = _variable("RLBOOST_POOL", "rlboost", "A rollout instance's pool name.")
INSTANCE_ID = _variable("RLBOOST_INSTANCE_ID", "rlboost", "A rollout instance's id.")
CAPACITY_CLASS = _variable(
    "RLBOOST_CAPACITY_CLASS", "rlboost", "A rollout instance's capacity class (`reserved`, `spot`, `ondemand`)."
)
FLOW_RUN_ID = _variable(
    "RLBOOST_FLOW_RUN_ID",
    "rlboost",
    "A cloud VM's Prefect flow run, which its boot script marks Failed when the boot fails.",
)
WHEEL = _variable("RLBOOST_WHEEL", "rlboost", "A cloud VM's downloaded wheel of the run's code (its local path).")
LOCK = _variable("RLBOOST_LOCK", "rlboost", "A cloud VM's downloaded dependency lock (its local path).")
WHEELHOUSE = _variable(
    "RLBOOST_WHEELHOUSE",
    "rlboost",
    "A cloud VM's downloaded wheelhouse archive (its local path; deleted once unpacked into "
    "`<install_dir>/wheelhouse/<sha256>/`).",
)
USER_CODE = _variable(
    "RLBOOST_USER_CODE",
    "rlboost",
    "A cloud VM's downloaded archive of the run's own modules outside the project (a reward or "
    "environment package; unpacked into `<install_dir>/user-code/<sha256>/`, which goes on `PYTHONPATH`).",
)
REDIS_CA_FILE = _variable(
    "RLBOOST_REDIS_CA_FILE",
    "rlboost",
    "The PEM file of the CA that signed a rediss:// Redis's certificate, on the instances "
    "(`fabric.redis_ca_file` on the trainer; a VM's boot script writes it).",
)
WEIGHTS_TLS_CERT = _variable(
    "RLBOOST_WEIGHTS_TLS_CERT", "rlboost", "The run's weight peer certificate (PEM), with `weights.tls`."
)
WEIGHTS_TLS_KEY = _variable(
    "RLBOOST_WEIGHTS_TLS_KEY", "rlboost", "The private key of the run's weight peer certificate (PEM)."
)
DRIVER_PID = _variable(
    "RLBOOST_DRIVER_PID",
    "rlboost",
    "The pid of the process whose death ends this one (a local instance's owner, a trainer rank's driver).",
)
TRAINER_CHANNEL = _variable(
    "RLBOOST_TRAINER_CHANNEL",
    "rlboost",
    "A distributed trainer rank's channel to the training process (a Unix socket; `host:port` when "
    "the trainer spans several nodes, given to the ranks on the training process's node).",
)
TRAINER_AUTHKEY = _variable("RLBOOST_TRAINER_AUTHKEY", "rlboost", "The hex authentication key of that channel.")
TRAINER_NODE_JOINED = _variable(
    "RLBOOST_TRAINER_NODE_JOINED",
    "rlboost",
    "A file that a trainer rank started by `rlboost trainer-node` touches once it reached the training "
    "process (the command's join timeout counts from the last group it was in).",
)

_WHO = {"you": "Settings you may give", "rlboost": "Set by rlboost for the processes it starts"}


def page() -> str:
    """docs/environment.md."""
    lines = [
        "# Environment variables",
        "",
        "[README](../README.md) · [all docs](../README.md#documentation)",
        "",
        "Every `RLBOOST_*` variable rlboost reads or sets. Generated from `rl/env_vars.py` (the one place",
        "each name is spelled) by `python -m rl.env_vars`; a test keeps this page current. Secrets (the",
        "Redis password in its URL, the weights secret) travel only in the environment, never on a command",
        "line ([security.md](security.md)).",
    ]
    for who, heading in _WHO.items():
        lines += ["", f"## {heading}", "", "| variable | what it holds |", "|---|---|"]
        lines += [f"| `{v.name}` | {v.description} |" for v in VARIABLES if v.set_by == who]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    target = Path(__file__).resolve().parent.parent / "docs" / "environment.md"
    target.write_text(page())
    sys.stdout.write(f"wrote {target}\n")
