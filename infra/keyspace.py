"""The Redis keyspace of a run: its prefixes, and its keys but the token log's (`infra.rollout.tokenlog`).

Run `R`'s keys start with ``rlb:{R}:`` (`run_prefix`), a Redis Cluster hash tag (one slot: multi-key
scripts work on a cluster), the token log's S > 1 shards with ``rlb:{R/k}:`` (`tokenlog_prefix`):

    rlb:{R}: or rlb:{R/k}:      the token log (`infra.rollout.tokenlog`; its keys: docs/internals.md §4)
    rlb:{R}:tokenlog_shards     the token log's shard count, set by the run's driver
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


def tokenlog_prefix(run_id: str, shard: int, shards: int) -> str:
    """The prefix of the token log's shard `shard` of `shards`: ``rlb:{<run_id>/<shard>}:``, or the
    run's own prefix when there is one shard (the layout of a run that predates shards)."""
    return run_prefix(run_id) if shards == 1 else f"rlb:{{{run_id}/{shard}}}:"


def tokenlog_shards_key(run_id: str) -> str:
    """``rlb:{<run_id>}:tokenlog_shards``: the token log's shard count (absent: 1)."""
    return run_prefix(run_id) + "tokenlog_shards"


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
