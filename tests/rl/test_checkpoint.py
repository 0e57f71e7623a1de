"""Tests for rl/checkpoint.py: exact resume, atomicity, retention."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import rl.checkpoint as checkpoint
from rl.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from rl.config import DataConfig, GRPOConfig, OptimConfig, RolloutConfig
from rl.models import build_tiny_llama
from rl.prompt_source import PromptSource
from rl.rollout import build_requests, samples_from_results
from rl.scoring import score_samples
from rl.trainer import TrainBatch
from tests.helpers import hf_on_cpu, run_trainer, tiny_shape

SHAPE = tiny_shape()
ROLLOUT = RolloutConfig(prompts_per_step=2, group_size=4, max_new_tokens=4)
GRPO = GRPOConfig(kl_coef=0.05)
OPTIM = OptimConfig(lr=3e-3, warmup_steps=3, micro_batch_size=3)


def digit_reward(response: str, answer: str) -> float:
    """A deterministic shaped reward, so that an untrained model's groups carry signal."""
    return float(sum(ch.isdigit() for ch in response)) + 0.1 * len(response)


def build():
    model, tokenizer = build_tiny_llama(SHAPE, seed=0)
    trainer = run_trainer(model, tokenizer.pad_token_id, GRPO, OPTIM, temperature=ROLLOUT.temperature)
    engine = hf_on_cpu(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    return model, tokenizer, trainer, engine


def rl_step(trainer, engine, tokenizer, prompts: PromptSource, cursor: int) -> tuple[dict, int]:
    """One RL step; RNG-dependent (global torch, python and numpy RNGs) on purpose."""
    step = trainer.step + 1
    cursor += random.randrange(3)  # python RNG: skip some prompts
    records = prompts.take(cursor, ROLLOUT.prompts_per_step)
    requests = build_requests(tokenizer, records, step, ROLLOUT, run_seed=0)
    engine.policy_version = trainer.step
    samples = samples_from_results(requests, engine.generate(requests), trainer.step)
    scores = score_samples(samples, records, tokenizer, digit_reward, digit_reward, ROLLOUT.group_size, GRPO)
    noise = np.random.uniform(-0.1, 0.1, len(samples))  # numpy RNG
    keep = torch.randperm(len(samples))[:6].tolist()  # torch RNG: a random subset
    batch = TrainBatch(
        [samples[i].prompt_ids for i in keep],
        [samples[i].response_ids for i in keep],
        [samples[i].logprobs for i in keep],
        [scores.advantages[i] + float(noise[i]) for i in keep],
    )
    metrics = trainer.train_step(batch)
    return metrics, cursor + ROLLOUT.prompts_per_step


def _training(metrics: dict) -> dict:
    """A step's training figures: its metrics less `peak_rss_mb`, a measurement of the process (which
    grows with whatever else the process has run, not with the step)."""
    return {k: v for k, v in metrics.items() if k != "peak_rss_mb"}


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    prompts = PromptSource(DataConfig(seed=2))

    model, tokenizer, trainer, engine = build()
    seed_everything(123)
    cursor, straight = 0, []
    for _ in range(4):
        metrics, cursor = rl_step(trainer, engine, tokenizer, prompts, cursor)
        straight.append(metrics)
    final_straight = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert any(m["loss"] != 0 for m in straight)

    model, tokenizer, trainer, engine = build()
    seed_everything(123)
    cursor, first = 0, []
    for _ in range(2):
        metrics, cursor = rl_step(trainer, engine, tokenizer, prompts, cursor)
        first.append(metrics)
    assert [_training(m) for m in first] == [_training(m) for m in straight[:2]]
    path = save_checkpoint(tmp_path / "ckpt", trainer, {"cursor": cursor}, keep=2)
    assert path.name == "step_000002" and latest_checkpoint(tmp_path / "ckpt") == path
    del model, trainer, engine

    # A new process: fresh model at the base init, RNG anywhere.
    seed_everything(999)
    model, tokenizer, trainer, engine = build()
    user = load_checkpoint(latest_checkpoint(tmp_path / "ckpt"), trainer)
    assert trainer.step == 2 and user == {"cursor": cursor}
    cursor, resumed = user["cursor"], []
    for _ in range(2):
        metrics, cursor = rl_step(trainer, engine, tokenizer, prompts, cursor)
        resumed.append(metrics)
    for got, want in zip(resumed, straight[2:]):
        assert got.keys() == want.keys()
        for key in _training(want):
            assert got[key] == pytest.approx(want[key], rel=0, abs=1e-6), key
    assert resumed[-1]["kl"] > 0  # the reference (the base init) was rebuilt, the policy moved
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, final_straight[name], rtol=0, atol=1e-6, msg=name)


def test_checkpoint_holds_weights_optimizer_scheduler_and_rng(tmp_path):
    model, tokenizer, trainer, engine = build()
    seed_everything(5)
    rl_step(trainer, engine, tokenizer, PromptSource(DataConfig()), 0)
    path = save_checkpoint(tmp_path, trainer, {"x": [1, 2]})
    expected = torch.rand(3), random.random(), np.random.rand()
    torch.rand(10), random.random(), np.random.rand()  # move every RNG on

    _, _, other, _ = build()
    assert load_checkpoint(path, other) == {"x": [1, 2]}
    got = torch.rand(3), random.random(), np.random.rand()
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]
    assert other.step == 1
    assert other.scheduler.state_dict()["last_epoch"] == 1
    assert other.optimizer.param_groups[0]["lr"] == trainer.optimizer.param_groups[0]["lr"]
    for p, q in zip(other.model.parameters(), model.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(other.optimizer.state[p]["exp_avg"], trainer.optimizer.state[q]["exp_avg"])
    # The weights file loads on its own.
    from safetensors.torch import load_file

    assert set(load_file(str(path / "model.safetensors"))) == set(model.state_dict())


@pytest.fixture
def small_trainer():
    model, tokenizer = build_tiny_llama(SHAPE, seed=0)
    return run_trainer(model, tokenizer.pad_token_id, GRPOConfig(), OptimConfig())


def test_latest_checkpoint_none_on_empty_or_missing_dir(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "missing") is None


def test_leftover_tmp_dir_is_ignored_and_cleaned(tmp_path, small_trainer):
    small_trainer.step = 1
    first = save_checkpoint(tmp_path, small_trainer, {"n": 1})
    partial = tmp_path / ".step_000002.tmp"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half a file")
    assert latest_checkpoint(tmp_path) == first
    small_trainer.step = 2
    second = save_checkpoint(tmp_path, small_trainer, {"n": 2})
    assert latest_checkpoint(tmp_path) == second
    assert not partial.exists()
    assert load_checkpoint(second, small_trainer) == {"n": 2}


def test_crash_before_the_pointer_update_keeps_the_previous(tmp_path, small_trainer, monkeypatch):
    small_trainer.step = 1
    first = save_checkpoint(tmp_path, small_trainer, {"n": 1})

    def crash(*args, **kwargs):
        raise OSError("killed")

    monkeypatch.setattr(checkpoint.os, "replace", crash)
    small_trainer.step = 2
    with pytest.raises(OSError, match="killed"):
        save_checkpoint(tmp_path, small_trainer, {"n": 2})
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path) == first
    assert load_checkpoint(latest_checkpoint(tmp_path), small_trainer) == {"n": 1}
    assert small_trainer.step == 1


def test_crash_while_writing_leaves_no_partial_checkpoint(tmp_path, small_trainer, monkeypatch):
    small_trainer.step = 1
    first = save_checkpoint(tmp_path, small_trainer, {"n": 1})

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.torch, "save", crash)
    small_trainer.step = 2
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, small_trainer, {"n": 2})
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path) == first
    assert not (tmp_path / "step_000002").exists()


def test_crash_while_resaving_the_latest_step_keeps_a_complete_checkpoint(tmp_path, small_trainer, monkeypatch):
    """Saving the step `latest` already names (e.g. "after the last step" right after a resume)."""
    for step in (1, 2):
        small_trainer.step = step
        save_checkpoint(tmp_path, small_trainer, {"n": step})
    real_rename = type(tmp_path).rename

    def crash(self, target):
        raise OSError("killed")

    monkeypatch.setattr(type(tmp_path), "rename", crash)
    with pytest.raises(OSError, match="killed"):
        save_checkpoint(tmp_path, small_trainer, {"n": 22})
    monkeypatch.setattr(type(tmp_path), "rename", real_rename)
    found = latest_checkpoint(tmp_path)
    assert found is not None, "a crash mid-save lost every checkpoint"
    assert load_checkpoint(found, small_trainer)["n"] in (1, 2)


def test_keep_retention(tmp_path, small_trainer):
    for step in range(1, 6):
        small_trainer.step = step
        save_checkpoint(tmp_path, small_trainer, {"n": step}, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000004", "step_000005"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000005"
    small_trainer.step = 6
    save_checkpoint(tmp_path, small_trainer, {"n": 6}, keep=1)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000006"]


def test_retention_never_deletes_the_checkpoint_just_written(tmp_path, small_trainer):
    """A run resumed from step 4 re-reaches steps that an abandoned attempt had written (step 6,
    whose `latest` update was lost): the new checkpoint must survive retention, and the stale
    one from the abandoned attempt goes."""
    import shutil

    small_trainer.step = 4
    save_checkpoint(tmp_path, small_trainer, {"n": 4}, keep=1)
    shutil.copytree(tmp_path / "step_000004", tmp_path / "step_000006")  # the orphan
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000004"
    small_trainer.step = 5
    written = save_checkpoint(tmp_path, small_trainer, {"n": 5}, keep=1)
    assert latest_checkpoint(tmp_path) == written
    assert load_checkpoint(written, small_trainer) == {"n": 5}
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000005"]


def test_dangling_pointer_falls_back_to_an_older_complete_checkpoint(tmp_path, small_trainer):
    import shutil

    for step in (3, 4):
        small_trainer.step = step
        save_checkpoint(tmp_path, small_trainer, {"n": step}, keep=5)
    shutil.copytree(tmp_path / "step_000004", tmp_path / "step_000006")  # never committed
    shutil.rmtree(tmp_path / "step_000004")
    assert (tmp_path / "latest").read_text() == "step_000004"
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000003"


def _truncate(path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize("damaged", ["trainer.pt", "model.safetensors"])
def test_a_truncated_latest_checkpoint_falls_back_to_the_previous_with_a_warning(
    tmp_path, small_trainer, caplog, damaged
):
    small_trainer.step = 1
    first = save_checkpoint(tmp_path, small_trainer, {"n": 1})
    small_trainer.step = 2
    second = save_checkpoint(tmp_path, small_trainer, {"n": 2})
    _truncate(second / damaged)
    with caplog.at_level("WARNING", logger="rl.checkpoint"):
        assert latest_checkpoint(tmp_path) == first
    assert str(second / damaged) in caplog.text and "truncated" in caplog.text
    assert load_checkpoint(first, small_trainer) == {"n": 1}


def test_a_truncated_only_checkpoint_is_refused_naming_the_file(tmp_path, small_trainer):
    small_trainer.step = 1
    only = save_checkpoint(tmp_path, small_trainer, {"n": 1})
    _truncate(only / "model.safetensors", keep=0.9)
    with pytest.raises(checkpoint.CorruptCheckpoint, match=rf"{only / 'model.safetensors'} is truncated: \d+ bytes"):
        latest_checkpoint(tmp_path)


FULL_DISK = """
import json, sys
from pathlib import Path
from rl.checkpoint import OutOfSpace, latest_checkpoint, load_checkpoint, save_checkpoint
from rl.config import GRPOConfig, OptimConfig, RolloutConfig, TrainerConfig
from rl.models import TinyLlamaShape, build_tiny_llama
from rl.trainer import Trainer

root = Path(sys.argv[1]) / "checkpoints"
model, tokenizer = build_tiny_llama(TinyLlamaShape(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128), seed=0)
trainer = Trainer(model, tokenizer.pad_token_id, GRPOConfig(), OptimConfig(), temperature=RolloutConfig().temperature,
                  gradient_checkpointing=TrainerConfig().gradient_checkpointing)
trainer.step = 1
save_checkpoint(root, trainer, {"n": 1}, keep=2)
trainer.step = 2
try:
    save_checkpoint(root, trainer, {"n": 2}, keep=2)
    error = None
except OutOfSpace as exc:
    error = str(exc)
found = latest_checkpoint(root)
print(json.dumps({"error": error, "left": sorted(p.name for p in root.iterdir()), "latest": found.name,
                  "user": load_checkpoint(found, trainer)}))
"""


@pytest.mark.integration
def test_a_full_disk_names_the_path_and_free_space_and_keeps_the_previous_checkpoint(tmp_path, small_trainer):
    """On a file system with room for one checkpoint (a tmpfs in a private mount namespace), the
    second fails with OutOfSpace, not torch's "unexpected pos"; nothing partial is left."""
    import json
    import subprocess
    import sys

    from tests.helpers import on_a_small_disk

    small_trainer.step = 1
    size = sum(f.stat().st_size for f in save_checkpoint(tmp_path / "probe", small_trainer, {}).rglob("*"))
    disk = tmp_path / "disk"
    done = subprocess.run(
        on_a_small_disk(disk, str(int(size * 1.5)), [sys.executable, "-c", FULL_DISK, str(disk)]),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["error"] is not None
    assert f"no space left on the device for the checkpoint of step 2 in {disk / 'checkpoints'}" in result["error"]
    assert "free of" in result["error"] and f"{disk / 'checkpoints' / 'step_000001'}, stays valid" in result["error"]
    assert result["left"] == ["latest", "step_000001"], "no partial checkpoint is left"
    assert (result["latest"], result["user"]) == ("step_000001", {"n": 1})
