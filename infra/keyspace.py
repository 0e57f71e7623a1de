"""The Redis keyspace of a run: its prefix and the key names of every part but the token log, which
builds its own (`infra.rollout.tokenlog`).

Every key of run `R` starts with ``rlb:{R}:`` (`run_prefix`), a Redis Cluster hash tag: a run's keys
share one slot, so multi-key scripts work on a cluster. Below it (each key: docs/ARCHITECTURE.md):

    rlb:{R}:                    the token log (`infra.rollout.tokenlog`; its keys: docs/internals.md §4)
    rlb:{R}:current_step        the current-step protocol (`infra.rollout.protocol`)
    rlb:{R}:reg:                the instance registry (`infra.rollout.registry`)
    rlb:{R}:ctl:                the controller's own state (`infra.rollout.controller`)
    rlb:{R}:w:                  weight holders and manifests (`weights_prefix`; `infra.weights.holders`)
    rlb:{R}:latest_version      the newest announced version; ``rlb:{R}:weights`` its pub/sub channel
    rlb:{R}:weights:            the shared `WeightsConfig` and transfer reports (`infra.weights.shared`)

It imports nothing, so both planes use it without importing each other (docs/internals.md §1).
"""


def run_prefix(run_id: str) -> str:
    """``rlb:{<run_id>}:``: the prefix of every key of the run (the token log's keys directly)."""
    return f"rlb:{{{run_id}}}:"


def current_step_key(run_id: str) -> str:
    """``rlb:{<run_id>}:current_step``: hash {step, version}."""
    return run_prefix(run_id) + "current_step"


def registry_prefix(run_id: str) -> str:
    return run_prefix(run_id) + "reg:"


def controller_prefix(run_id: str) -> str:
    return run_prefix(run_id) + "ctl:"


def weights_prefix(run_id: str) -> str:
    return run_prefix(run_id) + "w:"


def latest_version_key(run_id: str) -> str:
    return run_prefix(run_id) + "latest_version"


def weights_channel(run_id: str) -> str:
    return run_prefix(run_id) + "weights"


def weights_config_key(run_id: str) -> str:
    return run_prefix(run_id) + "weights:config"


def weights_transfers_key(run_id: str) -> str:
    return run_prefix(run_id) + "weights:transfers"


def glob_escape(text: str) -> str:
    """`text` as a literal inside a Redis MATCH pattern (e.g. a prefix above, to SCAN under it)."""
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)
