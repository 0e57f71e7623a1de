"""The training session under bounded staleness (K = 1; fabric: an embedded Redis and a co-located
instance): a step's rollout admits the next K steps and no more; with `grpo.objective: auto` the
trainer runs the decoupled objective, which the step's metrics name and show (`objective`, the
importance weights' spread); and tokens more than K versions older than the trained one are
refused before any update. The steps trained here are hand-made samples (their behaviour
log-probs and token versions chosen by the test), written where `train` reads them."""

from __future__ import annotations

import json

import pytest

from infra.rollout.tokenlog import TokenLog
from infra.run.config import load_config
from infra.run.session import TrainingSession
from rl.rollout import Sample, write_samples
from tests.helpers import RESERVED_POOL, save_tiny_model, tiny_run, tiny_shape

pytestmark = pytest.mark.integration

K = 1


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    root = tmp_path_factory.mktemp("session-staleness")
    base = save_tiny_model(root / "base", tiny_shape())
    overrides = {
        "training.max_staleness": K,
        "fabric.pools": [{**RESERVED_POOL, "colocated": True}],
        "rollout.max_new_tokens": 6,
        "ledger.url": f"sqlite:///{root / 'ledger.sqlite'}",
    }
    session = TrainingSession(load_config(None, tiny_run(base, root, "staleness", None, overrides)))
    try:
        yield session
    finally:
        session.close()


def _admitted(log: TokenLog, step: int) -> bool:
    try:
        log.step_status(step)
    except KeyError:
        return False
    return True


def _hand_made(directory, versions: list[list[int]], version: int, behaviour_logprob: float = -1.0):
    """(rollout path, scores path) of samples of step version `version`, one per `versions` entry
    (the version of each of its 4 response tokens), with advantages +1 and -1 in turn."""
    samples = [
        Sample(
            sample_id=f"x/{i // 2}/{i % 2}",
            group=i // 2,
            prompt_ids=[1, 5, 7 + i],
            response_ids=[8, 9, 10, 11],
            logprobs=[behaviour_logprob] * 4,
            finish_reason="length",
            policy_version=version,
            token_versions=[] if set(tokens) == {version} else tokens,
        )
        for i, tokens in enumerate(versions)
    ]
    directory.mkdir(parents=True, exist_ok=True)
    rollout, scores = directory / "rollout.jsonl", directory / "scores.json"
    write_samples(rollout, samples)
    scores.write_text(json.dumps({"advantages": [1.0 if i % 2 == 0 else -1.0 for i in range(len(samples))]}))
    return str(rollout), str(scores)


def test_a_rollout_admits_the_next_k_steps_and_no_more(session):
    step = session.step + 1
    session.rollout(step)
    log = session.fabric.log
    assert [later for later in range(step + 1, step + K + 3) if _admitted(log, later)] == list(
        range(step + 1, step + K + 1)
    )
    assert session.generated_ahead(step)["steps"] == list(range(step + 1, step + K + 1))


def test_auto_trains_the_decoupled_objective_and_the_metrics_show_it(session, tmp_path):
    assert session.config.grpo.objective == "auto"
    version = session.step
    # Behaviour log-probs far below the trainer's: every weight exp(proximal - behaviour) is
    # truncated at tis_cap. Plain GRPO would weigh every token 1.
    paths = _hand_made(tmp_path, [[version] * 4] * 4, version, behaviour_logprob=-30.0)
    metrics = session.train(version + 1, *paths)
    cap = session.config.grpo.tis_cap
    assert metrics["objective"] == "decoupled"
    assert metrics["is_truncated_fraction"] == 1.0 and metrics["is_weight_mean"] == pytest.approx(cap)
    assert metrics["is_weight_deviation"] == pytest.approx(cap - 1)


def test_tokens_more_than_k_versions_old_are_refused_before_training(session, tmp_path):
    while session.step < K + 1:  # a trained version with K + 1 versions before it
        version = session.step
        session.train(version + 1, *_hand_made(tmp_path / f"on-policy-{version}", [[version] * 4] * 2, version))
    version = session.step
    too_old = [[version] * 4, [version, version - K - 1, version, version]]
    with pytest.raises(RuntimeError, match=rf"outside training.max_staleness={K}"):
        session.train(version + 1, *_hand_made(tmp_path / "too-old", too_old, version))
    assert session.step == version  # no update
    within = [[version] * 4, [version, version - K, version, version]]
    metrics = session.train(version + 1, *_hand_made(tmp_path / "within", within, version))
    assert metrics["version_lag_max"] == K and session.step == version + 1
