"""A simulation scenario: the YAML file of `rlboost simulate --scenario FILE`, validated.

Every field has a docstring (the error messages quote it). A bad file fails with `ConfigError`
(the run configuration's error type, `infra.run.config`), one line per problem naming the file,
the line, the dotted field and the fix, e.g.
``skynomad.yaml:12: spot.gpu: unknown GPU type 'H200' (known: A100-40G, A100-80G, H100, L4). Fix: ...``.
Beyond the types and bounds, `load_scenario` checks what only the outside world can tell: that
the trace exists and loads, and that the catalog prices each machine type not given a price.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, Field, NonNegativeInt, PositiveInt, ValidationError

from infra.availability.traces import TraceError, load_trace
from infra.pricing import PriceNotFound, default_catalog
from infra.pricing.egress import egress_usd_per_gb
from infra.rollout.controller_config import ControllerConfig
from infra.run.config import ConfigError, line_of, read_yaml_sections
from infra.sim.hardware import GPUS, GPUSpec, ModelShape
from rl.config import Section

NOTICE_S = {"gcp": 30.0, "azure": 30.0, "aws": 120.0}
"""Preemption notice per cloud (GCP and Azure 30 s, AWS 120 s)."""
Variant = Literal[
    "ondemand",
    "rlboost",
    "rlboost_no_steal",
    "rlboost_marginal",
    "paper",
    "restart",
    "ondemand_equal_cost",
    "rlboost_async_k1",
    "rlboost_async_k2",
    "rlboost_async_k2_train_first",
    "ondemand_async_k1",
    "ondemand_async_k2",
]
VARIANTS: tuple[Variant, ...] = get_args(Variant)


class LoraSection(Section):
    """LoRA (`model.lora`): only low-rank adapters on the base weights are trained and published,
    so the trainer skips the base weights' gradients and a spot instance pulls each version as the
    adapters' bytes (it still pulls the base once, after its boot). Absent: full fine-tuning.

    The default fraction is r = 16 on every linear layer of Qwen3-8B (hidden 4096, MLP 12288,
    32 query and 8 key/value heads of 128, 36 layers). An adapter of rank r on a `d_in x d_out`
    weight adds `r (d_in + d_out)` parameters: per layer q and o `2 x 16 x 8192`, k and v
    `2 x 16 x 5120`, gate, up and down `3 x 16 x 16384`, 1,212,416 in all; x 36 layers =
    43.6M adapter parameters over 8.19B: 0.0053 (87 MB in bf16)."""

    trainable_fraction: float = Field(0.0053, gt=0, le=1)
    """Adapter parameters over the model's parameters (`model.params_b`): 0.0053 for r = 16 on
    every linear layer of Qwen3-8B; it scales linearly with r."""
    adapter_bytes: float | None = Field(None, gt=0)
    """Bytes of one published adapter version; None: `trainable_fraction x params x
    model.bytes_per_value` (the adapters in the engine dtype)."""

    def bytes(self, params_b: float, bytes_per_value: int) -> float:
        """One adapter version's bytes: `adapter_bytes`, or the fraction of the model's weights."""
        if self.adapter_bytes is not None:
            return self.adapter_bytes
        return self.trainable_fraction * params_b * 1e9 * bytes_per_value


class ModelSection(Section):
    """The policy model's size and KV-cache shape (defaults: Qwen3-8B)."""

    params_b: float = Field(8.2, gt=0)
    """Parameters, in billions."""
    layers: int = Field(36, ge=1)
    """Transformer layers."""
    kv_heads: int = Field(8, ge=1)
    """Key/value heads per layer (grouped-query attention)."""
    head_dim: int = Field(128, ge=1)
    """Dimension of one attention head."""
    bytes_per_value: int = Field(2, ge=1)
    """Bytes per weight and per KV value (2 for bf16)."""
    hidden_size: int = Field(4096, ge=1)
    """Width of the hidden state: what a tensor-parallel engine all-reduces per sample, twice per layer."""
    lora: LoraSection | None = None
    """LoRA adapters instead of full fine-tuning (`LoraSection`); None: every weight is trained."""

    def shape(self) -> ModelShape:
        return ModelShape.of(
            self.params_b, self.layers, self.kv_heads, self.head_dim, self.bytes_per_value, self.hidden_size
        )

    def version_bytes(self) -> float:
        """Bytes of one published policy version: the adapters with LoRA, else the whole weights."""
        if self.lora is None:
            return self.shape().weight_bytes
        return self.lora.bytes(self.params_b, self.bytes_per_value)

    def first_pull_bytes(self) -> float:
        """Bytes a freshly booted spot instance pulls before it generates: the current version's
        weights, or with LoRA the base weights once plus the current adapters."""
        weights = self.shape().weight_bytes
        return weights if self.lora is None else weights + self.version_bytes()


class WorkloadSection(Section):
    """One RL step's batch and its response-length distribution."""

    prompts_per_step: int = Field(128, ge=1)
    """Prompts (groups) per step."""
    samples_per_prompt: int = Field(8, ge=1)
    """Responses per prompt (the GRPO group size)."""
    prompt_tokens: int = Field(512, ge=1)
    """Tokens of each prompt."""
    mean_response_tokens: float = Field(2630.0, gt=0)
    """Mean of the log-normal response length before truncation."""
    response_cv: float = Field(1.2, gt=0)
    """Coefficient of variation of the log-normal response length (heavy right tail: 1-1.5)."""
    max_response_tokens: int = Field(14336, ge=1)
    """Response budget: longer responses are cut here (the sampling `max_new_tokens`)."""


class AgenticSection(Section):
    """Multi-turn trajectories instead of single responses (`infra.sim.agentic`): each sample is
    turns of model tokens with a tool call between two turns, whose result's tokens join the
    context. With it, `workload.prompt_tokens` is the task's prompt and the `workload` response
    lengths are unused. Defaults: a SWE-style coding agent (docs/CALIBRATION.md, "Agentic
    workload"); the coefficients of variation are assumptions, not published figures."""

    turns_mean: float = Field(41.0, ge=1)
    """Mean turns per trajectory (log-normal), before `max_turns` and the context budget."""
    turns_cv: float = Field(0.7, gt=0)
    """Coefficient of variation of the turns per trajectory."""
    max_turns: int = Field(100, ge=1)
    """Most turns of one trajectory (`environment.max_turns`)."""
    turn_tokens_mean: float = Field(200.0, gt=0)
    """Mean model tokens of one turn (its reasoning and its tool call), log-normal."""
    turn_tokens_cv: float = Field(1.0, gt=0)
    """Coefficient of variation of a turn's model tokens."""
    max_turn_tokens: int = Field(2048, ge=1)
    """A turn's model tokens are cut here (the sampling `max_new_tokens` of one turn)."""
    observation_tokens_mean: float = Field(160.0, gt=0)
    """Mean tokens of one tool result appended to the context, log-normal."""
    observation_tokens_cv: float = Field(1.5, gt=0)
    """Coefficient of variation of a tool result's tokens."""
    tool_latency_mean_s: float = Field(3.0, ge=0)
    """Mean seconds of one tool call, log-normal (no GPU: the engine decodes other samples)."""
    tool_latency_cv: float = Field(1.0, gt=0)
    """Coefficient of variation of a tool call's seconds."""
    max_context_tokens: int = Field(32768, ge=2)
    """A trajectory ends when its context (prompt, turns, tool results) would pass this budget."""
    kv_reuse: bool = True
    """A turn that resumes on the instance of its previous turn prefills only the new tool
    result (the engine's prefix cache holds the history); elsewhere, or False, the whole history."""
    environment: Literal["server", "replay"] = "server"
    """Where this project's trajectories keep their environment when they migrate: `server` (an
    environment server, or a pure environment restored from the log: nothing re-runs) or `replay`
    (the new instance re-runs the trajectory's tool calls before it continues)."""

    def mean_context(self, prompt_tokens: int) -> float:
        """A running turn's mean context: the prompt plus half a mean trajectory, within the budget."""
        half = self.turns_mean * (self.turn_tokens_mean + self.observation_tokens_mean) / 2
        return min(prompt_tokens + half, self.max_context_tokens)


class DecodeSection(Section):
    """How close engines come to the memory-bandwidth roofline."""

    eta: float = Field(0.69, gt=0, le=1)
    """Achieved fraction of HBM bandwidth in decode, the engine's own overheads included
    (Qwen3-8B on one H100 at 4 concurrent requests: SGLang 7.19 ms a token, 0.69; vLLM 7.38 ms,
    0.67; Llama-3.1-8B at batch 1 on vLLM: 0.75)."""
    memory_utilization: float = Field(0.85, gt=0, le=1)
    """Fraction of GPU memory an engine uses for weights and KV cache."""
    prefill_mfu: float = Field(0.25, gt=0, le=1)
    """Model FLOPs utilization of prefill (Qwen3-14B 32K prompts on H100: ~0.25)."""
    allreduce_latency_us: float = Field(6.0, ge=0)
    """Latency of one all-reduce between the GPUs of a tensor-parallel engine, microseconds; a
    decode step runs two per layer (2 x H100 over NVLink, small messages, CUDA graphs: ~6 us)."""
    allreduce_efficiency: float = Field(0.82, gt=0, le=1)
    """Fraction of the GPU link's line rate an all-reduce's bus bandwidth reaches (NCCL on H100
    NVLink: 365-370 GB/s of 450, its protocol overhead ~20%)."""


class TrainingSection(Section):
    """Cost of the RL update on the reserved GPUs."""

    mfu: float = Field(0.28, gt=0, le=1)
    """Model FLOPs utilization of training (torchtitan Llama-3.1-8B on 8xH100: 5,762 tok/s/GPU, ~0.28)."""
    flops_per_param: float = Field(8.0, gt=0)
    """FLOPs per parameter per trained token over all passes of an update: 6 (forward and
    backward) + 2 (old log-probs); add 2 for a reference forward (a KL loss) and 2 for the
    recomputed forward of gradient checkpointing."""
    weight_gradient_flops_per_param: float = Field(2.0, ge=0)
    """The share of `flops_per_param` that is the backward pass's weight gradients: of forward
    and backward's 6, 2 are the forward, 2 the input gradients and 2 the weight gradients (one
    GEMM each per weight matrix and token). LoRA (`model.lora`) skips them for the base weights
    and computes them for the adapters only, so it trains at `flops_per_param - w (1 - f)` (w this
    field, f `model.lora.trainable_fraction`): the forwards (training, recomputed, old log-probs,
    and the reference, which is the base with the adapters disabled) and the input gradients stay.
    The adapters' own share of every forward and input gradient (~2f each) is left out: < 0.5% of
    the total at f = 0.0053. Unused without LoRA."""
    old_logprob_flops_per_param: float = Field(2.0, ge=0)
    """The share of `flops_per_param` that is the separate no-grad forward recomputing the old
    log-probs (2: one forward). veRL and the RLBoost artifact run it (the `ondemand`, `paper` and
    `ondemand_equal_cost` variants); this project's trainer does not (one update per RL step:
    the proximal log-probs are the training forward's), so its variants train at
    `flops_per_param` minus this. A measured profile times the runtime's own trainer instead."""
    max_staleness: int = Field(0, ge=0)
    """K of bounded staleness, for this project's variants without a K of their own (`rlboost`,
    `rlboost_no_steal`, `restart`): the prompts of step s are admitted while steps s-1 .. s-K
    still train, every token of step s comes from a version >= s-1-K (a response in progress
    continues on each newer version after a re-prefill of its tokens) and none is discarded.
    0: strictly on-policy (rollout, then training, then the next rollout)."""
    while_generating: bool = False
    """The trainer trains complete groups while the reserved engines still generate (a CPU run's
    co-located engine is a thread of the training process and `fabric.stream_training` feeds the
    trainer as groups complete: both share the cores); False: the reserved GPUs train only once
    released at `T_local` or once the step's rollout is done (the paper's design)."""
    count_prompt_tokens: bool = True
    """Trained tokens include the prompts: veRL's `perf/throughput` (the RLBoost artifact's
    figure) is the sum of the step's attention masks, prompt + response, over the step time."""
    micro_batch_samples: int | None = Field(None, ge=1)
    """Complete groups train once they fill a micro-batch of this many samples (the step's last
    may be smaller), as the runtime's `StreamedStep` accumulates `optim.micro_batch_size` samples
    at a time; None: every group as soon as it is complete."""
    step_overhead_s: float = Field(0.0, ge=0)
    """Serial seconds of every step outside rollout and training, after the last group is
    trained: the orchestrator's own work (a CPU profile measures the runtime's: Prefect's task
    runs, scoring, publishing the version, accounting). 0 at paper scale: no public figure
    gives veRL's."""


class MeasuredSection(Section):
    """Speeds measured on this machine (a CPU profile: `bench/simulate.py`'s CPU check). When
    given they replace the GPU roofline, prefill and training FLOPs models, for every engine."""

    decode_step_s: float = Field(gt=0)
    """One decode step's fixed time (an engine step over an empty context)."""
    decode_s_per_context_token: float = Field(ge=0)
    """Added to a decode step per token of context of the samples it runs."""
    prefill_s_per_token: float = Field(ge=0)
    """Prefill time per prompt (or resumed) token."""
    train_s_per_token: float = Field(gt=0)
    """Trainer seconds per trained token (every pass of one update)."""
    cores: int = Field(ge=1)
    """CPU cores the trainer and the spot worker processes share."""
    busy_processes: float = Field(gt=0)
    """Processes computing at once, on average (the trainer or its co-located engine, plus the
    spot workers alive); every measured time stretches by `max(1, busy_processes / cores)`."""

    @property
    def slowdown(self) -> float:
        return max(1.0, self.busy_processes / self.cores)


class ReservedSection(Section):
    """The reserved cluster: it trains and, co-located, generates until `T_local`."""

    gpu: str = "H100"
    """GPU type (one of `infra.sim.hardware.GPUS`)."""
    gpus: int = Field(8, ge=1)
    """GPUs of the cluster (all train; all generate while co-located)."""
    engine_gpus: int = Field(1, ge=1)
    """GPUs per rollout engine (tensor parallel); `gpus` must be a multiple."""
    max_running: int = Field(256, ge=1)
    """Most samples one engine runs at once (the KV cache may allow fewer)."""
    provider: str = "gcp"
    """Cloud of the price lookup (gcp, azure; aws needs `price_per_hour`)."""
    machine_type: str = "a3-highgpu-8g"
    """Machine type priced for the whole cluster."""
    region: str | None = "us-central1"
    """Region of the price lookup; None for the cloud's reference region."""
    price_per_hour: float | None = Field(None, ge=0)
    """Price of the whole cluster per hour; None to read the catalog's on-demand price."""


class SpotSection(Section):
    """The spot (rollout-only) instances."""

    gpu: str = "H100"
    """GPU type (one of `infra.sim.hardware.GPUS`)."""
    gpus: int = Field(2, ge=1)
    """GPUs per instance (one tensor-parallel engine)."""
    max_running: int = Field(256, ge=1)
    """Most samples one instance runs at once (the KV cache may allow fewer)."""
    max_instances: int = Field(4, ge=0)
    """Spot instances the run asks for (the capacity manager's pool size)."""
    provider: str = "gcp"
    """Cloud: sets the price lookup and the preemption notice."""
    machine_type: str = "a3-highgpu-2g"
    """Machine type of one instance."""
    region: str | None = "us-central1"
    """Region of the price lookup."""
    price_per_hour: float | None = Field(None, ge=0)
    """Spot price of one instance per hour; None to read the catalog."""
    ondemand_price_per_hour: float | None = Field(None, ge=0)
    """On-demand price of one instance per hour (the equal-cost variant); None to read the catalog."""
    boot_s: float = Field(180.0, ge=0)
    """From the request to an engine with the base model loaded (VM boot, container, engine)."""
    notice_s: float | None = Field(None, ge=0)
    """Preemption notice; None for the cloud's (GCP 30 s, Azure 30 s, AWS 120 s)."""
    silent_fraction: float = Field(0.0, ge=0, le=1)
    """Fraction of preemptions that kill without notice (the reaper finds those)."""

    @property
    def notice(self) -> float:
        return self.notice_s if self.notice_s is not None else NOTICE_S.get(self.provider, 30.0)


class AvailabilitySection(Section):
    """When spot capacity exists."""

    source: Literal["trace", "paper", "constant"] = "trace"
    """`trace`: a recorded trace; `paper`: the RLBoost artifact's schedule (one instance added
    every `add_every_s` up to `spot.max_instances`, then the oldest killed and a new one added
    `add_every_s` later); `constant`: `spot.max_instances` instances, never preempted."""
    trace: str | None = None
    """Trace reference for `source: trace` (`skynomad/h100/<zone>`, `bamboo/p3`, `spotserve/<segment>`, ...)."""
    offset_s: float = Field(0.0, ge=0)
    """Start this far into the trace."""
    time_compression: float = Field(1.0, gt=0)
    """Trace seconds per simulated second."""
    add_every_s: float = Field(1800.0, gt=0)
    """The paper schedule's interval."""


class NetworkSection(Section):
    """Weight-transfer bandwidths, bytes and egress price."""

    trainer_gbps: float = Field(100.0, gt=0)
    """Upload of the trainer's weight senders, Gbit/s."""
    instance_gbps: float = Field(50.0, gt=0)
    """Download (and upload, in the swarm) of one spot instance, Gbit/s."""
    local_sync_s: float = Field(2.0, ge=0)
    """Time for the co-located engines to load a new version from the trainer on the same node."""
    weight_bytes_fraction: float = Field(1.0, gt=0, le=1)
    """Share of a version's bytes a spot instance pulls per new version (1: the full weights in
    the engine dtype, or with `model.lora` the adapters; less with sparse weight deltas). A
    freshly booted instance pulls the full weights (with LoRA the base, then the adapters)."""
    egress_usd_per_gb: float | None = Field(None, ge=0)
    """Egress price of the weight bytes sent to a spot instance, USD per GB; None: the bundled
    table's price from the reserved cluster's cloud and region to the spot pool's
    (`infra.pricing.egress`: 0 within one region)."""


class TokenLogSection(Section):
    """What a silent kill loses: the tokens since the last flush."""

    flush_tokens: int = Field(64, ge=1)
    """A sample's tokens are flushed every this many tokens..."""
    flush_ms: float = Field(500.0, gt=0)
    """... or this often, whichever comes first."""


class PaperOffloadSection(Section):
    """The RLBoost artifact's own offload rule, which the `paper` variant runs
    (`infra.sim.artifact_offload`): a fixed local generation budget per step, moved by a third of
    the bubble difference, with remembered budgets per spot count."""

    initial_s: int = Field(150, ge=0)
    """Budget of the first step (the artifact's `max_gen_s`)."""
    budgets_s: dict[PositiveInt, NonNegativeInt] = {1: 190, 2: 160, 3: 105, 4: 70}
    """Budget in seconds per spot instance count (1 or more) before any is learnt (the artifact's
    offline-profiled budgets for Qwen3-8B, rollout-manager/src/balance.rs)."""
    floor_s: int = Field(5, ge=0)
    """The budget never falls below this."""


class RunSection(Section):
    """How long to simulate and what to measure."""

    duration_s: float = Field(8 * 3600.0, gt=0)
    """Simulated time: no step starts after it."""
    max_steps: int | None = Field(None, ge=1)
    """Stop after this many steps (None: only `duration_s`)."""
    measure_from_step: int = Field(0, ge=0)
    """Throughput and cost count steps from this one on (skip the warm-up)."""
    claim_delay_s: float = Field(0.05, ge=0)
    """A worker claims this long after a slot frees (its poll)."""
    steal_holdoff_s: float = Field(0.5, ge=0)
    """A worker asked to release samples (a steal) does not claim for this long, so the idle
    instance gets them (the worker's `STEAL_HOLDOFF_S`)."""
    prices_at: datetime | None = None
    """Date of the catalog prices (None: the latest)."""
    variants: tuple[Variant, ...] = VARIANTS
    """Variants to run side by side (`ondemand` always runs: it is the baseline)."""


class Scenario(Section):
    """One simulation: the cluster, the workload, spot availability and the policies."""

    name: str = "scenario"
    """Shown in reports."""
    seed: int = 0
    """Seed of the response lengths and of which preemptions are silent (same in every variant)."""
    model: ModelSection = ModelSection()
    workload: WorkloadSection = WorkloadSection()
    decode: DecodeSection = DecodeSection()
    training: TrainingSection = TrainingSection()
    reserved: ReservedSection = ReservedSection()
    spot: SpotSection = SpotSection()
    availability: AvailabilitySection = AvailabilitySection()
    network: NetworkSection = NetworkSection()
    token_log: TokenLogSection = TokenLogSection()
    measured: MeasuredSection | None = None
    """Speeds measured on this machine instead of the GPU models (None: the GPU models)."""
    agentic: AgenticSection | None = None
    """Multi-turn trajectories with tool calls (`AgenticSection`); None: one response per sample."""
    controller: ControllerConfig = ControllerConfig()
    """The rollout controller's configuration (`infra.rollout.controller_config.ControllerConfig`): reap
    timeout, steal, offload (`T_local`) and the poll interval."""
    paper_offload: PaperOffloadSection = PaperOffloadSection()
    """The `paper` variant's offload rule (the artifact's, in place of `controller.offload`)."""
    run: RunSection = RunSection()

    def gpu(self, section: Literal["reserved", "spot"]) -> GPUSpec:
        return GPUS[getattr(self, section).gpu]

    def longest_context(self) -> tuple[int, str, str]:
        """Tokens of one sample's whole context (the prompt and the longest response, or the
        agentic context budget), the fields it comes from and the one to lower."""
        if self.agentic is not None:
            return self.agentic.max_context_tokens, "agentic.max_context_tokens", "agentic.max_context_tokens"
        w = self.workload
        return (
            w.prompt_tokens + w.max_response_tokens,
            "prompt_tokens + max_response_tokens",
            "workload.max_response_tokens",
        )

    def mean_context(self) -> float:
        """A running sample's mean context, which sizes an engine's concurrency: the prompt and a
        mean response, or a running turn's (`AgenticSection.mean_context`)."""
        w = self.workload
        if self.agentic is not None:
            return self.agentic.mean_context(w.prompt_tokens)
        return w.prompt_tokens + min(w.mean_response_tokens, w.max_response_tokens)

    def train_flops_per_param(self, recompute_logprobs: bool) -> float:
        """FLOPs per parameter per trained token of one update: `training.flops_per_param`, less
        the old-log-prob forward where the trainer does not run it, less the base weights'
        gradients with LoRA (`TrainingSection.weight_gradient_flops_per_param`)."""
        training, lora = self.training, self.model.lora
        flops = training.flops_per_param - (0.0 if recompute_logprobs else training.old_logprob_flops_per_param)
        if lora is not None:
            flops -= training.weight_gradient_flops_per_param * (1 - lora.trainable_fraction)
        return flops


def _field_doc(loc: tuple[Any, ...]) -> str | None:
    """The docstring of the field at `loc` in `Scenario`, if `loc` names one."""
    model: type[BaseModel] | None = Scenario
    doc = None
    for key in loc:
        if model is None or not isinstance(key, str) or key not in model.model_fields:
            return doc
        info = model.model_fields[key]
        doc = " ".join((info.description or "").split()) or None
        annotation = info.annotation  # a section, or an optional one (`X | None`)
        sections = [a for a in (annotation, *get_args(annotation)) if isinstance(a, type) and issubclass(a, BaseModel)]
        model = sections[0] if sections else None
    return doc


def _memory_problems(scenario: Scenario) -> list[tuple[tuple[str, ...], str]]:
    """Engines whose memory holds neither the weights nor one sample's whole context."""
    found: list[tuple[tuple[str, ...], str]] = []
    shape = scenario.model.shape()
    longest, what, knob = scenario.longest_context()
    share = scenario.decode.memory_utilization
    for section, field in (("reserved", "engine_gpus"), ("spot", "gpus")):
        part = getattr(scenario, section)
        if part.gpu not in GPUS:
            continue
        gpus = getattr(part, field)
        usable = gpus * GPUS[part.gpu].hbm_gb * 1e9 * share
        fix = f"Fix: raise {section}.{field}, pick a GPU with more memory, or raise decode.memory_utilization"
        if usable <= shape.weight_bytes:
            found.append(
                (
                    (section, field),
                    f"{gpus} x {part.gpu} at memory_utilization {share:g} hold {usable / 1e9:.1f} GB, "
                    f"less than the model's {shape.weight_bytes / 1e9:.1f} GB of weights. {fix}",
                )
            )
        elif usable - shape.weight_bytes < longest * shape.kv_bytes_per_token:
            found.append(
                (
                    (section, field),
                    f"the KV cache of {gpus} x {part.gpu} holds {(usable - shape.weight_bytes) / shape.kv_bytes_per_token:,.0f} "
                    f"tokens, fewer than one sample's {longest:,} ({what}). {fix}, or lower {knob}",
                )
            )
    return found


def _problems(scenario: Scenario) -> list[tuple[tuple[str, ...], str]]:
    """What the types cannot tell: GPU types, engine memory, engine split, trace, prices."""
    found: list[tuple[tuple[str, ...], str]] = []
    known = ", ".join(sorted(GPUS))
    for section in ("reserved", "spot"):
        name = getattr(scenario, section).gpu
        if name not in GPUS:
            found.append(((section, "gpu"), f"unknown GPU type {name!r} (known: {known}). Fix: use one of those"))
    if scenario.measured is None:  # a measured profile has no GPU memory to check
        found += _memory_problems(scenario)
    training = scenario.training
    if training.old_logprob_flops_per_param >= training.flops_per_param:
        found.append(
            (
                ("training", "old_logprob_flops_per_param"),
                f"{training.old_logprob_flops_per_param:g} is not a share of training.flops_per_param "
                f"({training.flops_per_param:g}): without the old-log-prob forward nothing would be left to train. "
                "Fix: lower it (2: one forward) or raise training.flops_per_param",
            )
        )
    lora = scenario.model.lora
    skipped = training.old_logprob_flops_per_param + training.weight_gradient_flops_per_param
    if lora is not None and skipped >= training.flops_per_param:
        found.append(
            (
                ("training", "weight_gradient_flops_per_param"),
                f"{training.weight_gradient_flops_per_param:g} plus training.old_logprob_flops_per_param "
                f"({training.old_logprob_flops_per_param:g}) leave nothing of training.flops_per_param "
                f"({training.flops_per_param:g}) for LoRA's forward and input gradients. "
                "Fix: lower it (2: the weight-gradient third of forward and backward's 6) or raise training.flops_per_param",
            )
        )
    if (
        lora is not None
        and lora.adapter_bytes is not None
        and lora.adapter_bytes >= scenario.model.shape().weight_bytes
    ):
        found.append(
            (
                ("model", "lora", "adapter_bytes"),
                f"{lora.adapter_bytes:,.0f} bytes is not smaller than the model's {scenario.model.shape().weight_bytes:,.0f}: "
                "an adapter is a small share of the weights. Fix: give the adapter's bytes, or leave it out "
                "(trainable_fraction x params x bytes_per_value)",
            )
        )
    if (
        training.max_staleness
        and scenario.run.max_steps is not None
        and training.max_staleness >= scenario.run.max_steps
    ):
        found.append(
            (
                ("training", "max_staleness"),
                f"{training.max_staleness} lets rollout run {training.max_staleness} steps ahead, but the run trains only "
                f"run.max_steps={scenario.run.max_steps}. Fix: lower training.max_staleness below run.max_steps "
                "(1 or 2 suffice) or raise run.max_steps",
            )
        )
    agentic = scenario.agentic
    if agentic is not None and scenario.workload.prompt_tokens >= agentic.max_context_tokens:
        found.append(
            (
                ("agentic", "max_context_tokens"),
                f"{agentic.max_context_tokens:,} leaves no room after workload.prompt_tokens "
                f"({scenario.workload.prompt_tokens:,}). Fix: raise it above the prompt, or lower workload.prompt_tokens",
            )
        )
    if scenario.reserved.gpus % scenario.reserved.engine_gpus:
        found.append(
            (
                ("reserved", "engine_gpus"),
                f"{scenario.reserved.gpus} GPUs do not split into engines of {scenario.reserved.engine_gpus}. "
                "Fix: make reserved.gpus a multiple of reserved.engine_gpus",
            )
        )
    availability = scenario.availability
    if availability.source == "trace":
        if availability.trace is None:
            found.append(
                (
                    ("availability", "trace"),
                    "source is trace but no trace is named. Fix: e.g. skynomad/h100/us-central1-a",
                )
            )
        else:
            try:
                load_trace(availability.trace)
            except TraceError as error:
                found.append((("availability", "trace"), f"{error}. Fix: name a shipped trace (see infra/data/traces)"))
    try:
        egress_price(scenario)
    except (LookupError, KeyError) as error:
        found.append((("network", "egress_usd_per_gb"), f"{error}. Fix: set network.egress_usd_per_gb"))
    catalog = default_catalog()
    at = scenario.run.prices_at.astimezone(UTC) if scenario.run.prices_at else None
    lookups = [
        ("reserved", "price_per_hour", "ondemand"),
        ("spot", "price_per_hour", "spot"),
        ("spot", "ondemand_price_per_hour", "ondemand"),
    ]
    for section, field, capacity_class in lookups:
        part = getattr(scenario, section)
        if getattr(part, field) is None:
            try:
                catalog.price(part.provider, part.machine_type, part.region, capacity_class, at)
            except PriceNotFound as error:
                found.append(((section, field), f"{error} (or set {section}.{field})"))
    return found


def parse_scenario(text: str, source: str = "<string>") -> Scenario:
    """Validate YAML `text` into a `Scenario`; `ConfigError` names each problem's line, field and fix."""
    data, root = read_yaml_sections(text, source)

    def where(loc: tuple[Any, ...]) -> str:
        line = line_of(root, loc)
        return f"{source}:{line}" if line else source

    try:
        scenario = Scenario.model_validate(data)
    except ValidationError as error:
        problems = []
        for item in error.errors():
            loc = tuple(item["loc"])
            field = ".".join(map(str, loc)) or "(top level)"
            if item["type"] == "extra_forbidden":
                reason = "unknown key. Fix: check the spelling (see the fields in infra/sim/scenario.py)"
            else:
                got = f" (got {item['input']!r})" if "input" in item and not isinstance(item["input"], dict) else ""
                doc = _field_doc(loc)
                reason = f"{item['msg']}{got}. Fix: give a value that satisfies this" + (
                    f"; the field: {doc}" if doc else ""
                )
            problems.append(f"{where(loc)}: {field}: {reason}")
        raise ConfigError("\n".join(problems)) from None
    problems = [f"{where(loc)}: {'.'.join(loc)}: {reason}" for loc, reason in _problems(scenario)]
    if problems:
        raise ConfigError("\n".join(problems))
    return scenario


def load_scenario(path: str | Path) -> Scenario:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"{path}: cannot read the scenario file: {error.strerror}") from None
    return parse_scenario(text, str(path))


def egress_price(scenario: Scenario) -> float:
    """USD per GB of the weights sent from the trainer (the reserved cluster) to a spot instance."""
    given = scenario.network.egress_usd_per_gb
    if given is not None:
        return given
    reserved, spot = scenario.reserved, scenario.spot
    return egress_usd_per_gb(reserved.provider, reserved.region, spot.provider, spot.region)


def prices_per_hour(scenario: Scenario) -> tuple[float, float, float]:
    """(reserved cluster, one spot instance, one instance on demand), USD per hour: the scenario's
    prices where given, else the catalog's at `run.prices_at`."""
    catalog = default_catalog()
    at = scenario.run.prices_at.astimezone(UTC) if scenario.run.prices_at else None
    reserved, spot = scenario.reserved, scenario.spot

    def pick(given: float | None, part: ReservedSection | SpotSection, capacity_class: str) -> float:
        if given is not None:
            return given
        return catalog.price(part.provider, part.machine_type, part.region, capacity_class, at)  # type: ignore[arg-type]

    return (
        pick(reserved.price_per_hour, reserved, "ondemand"),
        pick(spot.price_per_hour, spot, "spot"),
        pick(spot.ondemand_price_per_hour, spot, "ondemand"),
    )
