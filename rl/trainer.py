"""The GRPO trainer: a long-lived owner of the policy, its frozen reference and the optimizer.

`Trainer.train_step(batch)` is one RL step on scored responses (token ids, the engine's behaviour
log-probs, advantages); it knows nothing of rollout or orchestration. Its loss is
`rl.grpo.policy_loss` with `GRPOConfig.objective` (`auto` counts as `grpo`: the session resolves it)
against the proximal policy, the weights at the step's start. With `optim.updates_per_step: 1` the
proximal log-probs are the training forward's own, detached (no extra pass; the ratio is 1); with
U > 1 one no-grad forward gives them, then each of U mini-batches of whole groups (`mini_batches`)
is one clipped update. Micro-batches accumulate so the gradient equals the whole batch's. Streamed:
`begin_step`, `accumulate(piece)` per piece, `finish_step` (U > 1: pieces are kept and trained at
the end); `abandon_step` drops a step. Weights, gradients and AdamW stay fp32 (`autocast_dtype`:
bf16 passes; log-probs in fp32); metrics reach the host in one transfer per update. `PolicyTrainer`
is what the session, `rl.streaming` and `rl.checkpoint` use (also `rl.distributed`'s trainer).
Detail: docs/algorithm.md, docs/internals.md §9 ("One trainer interface").
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from rl.config import GRPOConfig, LoraSettings, OptimConfig
from rl.grpo import entropy_from_logits, objective_of, policy_loss, token_logprobs
from rl.lora import (
    ADAPTER_WEIGHTS_FILE,
    adapter_state,
    add_adapters,
    load_adapter_state,
    same_settings,
    save_adapter,
)
from rl.optimizer import adamw
from rl.process_memory import peak_rss_mb

LOSS_METRICS = ("loss", "policy_loss")
"""The metrics of `policy_loss` aggregated like the loss; the others are means over tokens."""

WEIGHTS_FILE = "model.safetensors"
"""The policy's weights in a checkpoint directory (loadable on their own)."""


@dataclass
class TrainBatch:
    """Scored responses of one RL step, as token ids (never decoded text)."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    rollout_logprobs: list[list[float]]
    """Per response token, the log-prob under the sampling distribution recorded by the engine."""
    advantages: list[float]
    loss_masks: list[list[int]] = field(default_factory=list)
    """Per response, 1 for each token trained and 0 for one that is not (a multi-turn trajectory's
    environment segments); empty (the whole field, or one response's): all ones."""

    def __post_init__(self) -> None:
        sizes = {len(self.prompt_ids), len(self.response_ids), len(self.rollout_logprobs), len(self.advantages)}
        if len(sizes) != 1:
            raise ValueError(f"TrainBatch fields disagree in length: {sorted(sizes)}")
        if self.loss_masks and len(self.loss_masks) != len(self.response_ids):
            raise ValueError(f"{len(self.loss_masks)} loss masks for {len(self.response_ids)} responses")
        for i, (prompt, resp, lps) in enumerate(zip(self.prompt_ids, self.response_ids, self.rollout_logprobs)):
            if not prompt:
                raise ValueError(
                    f"response {i}: empty prompt (the first response token needs a position to predict it)"
                )
            if len(resp) != len(lps):
                raise ValueError(f"response {i}: {len(resp)} tokens but {len(lps)} log-probs")
            if self.loss_masks and self.loss_masks[i] and len(self.loss_masks[i]) != len(resp):
                raise ValueError(f"response {i}: {len(resp)} tokens but a loss mask of {len(self.loss_masks[i])}")

    def __len__(self) -> int:
        return len(self.response_ids)

    def mask(self, i: int) -> list[int]:
        """Response `i`'s loss mask (all ones when it has none)."""
        mask = self.loss_masks[i] if self.loss_masks else []
        return mask or [1] * len(self.response_ids[i])

    def trained_tokens(self, rows: Sequence[int]) -> int:
        """The tokens of `rows` that are trained (their loss masks' ones)."""
        return sum(sum(self.mask(i)) for i in rows)

    def select(self, rows: Sequence[int]) -> TrainBatch:
        """The batch of `rows`, in that order."""
        return TrainBatch(
            [self.prompt_ids[i] for i in rows],
            [self.response_ids[i] for i in rows],
            [self.rollout_logprobs[i] for i in rows],
            [self.advantages[i] for i in rows],
            [self.loss_masks[i] for i in rows] if self.loss_masks else [],
        )


@dataclass
class Accumulation:
    """Running sums of the step in progress (see `Trainer.accumulate`): counts on the host,
    metric sums as float64 tensors where they were computed (read once, by `finish_step`)."""

    tokens: float = 0.0
    sequences: float = 0.0
    weight: float = 0.0
    """Divisor of the summed loss: `tokens` (token aggregation) or `sequences` (sequence)."""
    weighted: dict[str, Tensor] = field(default_factory=dict)
    """``loss`` and ``policy_loss`` times the weight of the micro-batch they were measured on."""
    per_token: dict[str, Tensor] = field(default_factory=dict)
    """The token-mean metrics (``kl``, ``clip_fraction``, ``ratio_mean``, ``is_weight_mean``,
    ``is_weight_deviation``, ``is_truncated_fraction``) times the micro-batch's tokens, and ``entropy`` and
    ``rollout_logprob_gap`` summed over response tokens: each divided by `tokens` at the end."""
    batches: int = 0
    pieces: list[TrainBatch] = field(default_factory=list)
    """With `optim.updates_per_step` > 1: the accumulated batches, trained by `finish_step`."""

    @staticmethod
    def add(sums: dict[str, Tensor], name: str, value: Tensor, scale: float = 1.0) -> None:
        """``sums[name] += value * scale`` in float64, without reading the 0-dim `value`."""
        value = value.detach().double() * scale
        sums[name] = sums[name] + value if name in sums else value


@dataclass
class _Packed:
    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    targets: Tensor
    """[B, T]: target token of each response position."""
    response_mask: Tensor


def _pack(prompts: list[list[int]], responses: list[list[int]], masks: list[list[int]], pad_id: int) -> _Packed:
    """Left-pad the prompts and right-pad the responses, so that every row's response starts in the
    same column: the logits of the last T_resp + 1 positions then predict every response token,
    and the model computes no others (its `logits_to_keep`). The response mask is each row's loss
    mask: an environment segment's tokens are context, never trained."""
    prompt_width = max(len(p) for p in prompts)
    resp_width = max(1, max(len(r) for r in responses))
    batch = len(prompts)
    input_ids = torch.full((batch, prompt_width + resp_width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, prompt_width + resp_width), dtype=torch.long)
    targets = torch.full((batch, resp_width), pad_id, dtype=torch.long)
    response_mask = torch.zeros((batch, resp_width))
    for i, (p, r, m) in enumerate(zip(prompts, responses, masks)):
        start = prompt_width - len(p)
        input_ids[i, start : prompt_width + len(r)] = torch.tensor(p + r)
        attention_mask[i, start : prompt_width + len(r)] = 1
        if r:
            targets[i, : len(r)] = torch.tensor(r)
            response_mask[i, : len(r)] = torch.tensor(m, dtype=response_mask.dtype)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    return _Packed(input_ids, attention_mask, position_ids, targets, response_mask)


def _to(packed: _Packed, device: torch.device) -> _Packed:
    return _Packed(*(getattr(packed, f.name).to(device) for f in fields(packed)))


def concat_batches(batches: Sequence[TrainBatch]) -> TrainBatch:
    """One batch of the samples of `batches`, in order."""
    masked = any(b.loss_masks for b in batches)
    return TrainBatch(
        [p for b in batches for p in b.prompt_ids],
        [r for b in batches for r in b.response_ids],
        [lp for b in batches for lp in b.rollout_logprobs],
        [a for b in batches for a in b.advantages],
        [b.mask(i) for b in batches for i in range(len(b))] if masked else [],
    )


def mini_batches(batch: TrainBatch, count: int) -> list[range]:
    """Split `batch` into min(`count`, len(batch)) consecutive, non-empty mini-batches.

    A group is a run of consecutive samples with the same prompt (how the rollout and
    `rl.streaming` order a step's samples). When the batch has at least as many groups as
    mini-batches, every mini-batch is made of whole groups, cut at the group boundary nearest to
    an equal share of samples; otherwise the samples are split into equal consecutive shares.
    Deterministic: it depends only on the batch's prompts and their order.
    """
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    size = len(batch)
    count = min(count, size)
    if count == 0:
        return []
    ends = [i for i in range(1, size) if batch.prompt_ids[i] != batch.prompt_ids[i - 1]] + [size]
    if len(ends) < count:
        cuts = [k * size // count for k in range(count + 1)]
        return [range(a, b) for a, b in zip(cuts, cuts[1:])]
    cuts, start = [0], 0
    for k in range(1, count):
        # A boundary after the previous cut that leaves one boundary for each remaining cut.
        options = ends[start : len(ends) - (count - k)]
        target = k * size / count
        best = min(range(len(options)), key=lambda j: (abs(options[j] - target), j))
        cuts.append(options[best])
        start += best + 1
    cuts.append(size)
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


class Trainer:
    def __init__(
        self,
        model: torch.nn.Module,
        pad_token_id: int,
        grpo: GRPOConfig,
        optim: OptimConfig,
        *,
        temperature: float,
        gradient_checkpointing: bool,
        autocast_dtype: torch.dtype | None = None,
        lora: LoraSettings | None = None,
    ) -> None:
        """`model` stays where it is (its device is the trainer's); `temperature` scores log-probs
        as the rollout sampled (`rollout.temperature`); `gradient_checkpointing`
        (`trainer.gradient_checkpointing`) recomputes activations in the backward pass (HF models);
        `autocast_dtype`: mixed precision (`model.dtype: bf16`); `lora` (`model.lora`): `model` is
        wrapped with adapters (`self.model` is the wrapped one) and only they are trained, their
        optimizer state kept and their tensors published; the KL reference is then the base, the
        same model with its adapters switched off."""
        self.lora = lora
        if lora is not None:
            model = add_adapters(model, lora)
        self.model = model
        if gradient_checkpointing:
            # An HF model's method; torch's `Module.__getattr__` types any attribute `Tensor | Module`:
            model.gradient_checkpointing_enable(  # pyright: ignore[reportCallIssue]
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        self.device = next(model.parameters()).device
        self.autocast_dtype = autocast_dtype
        self.pad_token_id = pad_token_id
        self.grpo = grpo
        self.optim_config = optim
        self.temperature = temperature
        self.reference = None
        """The frozen KL reference of full fine-tuning (with LoRA the base is the reference)."""
        if grpo.kl_coef > 0 and lora is None:
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = adamw(trainable, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / (optim.warmup_steps + 1))
        )
        self.step = 0
        self._pending: Accumulation | None = None

    def _response_logits(self, model: torch.nn.Module, packed: _Packed) -> Tensor:
        """Logits at the positions predicting each response token, in fp32: [B, T_resp, V]. Only
        those are computed: at a 49k vocabulary the prompt's logits would be most of the
        activations."""
        width = packed.targets.shape[1]
        with torch.autocast(
            self.device.type, dtype=self.autocast_dtype or torch.float32, enabled=self.autocast_dtype is not None
        ):
            logits = model(
                input_ids=packed.input_ids,
                attention_mask=packed.attention_mask,
                position_ids=packed.position_ids,
                use_cache=False,
                logits_to_keep=width + 1,
            ).logits
        return logits[:, :-1].float()

    def _logprobs(self, model: torch.nn.Module, packed: _Packed) -> tuple[Tensor, Tensor]:
        logits = self._response_logits(model, packed)
        return token_logprobs(logits, packed.targets, self.temperature), logits

    @torch.no_grad()
    def _reference_logprobs(self, packed: _Packed) -> Tensor | None:
        """The KL reference's log-probs (None without a KL term): the frozen copy, or with LoRA the
        policy's own base, its adapters switched off for this forward."""
        if self.grpo.kl_coef == 0:
            return None
        if self.reference is not None:
            return self._logprobs(self.reference, packed)[0]
        with self.adapted_module.disable_adapter():  # pyright: ignore[reportCallIssue]
            return self._logprobs(self.model, packed)[0]

    @property
    def adapted_module(self) -> torch.nn.Module:
        """The module that carries the policy's weights (the peft model with LoRA)."""
        return self.model

    @property
    def objective(self) -> str:
        """What `policy_loss` computes: `grpo.objective`, with `auto` counted as `grpo`."""
        return objective_of(self.grpo.objective)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One RL step on `batch` (`optim.updates_per_step` optimizer updates); returns averaged metrics."""
        if not len(batch):
            raise ValueError("empty TrainBatch")
        self.begin_step()
        self.accumulate(batch)
        return self.finish_step()

    # -- streaming: one RL step over batches that arrive one by one ---------------------------

    def begin_step(self) -> None:
        """Start accumulating the gradient of a step whose batches arrive piecewise (e.g. one
        complete group at a time while the rollout's tail is still generating)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._pending = Accumulation()

    @property
    def accumulating(self) -> bool:
        """Whether `begin_step` was called and `finish_step` not yet."""
        return self._pending is not None

    def accumulate(self, batch: TrainBatch) -> None:
        """Add `batch` to the step in progress.

        With one update per step, its loss gradient is accumulated now: each micro-batch
        backpropagates its loss *summed* over its tokens (token aggregation) or over its sequences
        (sequence aggregation); `finish_step` divides the gradient by the step's total count. The
        result equals the gradient of the loss over the union of every accumulated batch, whatever
        their number, sizes or order (up to float rounding). With `optim.updates_per_step` > 1 the
        batch is only kept: `finish_step` trains the step's mini-batches (see the module docstring).
        """
        acc = self._pending
        if acc is None:
            raise RuntimeError("accumulate() outside a step: call begin_step() first")
        acc.batches += 1
        if self.optim_config.updates_per_step > 1:
            acc.pieces.append(batch)
            return
        self.model.train()
        for chunk in self._micro_batches(range(len(batch))):
            self.accumulate_micro_batch(batch, chunk, acc)
        self.model.eval()

    @property
    def samples_per_accumulate(self) -> int:
        """How many samples an `accumulate` call takes at full efficiency (one micro-batch)."""
        return self.optim_config.micro_batch_size

    def _micro_batches(self, rows: range) -> list[range]:
        size = self.optim_config.micro_batch_size
        return [range(start, min(start + size, rows.stop)) for start in range(rows.start, rows.stop, size)]

    def _prepare(self, batch: TrainBatch, chunk: Sequence[int]) -> tuple[_Packed, Tensor, float, float] | None:
        """`batch[chunk]` packed on the device, with its behaviour log-probs, tokens and sequences
        (None when the chunk has no response token)."""
        prompts = [batch.prompt_ids[i] for i in chunk]
        responses = [batch.response_ids[i] for i in chunk]
        masks = [batch.mask(i) for i in chunk]
        tokens = float(sum(sum(m) for m in masks))
        if not tokens:
            return None
        sequences = float(sum(1 for m in masks if any(m)))
        packed = _pack(prompts, responses, masks, self.pad_token_id)
        behaviour_lp = torch.zeros_like(packed.response_mask)
        for row, i in enumerate(chunk):
            behaviour_lp[row, : len(batch.rollout_logprobs[i])] = torch.tensor(batch.rollout_logprobs[i])
        return _to(packed, self.device), behaviour_lp.to(self.device), tokens, sequences

    def proximal_logprobs(self, batch: TrainBatch, chunk: Sequence[int]) -> Tensor | None:
        """The current policy's log-probs of `batch[chunk]`'s response tokens, without gradient,
        packed exactly as `accumulate_micro_batch` packs the chunk (None: no response token)."""
        prepared = self._prepare(batch, chunk)
        if prepared is None:
            return None
        with torch.no_grad():
            return self._logprobs(self.model, prepared[0])[0]

    def accumulate_micro_batch(
        self,
        batch: TrainBatch,
        chunk: Sequence[int],
        acc: Accumulation,
        scale: float = 1.0,
        proximal: Tensor | None = None,
    ) -> bool:
        """Backpropagate the summed loss of `batch[chunk]` (times `scale`) and add its metrics to
        `acc` (unless `scale` is 0: a pass that only keeps collective operations in step, see
        `rl.distributed.rank`). `proximal`: the chunk's `proximal_logprobs`, taken before this
        step's first update; None means the current weights are the proximal policy (one update
        per step), whose log-probs are this forward's, detached. Returns False, doing nothing,
        when the chunk has no response token."""
        prepared = self._prepare(batch, chunk)
        if prepared is None:
            return False
        packed, behaviour_lp, tokens, sequences = prepared
        mask = packed.response_mask
        ref_lp = self._reference_logprobs(packed)
        logp, logits = self._logprobs(self.model, packed)
        proximal_lp = logp.detach() if proximal is None else proximal
        loss, metrics = policy_loss(
            logp,
            proximal_lp,
            torch.tensor([batch.advantages[i] for i in chunk], device=self.device),
            mask,
            behaviour_logp=behaviour_lp,
            objective=self.objective,
            tis_cap=self.grpo.tis_cap,
            clip_eps=self.grpo.clip_eps,
            clip_eps_high=self.grpo.clip_eps_high,
            kl_coef=self.grpo.kl_coef,
            ref_logp=ref_lp,
            aggregation=self.grpo.aggregation,
        )
        weight = tokens if self.grpo.aggregation == "token" else sequences
        self._backward(loss * (weight * scale))
        if scale == 0:
            return True
        acc.tokens += tokens
        acc.sequences += sequences
        acc.weight += weight
        for key, value in metrics.items():
            # The losses are means under the step's aggregation; the other metrics token means.
            if key in LOSS_METRICS:
                acc.add(acc.weighted, key, value, weight)
            else:
                acc.add(acc.per_token, key, value, tokens)
        with torch.no_grad():
            entropy = entropy_from_logits(logits.detach() / self.temperature)
            acc.add(acc.per_token, "entropy", (entropy * mask).sum())
            acc.add(acc.per_token, "rollout_logprob_gap", ((proximal_lp - behaviour_lp).abs() * mask).sum())
        return True

    def _backward(self, loss: Tensor) -> None:
        loss.backward()

    def finish_step(self) -> dict[str, float]:
        """Normalise the accumulated gradient, clip, step (U == 1), or train the collected pieces'
        U mini-batches (U > 1); returns the step's averaged metrics."""
        acc = self._pending
        if acc is None:
            raise RuntimeError("finish_step() outside a step: call begin_step() first")
        self._pending = None
        if self.optim_config.updates_per_step > 1:
            return self._finish_mini_batches(acc.pieces)
        if acc.tokens == 0:
            self.optimizer.zero_grad(set_to_none=True)
            raise ValueError("the step has no response tokens to train on")
        norm, weighted, per_token = self._update(acc, "")
        self.scheduler.step()
        self.step += 1
        return self._step_metrics(acc, weighted, per_token, [norm])

    def _update(self, acc: Accumulation, where: str) -> tuple[float, dict[str, float], dict[str, float]]:
        """One optimizer update on the gradient accumulated for `acc`: divide, clip, step. Returns
        the gradient norm and `acc`'s metric sums (weighted, per-token), read in one transfer."""
        for parameter in self.model.parameters():
            if parameter.grad is not None:
                parameter.grad.div_(acc.weight)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim_config.max_grad_norm)
        sums = [*acc.weighted.values(), *acc.per_token.values(), grad_norm.detach().double()]
        *values, norm = torch.stack(sums).tolist()  # the update's one read of the device
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"non-finite gradient norm at step {self.step}{where}; update skipped")
        self.optimizer.step()
        return norm, dict(zip(acc.weighted, values)), dict(zip(acc.per_token, values[len(acc.weighted) :]))

    def _step_metrics(
        self, acc: Accumulation, weighted: dict[str, float], per_token: dict[str, float], norms: list[float]
    ) -> dict[str, float]:
        """The step's metrics from its sums on the host (`weighted` over `acc.weight`, `per_token` over
        `acc.tokens`) and its updates' gradient norms."""
        self.model.eval()
        metrics = {key: value / acc.weight for key, value in weighted.items()}
        metrics.update((key, value / acc.tokens) for key, value in per_token.items())
        metrics.update(
            grad_norm=sum(norms) / len(norms),
            lr=self.optimizer.param_groups[0]["lr"],
            response_tokens=acc.tokens,
            peak_rss_mb=peak_rss_mb(),
        )
        return metrics

    def _finish_mini_batches(self, pieces: list[TrainBatch]) -> dict[str, float]:
        """U > 1: the proximal forward over the whole step, then one update per mini-batch."""
        self.optimizer.zero_grad(set_to_none=True)
        batch = concat_batches(pieces)
        if not batch.trained_tokens(range(len(batch))):
            raise ValueError("the step has no response tokens to train on")
        plan = [self._micro_batches(rows) for rows in mini_batches(batch, self.optim_config.updates_per_step)]
        self.model.train()  # the mode of the training forward, so the first update's ratio is exactly 1
        proximal = [[self.proximal_logprobs(batch, chunk) for chunk in chunks] for chunks in plan]
        total = Accumulation()  # the step's counts; its metric sums, read to the host, are these:
        weighted: dict[str, float] = {}
        per_token: dict[str, float] = {}
        norms: list[float] = []
        for index, (chunks, proximals) in enumerate(zip(plan, proximal)):
            self.optimizer.zero_grad(set_to_none=True)
            acc = Accumulation()
            for chunk, proximal_lp in zip(chunks, proximals):
                if proximal_lp is not None:
                    self.accumulate_micro_batch(batch, chunk, acc, proximal=proximal_lp)
            if not acc.tokens:
                continue  # a mini-batch of empty responses: nothing to update on
            where = f" (update {index + 1} of {len(plan)}; {len(norms)} applied)"
            norm, update_weighted, update_per_token = self._update(acc, where)
            norms.append(norm)
            total.tokens += acc.tokens
            total.sequences += acc.sequences
            total.weight += acc.weight
            for sums, update in ((weighted, update_weighted), (per_token, update_per_token)):
                for key, value in update.items():
                    sums[key] = sums.get(key, 0.0) + value
        self.scheduler.step()
        self.step += 1
        return self._step_metrics(total, weighted, per_token, norms)

    def abandon_step(self) -> None:
        """Drop an accumulated, unfinished step (the policy is unchanged)."""
        self._pending = None
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        return {
            "model": self.policy_state(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
        }

    def load_state_dict(self, state: dict) -> None:
        if self.lora is not None:
            load_adapter_state(self.adapted_module, state["model"])
        else:
            self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]

    # -- what the training session needs of any trainer (this one, or `rl.distributed`'s) ------

    def policy_state(self) -> dict[str, Tensor]:
        """The policy at version `step`, to publish and to load into engines: every weight, or with
        LoRA the adapter tensors alone (`rl.lora.adapter_state`)."""
        if self.lora is not None:
            return adapter_state(self.adapted_module)
        return self.model.state_dict()

    def save_state(self, directory: Path) -> dict:
        """Write the policy to `directory/model.safetensors` (with LoRA: the adapters, as a PEFT
        adapter directory); returns the rest of the trainer's state (optimizer, scheduler, step)
        for `rl.checkpoint` to store."""
        state = self.state_dict()
        write_policy(directory, state.pop("model"), self.lora)
        return {"backend": "torch", "lora": lora_record(self.lora), **state}

    def load_state(self, directory: Path, state: dict) -> None:
        """Restore what `save_state` wrote (`state` is what it returned)."""
        backend = state.get("backend", "torch")
        if backend != "torch":
            raise CheckpointMismatch(
                f"checkpoint {directory} was written by the {backend} trainer "
                f"({state.get('world_size')} ranks, ZeRO-{state.get('zero_stage')}); this run has "
                f"trainer.backend: torch. Resume it with trainer.backend={backend} "
                f"trainer.world_size={state.get('world_size')}, or start a new run"
            )
        check_lora_matches(directory, state, self.lora)
        self.load_state_dict({**state, "model": read_policy(directory, self.lora)})

    def close(self) -> None:
        """Nothing to free: the trainer lives in this process."""


class PolicyTrainer(Protocol):
    """What the training session, `rl.streaming` and `rl.checkpoint` use of a trainer: this
    module's `Trainer`, or `rl.distributed.trainer.DistributedTrainer` (DeepSpeed ranks)."""

    step: int
    optim_config: OptimConfig

    @property
    def samples_per_accumulate(self) -> int: ...
    @property
    def accumulating(self) -> bool: ...
    @property
    def objective(self) -> str: ...
    def train_step(self, batch: TrainBatch) -> dict[str, float]: ...
    def begin_step(self) -> None: ...
    def accumulate(self, batch: TrainBatch) -> None: ...
    def finish_step(self) -> dict[str, float]: ...
    def abandon_step(self) -> None: ...
    def policy_state(self) -> dict[str, Tensor]: ...
    def save_state(self, directory: Path) -> dict: ...
    def load_state(self, directory: Path, state: dict) -> None: ...
    def close(self) -> None: ...


class CheckpointMismatch(ValueError):
    """A checkpoint this trainer cannot resume from (another backend or world size, LoRA against
    full fine-tuning); the message says what to do."""


def lora_record(lora: LoraSettings | None) -> dict | None:
    """What a checkpoint records of the run's `model.lora` (None: full fine-tuning)."""
    return None if lora is None else lora.model_dump(mode="json")


def check_lora_matches(directory: Path, state: dict, lora: LoraSettings | None) -> None:
    """`CheckpointMismatch` unless the checkpoint at `directory` (its trainer `state`) was written by
    a run of the same kind: full fine-tuning, or LoRA adapters of the same rank and targets."""
    saved = state.get("lora")
    saved_lora = None if saved is None else LoraSettings.model_validate(saved)
    if saved_lora is None and lora is None:
        return
    if saved_lora is None:
        raise CheckpointMismatch(
            f"checkpoint {directory} holds a full fine-tuning run (every weight), but this run has model.lora "
            "set: resume it without model.lora, or start a new run (another run.name) to train adapters"
        )
    if lora is None:
        raise CheckpointMismatch(
            f"checkpoint {directory} holds LoRA adapters (model.lora r={saved_lora.r}), but this run has no "
            "model.lora: resume it with the same model.lora, or start a new run (another run.name)"
        )
    if not same_settings(saved_lora, lora):
        raise CheckpointMismatch(
            f"checkpoint {directory} holds LoRA adapters of r={saved_lora.r} on {', '.join(saved_lora.target_modules)}, "
            f"this run's model.lora is r={lora.r} on {', '.join(lora.target_modules)}: resume it with the "
            "checkpoint's model.lora, or start a new run (another run.name)"
        )


def write_policy(directory: Path, policy: dict[str, Tensor], lora: LoraSettings | None) -> None:
    """Write a checkpoint's policy: `model.safetensors`, or with LoRA a PEFT adapter directory."""
    if lora is not None:
        save_adapter(directory, policy, lora, base=None)
        return
    save_file({k: v.detach().to("cpu").contiguous().clone() for k, v in policy.items()}, str(directory / WEIGHTS_FILE))


def read_policy(directory: Path, lora: LoraSettings | None) -> dict[str, Tensor]:
    """The policy `write_policy` wrote in `directory`."""
    return load_file(str(directory / (ADAPTER_WEIGHTS_FILE if lora is not None else WEIGHTS_FILE)))
