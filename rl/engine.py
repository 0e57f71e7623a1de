"""Token generation: one streaming interface for every rollout backend, and the HF/torch backend.

The types every backend speaks and the abstract `GenerationEngine` are in `rl.generation`
(torch-free); this module owns
`HFEngine`, the backend for any transformers causal LM with a full-attention `DynamicCache`:
batched decoding with a KV cache and continuous admission. It draws every token with the keyed
sampler of `rl.sampling` (shared with `rl.vllm_engine`), so a sample released at any position
resumes on another engine, of either backend, as if never interrupted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import CacheLayerMixin

from rl.generation import (
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationEngine,
    GenerationRequest,
    TokenChunk,
)
from rl.lora import is_adapted, load_adapter_state
from rl.sampling import keyed_sample, sample_key


@dataclass(eq=False)
class _Live:
    """A request between add() and its final chunk."""

    request: GenerationRequest
    response: list[int]
    stop_ids: frozenset[int]
    key: int

    def finish_reason(self) -> str | None:
        if self.response and self.response[-1] in self.stop_ids:
            return FINISH_STOP
        if len(self.response) >= self.request.max_new_tokens:
            return FINISH_LENGTH
        return None


class HFEngine(GenerationEngine):
    """`GenerationEngine` on a transformers causal LM, batched with a KV cache.

    Running rows share one left-padded `DynamicCache` plus a 0/1 attention mask; every forward
    gets explicit `attention_mask` and `position_ids` (positions count real tokens only). A row's
    cache holds its prompt and response except the last sampled token, which the next step feeds.

    Continuous admission: each step first decodes the running rows by one token, then prefills
    the newcomers (FIFO, up to `max_batch_size` rows in all) as their own left-padded batch and
    merges the two caches by left-padding the shorter along the sequence and zero-extending its
    mask. Nothing is recomputed, and a newcomer costs one prefill of itself only. Finished or
    released rows leave via `batch_select_indices`, and leading columns that became padding in
    every row are trimmed.

    `sleep()` (idle only) drops the cache and batch state and, off the CPU, parks the weights on
    the CPU until `wake()`; weights may be loaded while asleep.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        eos_token_id: int,
        pad_token_id: int,
        *,
        max_batch_size: int,
        device: str | torch.device,
        policy_version: int = 0,
    ) -> None:
        """Run `model` on `device` (moved there), `max_batch_size` rows at once: a rollout instance's
        `fabric.worker.slots`, the in-process rollout's `rollout.max_batch_size` or the engine's own
        `max_batch_size` (`rl.engine_factory.build_engine`)."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.policy_version = policy_version
        self._live: dict[str, _Live] = {}
        self._waiting: deque[_Live] = deque()
        self._finished: list[_Live] = []  # finished on arrival, reported by the next step()
        self._rows: list[_Live] = []  # row i of the cache and mask belongs to _rows[i]
        self._cache: DynamicCache | None = None
        self._mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        self.asleep = False
        """Between `sleep()` and `wake()`: no request is accepted."""

    def add(self, request: GenerationRequest) -> None:
        if self.asleep:
            raise RuntimeError(f"request {request.sample_id!r}: the engine is asleep; wake() it first")
        if request.sample_id in self._live:
            raise ValueError(f"sample_id {request.sample_id!r} is already live in this engine")
        live = _Live(
            request,
            list(request.generated_ids),
            frozenset((self.eos_token_id, *request.stop_token_ids)),
            sample_key(request.seed, request.sample_id),
        )
        self._live[request.sample_id] = live
        (self._waiting if live.finish_reason() is None else self._finished).append(live)

    @torch.inference_mode()
    def release(self, sample_id: str) -> list[int]:
        live = self._live.pop(sample_id)  # KeyError for an unknown id
        if live in self._waiting:
            self._waiting.remove(live)
        elif live in self._finished:
            self._finished.remove(live)
        else:
            self._keep_rows([i for i, row in enumerate(self._rows) if row is not live])
        return list(live.response)

    def has_work(self) -> bool:
        return bool(self._live)

    def num_active(self) -> int:
        return len(self._live)

    def sleep(self) -> None:
        """Drop the KV cache and the batch state; on an accelerator also move the weights to the
        CPU and return the freed blocks to the device (`torch.cuda.empty_cache`). On the CPU the
        weights stay where they are, so what is freed is the cache of the last batch."""
        if self._live:
            raise RuntimeError(f"sleep() needs an idle engine; {len(self._live)} requests are live")
        self._rows, self._cache = [], None
        self._mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        if self.device.type != "cpu":
            self.model.to("cpu")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self.asleep = True

    def wake(self) -> None:
        """Bring the weights back to the engine's device (after `sleep()` on an accelerator)."""
        if self.asleep and self.device.type != "cpu":
            self.model.to(self.device)
        self.asleep = False

    @torch.no_grad()
    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load a version in place: every weight, or on a model with LoRA adapters (`rl.lora`) the
        adapter tensors alone, the base staying as it is."""
        if is_adapted(self.model):
            load_adapter_state(self.model, state_dict)
        else:
            self.model.load_state_dict(state_dict, strict=True)
        self.policy_version = version

    @torch.inference_mode()
    def step(self) -> list[TokenChunk]:
        chunks = [TokenChunk(live.request.sample_id, [], [], live.finish_reason()) for live in self._finished]
        for live in self._finished:
            del self._live[live.request.sample_id]
        self._finished.clear()

        logits = []
        if self._rows:
            logits.append(self._decode())
        newcomers = [
            self._waiting.popleft() for _ in range(min(len(self._waiting), self.max_batch_size - len(self._rows)))
        ]
        if newcomers:
            logits.append(self._prefill(newcomers))
        if not self._rows:
            return chunks

        tokens, logprobs = self._sample(torch.cat(logits))
        keep = []
        for i, (row, token, logprob) in enumerate(zip(self._rows, tokens, logprobs)):
            row.response.append(token)
            reason = row.finish_reason()
            chunks.append(TokenChunk(row.request.sample_id, [token], [logprob], reason))
            if reason is None:
                keep.append(i)
            else:
                del self._live[row.request.sample_id]
        self._keep_rows(keep)
        return chunks

    def _forward(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: DynamicCache | None,
    ) -> tuple[torch.Tensor, DynamicCache]:
        """One forward extending `cache` (or starting one); returns last-position logits, cache."""
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1].float(), out.past_key_values

    def _decode(self) -> torch.Tensor:
        """Feed each running row its last sampled token."""
        last = torch.tensor([[row.response[-1]] for row in self._rows], device=self.device)
        positions = self._mask.sum(dim=1, keepdim=True)
        self._mask = F.pad(self._mask, (0, 1), value=1)
        logits, self._cache = self._forward(last, self._mask, positions, self._cache)
        return logits

    def _prefill(self, newcomers: list[_Live]) -> torch.Tensor:
        """Prefill prompt + response of the newcomers and merge them into the running batch."""
        sequences = [[*live.request.prompt_ids, *live.response] for live in newcomers]
        width = max(map(len, sequences))
        ids = torch.full((len(sequences), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(sequences), width, dtype=torch.long)
        for i, sequence in enumerate(sequences):
            ids[i, width - len(sequence) :] = torch.tensor(sequence)
            mask[i, width - len(sequence) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        logits, cache = self._forward(ids, mask, (mask.cumsum(dim=1) - 1).clamp(min=0), None)
        if self._cache is None:
            self._cache, self._mask = cache, mask
        else:
            total = max(self._mask.shape[1], width)
            for (old, old_keys, old_values), (_, new_keys, new_values) in zip(_filled(self._cache), _filled(cache)):
                old.keys = torch.cat([_left_pad(old_keys, total), _left_pad(new_keys, total)])
                old.values = torch.cat([_left_pad(old_values, total), _left_pad(new_values, total)])
            self._mask = torch.cat([_left_pad(self._mask, total), _left_pad(mask, total)])
        self._rows += newcomers
        return logits

    def _keep_rows(self, keep: list[int]) -> None:
        """Drop every running row not in `keep`, then trim all-padding leading columns."""
        if len(keep) == len(self._rows):
            return
        self._rows = [self._rows[i] for i in keep]
        if not keep:
            self._cache = None
            self._mask = self._mask[:0, :0]
            return
        assert self._cache is not None, "running rows without a cache"
        index = torch.tensor(keep, device=self.device)
        self._cache.batch_select_indices(index)
        self._mask = self._mask[index]
        trim = int((self._mask.shape[1] - self._mask.sum(dim=1)).min())
        if trim:
            for layer, keys, values in _filled(self._cache):
                layer.keys = keys[..., trim:, :]
                layer.values = values[..., trim:, :]
            self._mask = self._mask[:, trim:]

    def _sample(self, logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """Draw one token per running row; returns the tokens and their logprobs."""
        tokens, logprobs = keyed_sample(
            logits,
            [row.key for row in self._rows],
            [len(row.response) for row in self._rows],
            [row.request.sampling for row in self._rows],
        )
        return tokens.tolist(), logprobs.tolist()


def _filled(cache: DynamicCache) -> list[tuple[CacheLayerMixin, torch.Tensor, torch.Tensor]]:
    """(layer, keys, values) of each layer of a prefilled full-attention cache (the only kind this
    engine serves: no linear-attention layer, and every layer holds its tensors after a forward)."""
    filled = []
    for layer in cache.layers:
        assert isinstance(layer, CacheLayerMixin) and layer.keys is not None and layer.values is not None, (
            f"expected a prefilled attention cache layer, got {type(layer).__name__}"
        )
        filled.append((layer, layer.keys, layer.values))
    return filled


def _left_pad(t: torch.Tensor, length: int) -> torch.Tensor:
    """Left-pad a mask [batch, seq] or a cache tensor [batch, heads, seq, dim] with zeros."""
    missing = length - (t.shape[1] if t.dim() == 2 else t.shape[-2])
    if not missing:
        return t
    return F.pad(t, (missing, 0)) if t.dim() == 2 else F.pad(t, (0, 0, missing, 0))
