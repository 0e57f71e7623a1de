"""The loss mask of multi-turn trajectories in the trainer: exactly the model's tokens are trained
(the gradient reaches every model position and no environment position), the gradient is the one
of a loss written by hand over the model tokens, the trained token ids are the logged ones (no
retokenization), and a single-turn batch trains exactly as before masks existed."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from rl.config import GRPOConfig, OptimConfig
from rl.distributed.protocol import batch_from_wire, batch_to_wire
from rl.rollout import Sample, read_samples, write_samples
from rl.streaming import train_batch
from rl.trainer import TrainBatch, Trainer, concat_batches
from tests.helpers import run_trainer, tiny_model


def model():
    return tiny_model()[0]


PAD, BOS = 0, 1


class Probe(Trainer):
    """A trainer that keeps each training forward's packed batch and logits (their gradient)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple] = []

    def _logprobs(self, model, packed):
        logprobs, logits = super()._logprobs(model, packed)
        if logits.requires_grad:
            logits.retain_grad()
            self.seen.append((packed, logits))
        return logprobs, logits


def segments(rng: random.Random, pattern: list[tuple[int, int]]) -> tuple[list[int], list[int], list[float]]:
    """A response of (source, length) segments, 1 = model, 0 = environment: ids, mask, logprobs."""
    ids, mask, logprobs = [], [], []
    for source, length in pattern:
        ids += [rng.randrange(4, 100) for _ in range(length)]
        mask += [source] * length
        logprobs += [-4.0 + rng.uniform(-1, 1) if source else 0.0 for _ in range(length)]
    return ids, mask, logprobs


def trajectories(seed: int = 0) -> list[Sample]:
    """Trajectories of 1-3 turns, a single-turn response (no mask) among them."""
    rng = random.Random(seed)
    patterns = [[(1, 5), (0, 3), (1, 4), (0, 2), (1, 2)], [(1, 6)], [(1, 3), (0, 4), (1, 1)], [(1, 2), (0, 1), (1, 5)]]
    samples = []
    for index, pattern in enumerate(patterns):
        ids, mask, logprobs = segments(rng, pattern)
        prompt = [BOS] + [rng.randrange(4, 100) for _ in range(rng.randint(2, 6))]
        turns, at = [], 0
        for (source, length), (_, following) in zip(pattern, [*pattern[1:], (1, 0)]):
            at += length
            if source and following and at < len(ids):
                turns.append((at, "obs"))
        samples.append(
            Sample(
                f"1/0/{index}",
                0,
                prompt,
                ids,
                logprobs,
                "stop",
                0,
                loss_mask=mask if not all(mask) else [],
                turns=turns,
            )
        )
    return samples


ADVANTAGES = [1.25, -0.75, 0.5, -1.5]


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_the_gradient_reaches_every_model_token_and_no_environment_token(aggregation):
    grpo = GRPOConfig(aggregation=aggregation, kl_coef=0.05)
    trainer = run_trainer(model(), PAD, grpo, OptimConfig(micro_batch_size=2))
    probe = Probe(
        trainer.model, PAD, grpo, OptimConfig(micro_batch_size=2), temperature=1.0, gradient_checkpointing=False
    )
    samples = trajectories()
    probe.train_step(train_batch(samples, ADVANTAGES))
    rows = [s.trained() for s in samples]
    assert len(probe.seen) == 2  # two micro-batches of two
    for chunk, (packed, logits) in enumerate(probe.seen):
        reached = logits.grad.abs().sum(dim=-1) > 0  # [B, T]: the positions predicting each token
        for row in range(reached.shape[0]):
            mask = rows[2 * chunk + row]
            expected = mask + [0] * (reached.shape[1] - len(mask))
            assert reached[row].tolist() == [bool(m) for m in expected]
            assert packed.response_mask[row].tolist() == expected


def test_the_gradient_is_the_hand_written_loss_over_model_tokens():
    """At one update per step the ratio is 1, so a step's summed gradient is
    -sum_i A_i sum_{t: model token} grad log p(token t): computed here row by row, unpadded."""
    policy = model()
    reference = copy.deepcopy(policy)
    trainer = run_trainer(policy, PAD, GRPOConfig(), OptimConfig(micro_batch_size=3))
    samples = trajectories(seed=3)
    trainer.begin_step()
    trainer.accumulate(train_batch(samples, ADVANTAGES))
    loss = torch.zeros(())
    for sample, advantage in zip(samples, ADVANTAGES):
        ids = torch.tensor([sample.prompt_ids + sample.response_ids])
        logp = torch.log_softmax(reference(input_ids=ids).logits[0].float(), dim=-1)
        for t, (token, trained) in enumerate(zip(sample.response_ids, sample.trained())):
            if trained:
                loss = loss - advantage * logp[len(sample.prompt_ids) - 1 + t, token]
    loss.backward()
    got = dict(trainer.model.named_parameters())
    for name, parameter in reference.named_parameters():
        torch.testing.assert_close(got[name].grad, parameter.grad, rtol=1e-4, atol=1e-6, msg=name)
    trainer.abandon_step()


def test_the_trained_token_ids_are_the_logged_ones(tmp_path):
    """Through the rollout file and the batch: every position the trainer trains targets the
    token id that was logged there (nothing decodes and re-encodes a trajectory)."""
    samples = trajectories(seed=5)
    write_samples(tmp_path / "rollout.jsonl", samples)
    read = read_samples(tmp_path / "rollout.jsonl")
    assert read == samples
    probe = Probe(
        model(), PAD, GRPOConfig(), OptimConfig(micro_batch_size=4), temperature=1.0, gradient_checkpointing=False
    )
    probe.train_step(train_batch(read, ADVANTAGES))
    ((packed, _),) = probe.seen
    for row, sample in enumerate(samples):
        n = len(sample.response_ids)
        assert packed.targets[row, :n].tolist() == sample.response_ids
        trained = packed.response_mask[row].bool()
        assert packed.targets[row][trained].tolist() == [t for t, m in zip(sample.response_ids, sample.trained()) if m]


def test_single_turn_batches_train_exactly_as_before_masks():
    """Three steps of single-turn batches: built as before masks existed, through `train_batch`
    (samples without a loss mask), and with explicit all-ones masks: the same parameters, bit for bit."""
    rng = random.Random(11)
    steps = []
    for _ in range(3):
        samples = []
        for index in range(6):
            ids = [rng.randrange(4, 100) for _ in range(rng.randint(1, 7))]
            prompt = [BOS] + [rng.randrange(4, 100) for _ in range(3)]
            samples.append(Sample(f"0/{index // 3}/{index % 3}", index // 3, prompt, ids, [-3.0] * len(ids), "stop", 0))
        steps.append((samples, [rng.uniform(-1, 1) for _ in samples]))
    trainers = [run_trainer(model(), PAD, GRPOConfig(), OptimConfig(micro_batch_size=4)) for _ in range(3)]
    for samples, advantages in steps:
        before = TrainBatch(
            [s.prompt_ids for s in samples],
            [s.response_ids for s in samples],
            [s.logprobs for s in samples],
            advantages,
        )
        ones = TrainBatch(
            before.prompt_ids,
            before.response_ids,
            before.rollout_logprobs,
            advantages,
            [[1] * len(r) for r in before.response_ids],
        )
        metrics = [t.train_step(b) for t, b in zip(trainers, (before, train_batch(samples, advantages), ones))]
        for m in metrics:
            m.pop("peak_rss_mb")  # the process's, not the step's
        assert metrics[0] == metrics[1] == metrics[2]
    states = [t.model.state_dict() for t in trainers]
    for name, tensor in states[0].items():
        assert torch.equal(tensor, states[1][name]) and torch.equal(tensor, states[2][name]), name


def test_masks_travel_through_selection_concatenation_and_the_ranks_wire():
    samples = trajectories()
    batch = train_batch(samples, ADVANTAGES)
    assert batch.loss_masks[1] == [] and batch.mask(1) == [1] * 6
    assert batch_from_wire(batch_to_wire(batch)) == batch
    assert batch.select([2, 0]).loss_masks == [batch.loss_masks[2], batch.loss_masks[0]]
    plain = TrainBatch([[BOS, 5]], [[7, 8]], [[-1.0, -1.0]], [0.5])
    joined = concat_batches([plain, batch])
    assert joined.mask(0) == [1, 1] and joined.mask(1) == samples[0].loss_mask
    assert batch.trained_tokens(range(len(batch))) == sum(sum(s.trained()) for s in samples)
    with pytest.raises(ValueError, match="loss mask of 2"):
        TrainBatch([[BOS]], [[7, 8, 9]], [[-1.0] * 3], [0.5], [[1, 0]])
