"""A fabric sample of an evaluation is scored as the in-process evaluation scores the same sample:
a multi-turn trajectory by its environment's reward, else by its last model turn alone (an earlier
turn or a tool's result that holds the answer does not make it correct)."""

from __future__ import annotations

from rl.evaluation import sample_correct
from rl.rewards import exact_match_reward
from rl.rollout import Sample
from tests.helpers import tiny_model


def trajectory(tokenizer, turns: list[str], observations: list[str], env_reward: float | None = None) -> Sample:
    """A sample of `turns` (model text), each but the last followed by its observation (masked)."""
    response, mask, ends = [], [], []
    for k, text in enumerate(turns):
        response += tokenizer.encode(text, add_special_tokens=False)
        mask += [1] * (len(response) - len(mask))
        if k < len(observations):
            ends.append((len(response), observations[k]))
            observed = tokenizer.encode(observations[k], add_special_tokens=False)
            response += observed
            mask += [0] * len(observed)
    return Sample(
        "3/0/0",
        0,
        [1],
        response,
        [0.0] * len(response),
        "stop",
        3,
        loss_mask=mask,
        turns=ends,
        env_reward=env_reward,
    )


def test_a_trajectory_is_scored_on_its_last_model_turn_or_its_environments_reward():
    _, tokenizer = tiny_model(smallest=True)
    observation_holds_it = trajectory(tokenizer, ["calc 12+3 ", "so"], [" 15 "])
    whole = str(tokenizer.decode(observation_holds_it.response_ids, skip_special_tokens=True))
    assert exact_match_reward(whole, "15") == 1.0  # the whole response's last number is the answer
    assert not sample_correct(observation_holds_it, "15", tokenizer)  # but the model's last turn has none
    assert not sample_correct(trajectory(tokenizer, ["12+3=15 ", "so 16"], [" 15 "]), "15", tokenizer)
    assert sample_correct(trajectory(tokenizer, ["calc ", "so 15"], [" 15 "]), "15", tokenizer)
    assert sample_correct(trajectory(tokenizer, ["calc ", "so 16"], [" 15 "], env_reward=1.0), "15", tokenizer)
    assert not sample_correct(trajectory(tokenizer, ["so 15"], [], env_reward=0.0), "15", tokenizer)
    assert sample_correct(trajectory(tokenizer, ["so 15"], []), "15", tokenizer)  # single turn: the response
