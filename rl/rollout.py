"""One RL step's rollout as data: requests for n samples per prompt, and the samples that come back.

Sample ids are ``"<step>/<group>/<index>"`` and the sampling seed is derived from (run seed,
step), so a sample's tokens are a pure function of the policy and its id: a step re-run after a
crash, or a sample resumed on another instance, draws the same tokens. A multi-turn trajectory is
one sample whose response alternates model turns and environment segments (`Sample.loss_mask`
0: never trained); `Sample.model_turns` cuts it into its turns.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rl.config import PromptConfig, RolloutConfig
from rl.datasets import PromptRecord
from rl.generation import GenerationRequest, GenerationResult, SamplingParams
from rl.prompts import encode_prompt


@dataclass
class Sample:
    sample_id: str
    group: int
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    policy_version: int
    """The version the sample's step trains from (the proximal policy)."""
    token_versions: list[int] = field(default_factory=list)
    """The version that generated each response token (empty: all `policy_version`)."""
    loss_mask: list[int] = field(default_factory=list)
    """Per response token, 1 if it is trained (the model generated it) and 0 if not (an environment
    segment's, logprob 0.0); empty: all ones (a single-turn response)."""
    turns: list[tuple[int, str | None]] = field(default_factory=list)
    """A trajectory's completed turns: where each model turn ends in the response and the
    environment's observation after it (its tokens follow)."""
    env_reward: float | None = None
    """The environment's terminal reward (None: the run's reward function scores the response)."""
    truncated: bool = False
    """A trajectory ended by `environment.max_turns` or its token budget (scored all the same)."""
    migrated_mid_turn: int = 0
    """Times a trajectory continued on another instance from inside a model turn (the fabric's)."""
    env_s: float = 0.0
    """Seconds a trajectory's environment steps took."""
    wait_s: float = 0.0
    """Seconds a trajectory waited for its environment's answers."""
    life_s: float = 0.0
    """Seconds from a trajectory's first claim to its end (the fabric's; 0.0: not measured)."""

    def versions(self) -> list[int]:
        """The generating version of each response token."""
        return self.token_versions or [self.policy_version] * len(self.response_ids)

    def trained(self) -> list[int]:
        """The loss mask of every response token (all ones for a single-turn response)."""
        return self.loss_mask or [1] * len(self.response_ids)

    def model_turns(self) -> list[tuple[int, int, str | None]]:
        """(start, end, observation after it) of each model turn in the response, in order; the
        last one has no observation. A single-turn response is one turn."""
        mask, starts, spans = self.trained(), 0, []
        for end, observation in self.turns:
            spans.append((starts, end, observation))
            starts = end
            while starts < len(mask) and not mask[starts]:
                starts += 1
        return [*spans, (starts, len(self.response_ids), None)]


@dataclass(frozen=True)
class TrajectoryFigures:
    """What a step's trajectories did (the step record's fields of the same names)."""

    turns_mean: float
    """Mean model turns per trajectory."""
    tool_calls: int
    """Turns answered with an observation."""
    env_s: float
    """Seconds of environment steps, summed."""
    tool_wait_fraction: float
    """Seconds waiting for the environment over seconds from first claim to end, both summed."""
    migrated_mid_turn: int
    """Continuations on another instance from inside a model turn."""


def trajectory_figures(samples: list[Sample]) -> TrajectoryFigures:
    """The figures of a step's trajectories (each sample one trajectory; none: zeros)."""
    life = sum(s.life_s for s in samples)
    return TrajectoryFigures(
        turns_mean=sum(len(s.turns) + 1 for s in samples) / max(1, len(samples)),
        tool_calls=sum(len(s.turns) for s in samples),
        env_s=sum(s.env_s for s in samples),
        tool_wait_fraction=sum(s.wait_s for s in samples) / life if life > 0 else 0.0,
        migrated_mid_turn=sum(s.migrated_mid_turn for s in samples),
    )


def step_seed(run_seed: int, step: int) -> int:
    return run_seed * 1_000_003 + step


def sampling_params(config: RolloutConfig, prompt: PromptConfig = PromptConfig()) -> SamplingParams:
    return SamplingParams(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k, stop=prompt.stop)


def build_requests(
    tokenizer,
    records: list[PromptRecord],
    step: int,
    config: RolloutConfig,
    run_seed: int,
    prompt: PromptConfig = PromptConfig(),
) -> list[GenerationRequest]:
    """`config.group_size` requests per prompt, grouped consecutively; prompts encoded as `prompt` says."""
    sampling = sampling_params(config, prompt)
    seed = step_seed(run_seed, step)
    requests = []
    for group, record in enumerate(records):
        prompt_ids = encode_prompt(tokenizer, record.prompt, prompt)
        for index in range(config.group_size):
            requests.append(
                GenerationRequest(
                    sample_id=f"{step}/{group}/{index}",
                    prompt_ids=prompt_ids,
                    max_new_tokens=config.max_new_tokens,
                    seed=seed,
                    sampling=sampling,
                )
            )
    return requests


def samples_from_results(
    requests: list[GenerationRequest], results: list[GenerationResult], policy_version: int
) -> list[Sample]:
    return [
        Sample(
            sample_id=req.sample_id,
            group=int(req.sample_id.split("/")[1]),
            prompt_ids=req.prompt_ids,
            response_ids=res.token_ids,
            logprobs=res.new_logprobs,
            finish_reason=res.finish_reason,
            policy_version=policy_version,
        )
        for req, res in zip(requests, results)
    ]


def write_samples(path: Path, samples: list[Sample]) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as handle:
        for sample in samples:
            handle.write(json.dumps(asdict(sample)) + "\n")
    tmp.replace(path)


def read_samples(path: Path) -> list[Sample]:
    with open(path) as handle:
        samples = [Sample(**json.loads(line)) for line in handle if line.strip()]
    for sample in samples:
        sample.turns = [(end, observation) for end, observation in sample.turns]  # JSON gives lists
    return samples
