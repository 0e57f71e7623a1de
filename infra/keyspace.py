"""The Redis keyspace of a run: every key name the rollout plane and the weight distribution use,
spelled once.

Every key of run `R` starts with ``rlb:{R}:`` (`run_prefix`); the braces are a Redis Cluster hash
tag, so all of a run's keys live in one slot and multi-key scripts work on a cluster. Below it:

==================================  ============================================================
``rlb:{R}:`` (`run_prefix`)         the token log (`infra.rollout.tokenlog`: its table of keys)
``rlb:{R}:current_step``            the current-step protocol (`infra.rollout.protocol`)
``rlb:{R}:reg:``                    the instance registry (`infra.rollout.registry`)
``rlb:{R}:ctl:``                    the controller's own state (`infra.rollout.controller`)
``rlb:{R}:w:`` (`weights_prefix`)   weight holders and manifests (`infra.weights.holders`)
``rlb:{R}:latest_version``          the newest announced policy version (`infra.weights.holders`)
``rlb:{R}:weights``                 pub/sub channel announcing versions (`infra.weights.holders`)
``rlb:{R}:weights:config``          the shared `WeightsConfig` (`infra.weights.shared`)
``rlb:{R}:weights:transfers``       weight transfer reports (`infra.weights.shared`)
==================================  ============================================================

It sits at the top of `infra/` and imports nothing, so both the rollout plane and the weight
distribution can use it without importing each other.
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


# --- the token log's keys that others read (the full table is in `infra.rollout.tokenlog`) ---


def sample_key(run_id: str, sample_id: str) -> str:
    """``P s:<sample>``: hash of one sample's state, owner, epoch, budget, ..."""
    return f"{run_prefix(run_id)}s:{sample_id}"


def records_key(run_id: str, sample_id: str) -> str:
    """``P s:<sample>:r``: the sample's (token, logprob) records."""
    return f"{run_prefix(run_id)}s:{sample_id}:r"


def queue_key(run_id: str, step: int) -> str:
    """``P q:<step>``: zset of the step's queued samples."""
    return f"{run_prefix(run_id)}q:{step}"


def owned_key(run_id: str, instance_id: str) -> str:
    """``P own:<instance>``: set of the samples the instance is running."""
    return f"{run_prefix(run_id)}own:{instance_id}"


def done_key(run_id: str, step: int) -> str:
    """``P done:<step>``: stream of the step's completed group ids."""
    return f"{run_prefix(run_id)}done:{step}"


def stats_key(run_id: str) -> str:
    """``P stats``: hash of the token log's counters."""
    return run_prefix(run_id) + "stats"
