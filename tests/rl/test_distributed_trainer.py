"""The DeepSpeed trainer (rl/distributed/) against the torch trainer, with real ranks under torchrun:
the same update on 2 ranks for every ZeRO stage (full fine-tuning and LoRA adapters, no extension
compiled on the way), exact resume from sharded checkpoints, clear refusals of checkpoints it
cannot resume, a dropped step, and what happens when a rank or the training process is killed."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from rl.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from rl.config import GRPOConfig, LoraSettings, OptimConfig, TrainerConfig
from rl.distributed.group import RankFailure
from rl.distributed.protocol import TrainSpec
from rl.distributed.rank import deepspeed_config
from rl.distributed.trainer import DistributedTrainer, check_supported
from rl.lora import read_adapter
from rl.models import load_model
from rl.trainer import CheckpointMismatch, TrainBatch, Trainer, check_lora_matches
from tests.helpers import cmdline, parent_pid, run_trainer, save_tiny_model, tiny_shape

pytestmark = pytest.mark.integration

GRPO = GRPOConfig(kl_coef=0.05)
LORA = LoraSettings(r=4, alpha=8.0)
OPTIM = OptimConfig(lr=1e-3, micro_batch_size=3, warmup_steps=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(
        tmp_path_factory.mktemp("ds") / "base",
        tiny_shape(),
    )


def random_batch(size: int = 11, seed: int = 0) -> TrainBatch:
    rng = random.Random(seed)
    prompts, responses, logprobs, advantages = [], [], [], []
    for i in range(size):
        prompts.append([1] + [rng.randrange(4, 90) for _ in range(rng.randint(2, 12))])
        length = 0 if i == 4 else rng.randint(1, 9)  # one empty response, lengths that differ a lot
        responses.append([rng.randrange(4, 90) for _ in range(length)])
        logprobs.append([-4.5 + rng.uniform(-0.3, 0.3) for _ in range(length)])
        advantages.append(rng.uniform(-1.5, 1.5))
    return TrainBatch(prompts, responses, logprobs, advantages)


def pieces(batch: TrainBatch, cut: int) -> list[TrainBatch]:
    """`batch` as two streamed pieces."""
    parts = (slice(0, cut), slice(cut, len(batch)))
    return [
        TrainBatch(batch.prompt_ids[s], batch.response_ids[s], batch.rollout_logprobs[s], batch.advantages[s])
        for s in parts
    ]


def ranks(
    model_dir: Path,
    tmp_path: Path,
    world_size: int = 2,
    zero_stage: int = 2,
    grpo: GRPOConfig = GRPO,
    optim: OptimConfig = OPTIM,
    lora: LoraSettings | None = None,
    autocast: str | None = None,
    environment: dict[str, str] | None = None,
) -> DistributedTrainer:
    tokenizer = load_model(model_dir)[1]
    spec = TrainSpec(
        model_path=model_dir,
        device="cpu",
        pad_token_id=tokenizer.pad_token_id,
        temperature=1.0,
        grpo=grpo,
        optim=optim,
        trainer=TrainerConfig(backend="deepspeed", world_size=world_size, zero_stage=zero_stage, threads_per_rank=1),
        lora=lora,
        autocast=autocast,
    )
    return DistributedTrainer(spec, tmp_path / "ranks.log", environment=environment)


def torch_trainer(model_dir: Path, grpo: GRPOConfig = GRPO, lora: LoraSettings | None = None) -> Trainer:
    model, tokenizer = load_model(model_dir)
    return run_trainer(model, tokenizer.pad_token_id, grpo, OPTIM, lora=lora)


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def extensions(tmp_path_factory) -> Path:
    """Where a rank would JIT-build DeepSpeed's ops: one directory for the module's ZeRO stages (the
    same environment: their torchrun agents fork from one template), which each checks is not there."""
    return tmp_path_factory.mktemp("ds-ops") / "torch-extensions"


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_two_ranks_take_the_torch_trainers_step(model_dir, tmp_path, zero_stage, extensions):
    reference = torch_trainer(model_dir)
    want = reference.train_step(random_batch(seed=0))
    distributed = ranks(
        model_dir, tmp_path, zero_stage=zero_stage, environment={"TORCH_EXTENSIONS_DIR": str(extensions)}
    )
    try:
        # Streamed in two pieces of different sizes; the ranks split each by tokens.
        distributed.begin_step()
        for piece in pieces(random_batch(seed=0), 7):
            distributed.accumulate(piece)
        got = distributed.finish_step()
        assert distributed.step == reference.step == 1
        assert max_difference(distributed.policy_state(), reference.policy_state()) <= 1e-5
        for key in ("loss", "kl", "entropy", "grad_norm", "lr", "response_tokens", "rollout_logprob_gap"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
        assert not extensions.exists(), "a rank compiled an extension (DeepSpeed's shared-memory op)"
        agent = distributed.group.process
        assert agent is not None and b"rl.distributed.agent" in cmdline(agent.pid)
        template = parent_pid(agent.pid)  # the agent forks from this process's agent template
        assert template != os.getpid() and b"rl.warm_fork.template" in cmdline(template)
        assert AGENT_TEMPLATES.setdefault("extensions", template) == template, "each stage forks from the same one"
    finally:
        distributed.close()


AGENT_TEMPLATES: dict[str, int] = {}
"""The agent template of the ZeRO stages' groups (one environment: one template)."""


def masked(batch: TrainBatch) -> TrainBatch:
    """`batch` as trajectories: every third response token an environment token (loss mask 0)."""
    masks = [[0 if t % 3 == 1 else 1 for t in range(len(r))] for r in batch.response_ids]
    logprobs = [[lp if m else 0.0 for lp, m in zip(lps, mask)] for lps, mask in zip(batch.rollout_logprobs, masks)]
    return TrainBatch(batch.prompt_ids, batch.response_ids, logprobs, batch.advantages, masks)


def test_two_ranks_train_a_trajectorys_model_tokens_only(model_dir, tmp_path):
    """The loss masks reach the ranks: their step on trajectories is the torch trainer's."""
    reference = torch_trainer(model_dir)
    want = reference.train_step(masked(random_batch(seed=2)))
    distributed = ranks(model_dir, tmp_path)
    try:
        got = distributed.train_step(masked(random_batch(seed=2)))
        assert max_difference(distributed.policy_state(), reference.policy_state()) <= 1e-5
        for key in ("loss", "entropy", "grad_norm", "response_tokens", "rollout_logprob_gap"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    finally:
        distributed.close()


def update_gap(after: dict[str, torch.Tensor], want: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> float:
    """|update - wanted update| / |wanted update| over every parameter."""
    num = sum(float(((after[k].float() - want[k].float()) ** 2).sum()) for k in want)
    den = sum(float(((want[k].float() - before[k].float()) ** 2).sum()) for k in want)
    return (num / den) ** 0.5


def test_a_bf16_rank_takes_the_torch_trainers_bf16_step(model_dir, tmp_path):
    """With `model.dtype: bf16` the ranks train under bf16 autocast as the torch trainer does. On a
    GPU, DeepSpeed's engine switches a CUDA autocast off inside its forward unless its configuration
    has a `torch_autocast` section (found on an H200: the ranks' "bf16" step was the fp32 step);
    a CPU autocast passes through, so here DeepSpeed's own reading of the configuration is checked."""
    from deepspeed.runtime.config import DeepSpeedConfig

    for autocast, enabled in (("bf16", True), (None, False)):
        config = DeepSpeedConfig(deepspeed_config(TrainerConfig(backend="deepspeed"), OPTIM, autocast))
        assert config.torch_autocast_enabled is enabled
        assert not enabled or config.torch_autocast_dtype == torch.bfloat16
    before = torch_trainer(model_dir).policy_state()
    fp32 = torch_trainer(model_dir)
    fp32.train_step(random_batch(seed=0))
    model, tokenizer = load_model(model_dir)
    bf16 = run_trainer(model, tokenizer.pad_token_id, GRPO, OPTIM, autocast_dtype=torch.bfloat16)
    bf16.train_step(random_batch(seed=0))
    spec_ranks = ranks(model_dir, tmp_path, world_size=1, autocast="bf16")
    try:
        spec_ranks.train_step(random_batch(seed=0))
        got = update_gap(spec_ranks.policy_state(), bf16.policy_state(), before)
    finally:
        spec_ranks.close()
    precision_gap = update_gap(fp32.policy_state(), bf16.policy_state(), before)
    assert got <= precision_gap / 4, (got, precision_gap)  # fp32 ranks: got ~= precision_gap


def test_two_ranks_run_the_decoupled_objective_like_the_torch_trainer(model_dir, tmp_path):
    grpo = GRPOConfig(kl_coef=0.05, objective="decoupled", tis_cap=1.2)
    batch = random_batch(seed=0)
    reference = torch_trainer(model_dir, grpo)
    want = reference.train_step(batch)
    assert 0 < want["is_truncated_fraction"] < 1 and want["is_weight_mean"] != 1.0
    distributed = ranks(model_dir, tmp_path, grpo=grpo)
    try:
        got = distributed.train_step(batch)
        assert max_difference(distributed.policy_state(), reference.policy_state()) <= 1e-5
        for key in ("loss", "policy_loss", "is_weight_mean", "is_truncated_fraction", "rollout_logprob_gap"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    finally:
        distributed.close()


def test_several_updates_per_step_are_refused_before_any_rank_starts(model_dir, tmp_path):
    optim = OPTIM.model_copy(update={"updates_per_step": 2})
    message = r"optim\.updates_per_step=2 is not supported with trainer\.backend: deepspeed"
    with pytest.raises(ValueError, match=message):
        check_supported(optim)
    with pytest.raises(ValueError, match=message):
        ranks(model_dir, tmp_path, optim=optim)
    assert not (tmp_path / "ranks.log").exists()
    check_supported(OPTIM)


def test_a_resumed_trainer_continues_exactly_and_refuses_what_it_cannot_resume(model_dir, tmp_path):
    root = tmp_path / "checkpoints"
    first = ranks(model_dir, tmp_path)
    try:
        for seed in (0, 1):
            first.train_step(random_batch(seed=seed))
        path = save_checkpoint(root, first, {"cursor": 2})
        for seed in (2, 3):
            first.train_step(random_batch(seed=seed))
        straight = {k: v.clone() for k, v in first.policy_state().items()}
    finally:
        first.close()
    assert (path / "model.safetensors").exists()
    assert sorted(p.name for p in (path / "deepspeed" / "state").glob("zero_pp_rank_*")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]

    resumed = ranks(model_dir, tmp_path)
    try:
        assert load_checkpoint(latest_checkpoint(root), resumed) == {"cursor": 2}
        assert resumed.step == 2
        for seed in (2, 3):
            resumed.train_step(random_batch(seed=seed))
        assert max_difference(resumed.policy_state(), straight) == 0.0

        # A dropped step changes nothing: the next step is the one a trainer that never saw it takes.
        before = {k: v.clone() for k, v in resumed.policy_state().items()}
        resumed.begin_step()
        resumed.accumulate(random_batch(seed=9))
        resumed.abandon_step()
        assert max_difference(resumed.policy_state(), before) == 0.0

        torch_side = torch_trainer(model_dir)
        with pytest.raises(CheckpointMismatch, match=r"trainer\.backend=deepspeed trainer\.world_size=2"):
            load_checkpoint(path, torch_side)
        torch_checkpoint = save_checkpoint(tmp_path / "torch-checkpoints", torch_side, {})
        with pytest.raises(CheckpointMismatch, match=r"written by the torch trainer"):
            load_checkpoint(torch_checkpoint, resumed)
        state = torch.load(path / "trainer.pt", weights_only=False)["trainer"]
        with pytest.raises(CheckpointMismatch, match=r"sharded over 3 ranks.*--set trainer\.world_size=3"):
            resumed.load_state(path, {**state, "world_size": 3})
        assert resumed.step == 4  # the refused checkpoint touched nothing
    finally:
        resumed.close()


def test_a_killed_rank_fails_the_step_naming_it_and_leaves_no_process(model_dir, tmp_path):
    distributed = ranks(model_dir, tmp_path)
    pids = dict(distributed.group.pids)
    launcher = distributed.group.process.pid
    try:
        distributed.train_step(random_batch(seed=0))
        distributed.begin_step()
        distributed.accumulate(random_batch(seed=1))
        os.kill(pids[1], signal.SIGKILL)  # mid-step: gradients accumulated, no optimizer step yet
        with pytest.raises(RankFailure, match=rf"rank 1 \(pid {pids[1]}\) killed by SIGKILL.*resume"):
            distributed.finish_step()
        with pytest.raises(RankFailure, match="rank 1"):  # failed for good
            distributed.policy_state()
    finally:
        distributed.close()
    assert not any(alive(pid) for pid in [*pids.values(), launcher])


def test_the_ranks_end_when_the_training_process_dies(model_dir, tmp_path):
    driver = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from pathlib import Path
        from tests.rl.test_distributed_trainer import ranks
        trainer = ranks(Path({str(model_dir)!r}), Path({str(tmp_path)!r}))
        print(trainer.group.process.pid, *trainer.group.pids.values(), flush=True)
        time.sleep(600)
        """
    )
    process = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in process.stdout.readline().split()]
        assert len(pids) == 3 and all(alive(p) for p in pids)
        process.kill()  # SIGKILL: nothing of the driver runs after this
        process.wait()
        deadline = time.monotonic() + 30
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(p) for p in pids), "a rank or torchrun outlived the training process"
    finally:
        process.kill()


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_two_ranks_take_the_torch_trainers_lora_steps(model_dir, tmp_path, zero_stage):
    reference = torch_trainer(model_dir, lora=LORA)
    want = [reference.train_step(random_batch(seed=seed)) for seed in (0, 1)]
    # Step 1 starts from B = 0 (the policy is the base: KL 0); step 2's KL is against the base.
    assert want[0]["kl"] == 0 and want[1]["kl"] > 1e-9
    distributed = ranks(model_dir, tmp_path, zero_stage=zero_stage, lora=LORA)
    try:
        distributed.begin_step()
        for piece in pieces(random_batch(seed=0), 7):  # streamed in two pieces
            distributed.accumulate(piece)
        got = [distributed.finish_step(), distributed.train_step(random_batch(seed=1))]
        state = distributed.policy_state()
        # The adapters alone, under PEFT's keys, as the torch trainer publishes them; B has moved.
        assert state.keys() == reference.policy_state().keys()
        assert state and all(".lora_A." in key or ".lora_B." in key for key in state)
        assert max(state[k].abs().max().item() for k in state if ".lora_B." in k) > 1e-4
        assert max_difference(state, reference.policy_state()) <= 1e-5
        for step in (0, 1):
            for key in ("loss", "kl", "entropy", "grad_norm", "lr", "response_tokens", "rollout_logprob_gap"):
                assert got[step][key] == pytest.approx(want[step][key], rel=1e-4, abs=1e-6), (step, key)
    finally:
        distributed.close()


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_a_lora_checkpoint_resumes_exactly_and_is_refused_by_another_kind_of_run(model_dir, tmp_path, zero_stage):
    root = tmp_path / "checkpoints"
    first = ranks(model_dir, tmp_path, zero_stage=zero_stage, lora=LORA)
    try:
        for seed in (0, 1):
            first.train_step(random_batch(seed=seed))
        path = save_checkpoint(root, first, {"cursor": 2})
        at_checkpoint = {k: v.clone() for k, v in first.policy_state().items()}
        for seed in (2, 3):
            first.train_step(random_batch(seed=seed))
        straight = {k: v.clone() for k, v in first.policy_state().items()}
    finally:
        first.close()
    # The policy is a PEFT adapter directory; DeepSpeed's own files leave the frozen base out

    assert not (path / "model.safetensors").exists()
    adapters, settings = read_adapter(path)
    assert settings.r == LORA.r and max_difference(adapters, at_checkpoint) == 0.0
    prefix = "zero_pp_rank_0_" if zero_stage == 3 else ""
    module = torch.load(path / "deepspeed" / "state" / f"{prefix}mp_rank_00_model_states.pt", weights_only=False)
    module = module["module"]
    # (DeepSpeed keeps a tied weight's second name: this tiny model ties lm_head to the embeddings.)
    frozen = {key for key in module if ".lora_A." not in key and ".lora_B." not in key}
    assert len(module) > len(frozen) and frozen <= {"base_model.model.lm_head.weight"}

    resumed = ranks(model_dir, tmp_path, zero_stage=zero_stage, lora=LORA)
    try:
        assert load_checkpoint(latest_checkpoint(root), resumed) == {"cursor": 2}
        assert resumed.step == 2 and max_difference(resumed.policy_state(), at_checkpoint) == 0.0
        for seed in (2, 3):
            resumed.train_step(random_batch(seed=seed))
        assert max_difference(resumed.policy_state(), straight) == 0.0
    finally:
        resumed.close()

    # Refused by the driver before any rank is sent anything (these trainers' ranks are gone).
    state = torch.load(path / "trainer.pt", weights_only=False)["trainer"]
    other_rank = LoraSettings(r=8, target_modules=("q_proj", "v_proj")).model_dump(mode="json")
    refusals = [
        (resumed, {**state, "lora": None}, r"holds a full fine-tuning run .* but this run has model\.lora set"),
        (
            resumed,
            {**state, "lora": other_rank},
            r"holds LoRA adapters of r=8 on q_proj, v_proj, this run's model\.lora is r=4",
        ),
    ]
    for trainer, saved, message in refusals:
        with pytest.raises(CheckpointMismatch, match=message) as refused:
            trainer.load_state(path, saved)
        assert "\n" not in str(refused.value)
    assert resumed.step == 4
    # A full fine-tuning run's trainer makes the same check with no model.lora (no ranks needed to see it).
    with pytest.raises(
        CheckpointMismatch, match=r"holds LoRA adapters \(model\.lora r=4\), but this run has no model\.lora"
    ):
        check_lora_matches(path, state, None)
