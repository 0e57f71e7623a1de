"""The run configuration as a whole, and loading it from YAML with precise errors.

`RunConfig` composes the per-concern models of `rl.config` with the run-level settings. A bad
file fails with `ConfigError`, whose message names the file, the line, the dotted field path and
the reason, e.g. ``demo.yaml:14: grpo.clip_eps: Input should be less than 1 (got 1.5)``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticUndefined

from infra.ledger.config import LedgerConfig
from infra.run.fabric_config import FabricConfig
from infra.tracking.config import TrackerConfig
from rl.config import (
    DataConfig,
    EnvironmentConfig,
    EvalConfig,
    GRPOConfig,
    ModelConfig,
    OptimConfig,
    PretrainConfig,
    PromptConfig,
    RewardConfig,
    RolloutConfig,
    Section,
    TrainerConfig,
    TrainingConfig,
)
from rl.engine_spec import EngineSpec
from rl.families import environment_of

RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""A run name: one directory name, never a path."""

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "deployments" / "configs" / "demo.yaml"


class RunSection(Section):
    """Identity, length and bookkeeping of one training run."""

    name: str = "grpo-demo"
    """Run name (directory under `output_dir`, and the Prefect flow-run name prefix): letters,
    digits, `.`, `_` and `-`, starting with a letter or digit (so never a path: no `/`, no `..`)."""
    steps: int = Field(100, ge=1)
    """RL steps (optimizer steps) to run in total, counting steps done before a resume."""
    seed: int = 0
    """Seed of sampling and of everything else random in the run."""
    output_dir: Path = Path("runs")
    """Checkpoints, per-step records and plots go under `output_dir/name`."""
    checkpoint_every: int = Field(10, ge=1)
    """Write a checkpoint every this many steps (and after the last)."""
    keep_checkpoints: int = Field(2, ge=1)
    """Most recent checkpoints to keep on disk."""
    torch_threads: int | None = Field(None, ge=1)
    """CPU threads for torch (default: torch's own choice)."""

    @field_validator("name")
    @classmethod
    def _safe_name(cls, name: str) -> str:
        if not RUN_NAME.fullmatch(name):
            raise ValueError(
                "run.name must be letters, digits, '.', '_' and '-', starting with a letter or digit "
                "(it names a directory under run.output_dir: no '/', no '..')"
            )
        return name

    @property
    def directory(self) -> Path:
        return self.output_dir / self.name


class RunConfig(Section):
    """Everything one `rl-train` run needs."""

    run: RunSection = RunSection()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    prompt: PromptConfig = PromptConfig()
    reward: RewardConfig = RewardConfig()
    environment: EnvironmentConfig | None = None
    grpo: GRPOConfig = GRPOConfig()
    optim: OptimConfig = OptimConfig()
    training: TrainingConfig = TrainingConfig()
    trainer: TrainerConfig = TrainerConfig()
    eval: EvalConfig = EvalConfig()
    pretrain: PretrainConfig = PretrainConfig()
    fabric: FabricConfig = FabricConfig()
    ledger: LedgerConfig = LedgerConfig()
    tracking: tuple[TrackerConfig, ...] = ()
    """Experiment trackers (MLflow, TensorBoard, W&B) that get every step's metrics, the
    configuration and the artifacts (docs/tracking.md); none by default."""

    def engine_spec(self) -> EngineSpec:
        """The run's engine: the in-process engine's and, with each pool's overrides, the instances'."""
        rollout = self.rollout
        return EngineSpec(
            kind=rollout.engine, device=rollout.device, dtype=self.model.dtype, vllm=rollout.vllm, lora=self.model.lora
        )

    @model_validator(mode="after")
    def _format_has_a_pattern(self) -> RunConfig:
        if self.reward.format_weight > 0 and self.reward.format == "family" and self.data.source != "arithmetic":
            raise ValueError(
                "reward.format: 'family' needs data.source: arithmetic (its family's pattern); with "
                f"data.source: {self.data.source} choose boxed, gsm8k or a regex"
            )
        return self

    @model_validator(mode="after")
    def _trajectories_run_on_the_fabric(self) -> RunConfig:
        if self.environment is not None and not self.fabric.enabled:
            raise ValueError(
                "environment: multi-turn trajectories run on the fabric's rollout instances, but fabric.enabled "
                "is false: set fabric.enabled: true, or remove environment"
            )
        return self

    @model_validator(mode="after")
    def _tool_family_has_its_environment(self) -> RunConfig:
        family = self.data.family if self.data.source == "arithmetic" else None
        needed = environment_of(family) if family is not None else None
        if needed is not None and self.environment is None:
            raise ValueError(
                f"data.family: {family} problems are solved with a tool: add environment: {{name: {needed}}} "
                "(deployments/configs/calculator.yaml), or choose another data.family"
            )
        return self

    @model_validator(mode="after")
    def _staleness_is_consistent(self) -> RunConfig:
        k = self.training.max_staleness
        if k > 0 and not self.fabric.enabled:
            raise ValueError(
                f"training.max_staleness={k} lets rollout run ahead of the trainer on the fabric's instances, but "
                "fabric.enabled is false (the in-process engine rolls out between training steps): set "
                "fabric.enabled: true, or training.max_staleness: 0"
            )
        if self.grpo.objective == "decoupled" and k == 0:
            raise ValueError(
                "grpo.objective: decoupled corrects for samples of older policy versions, but training.max_staleness "
                "is 0 (every sample is on-policy): set training.max_staleness >= 1, or grpo.objective: auto"
            )
        if self.trainer.backend == "deepspeed" and self.optim.updates_per_step > 1:
            raise ValueError(
                f"optim.updates_per_step={self.optim.updates_per_step} runs several updates per RL step, which "
                "the DeepSpeed trainer does not: set trainer.backend: torch, or optim.updates_per_step: 1"
            )
        if k > 0 and self.fabric.enabled and k + 1 > self.fabric.retain_steps:
            raise ValueError(
                f"training.max_staleness={k} keeps up to {k + 1} steps open in the token log, more than "
                f"fabric.retain_steps={self.fabric.retain_steps}: set fabric.retain_steps >= {k + 1}"
            )
        return self

    @property
    def objective(self) -> str:
        """The objective the trainer runs: `grpo.objective`, with `auto` resolved by the staleness."""
        if self.grpo.objective != "auto":
            return self.grpo.objective
        return "grpo" if self.training.max_staleness == 0 else "decoupled"

    @model_validator(mode="after")
    def _trainer_machine_is_counted_once(self) -> RunConfig:
        colocated = [pool.name for pool in self.fabric.pools if pool.colocated] if self.fabric.enabled else []
        if self.ledger.trainer is not None and colocated:
            raise ValueError(
                f"ledger.trainer prices the trainer's machine, but pool {colocated[0]!r} is colocated: its instance "
                f"runs on that machine and is recorded as the trainer already (its machine_type and price_per_hour). "
                f"Remove ledger.trainer, or set `colocated: false`"
            )
        return self


class ConfigError(ValueError):
    """A configuration file that cannot be used; the message says where and why."""


def line_of(root: yaml.Node | None, path: tuple[Any, ...]) -> int | None:
    """1-based line of the YAML node at `path` (or of its deepest existing ancestor)."""
    node, line = root, None
    for key in path:
        if isinstance(node, yaml.MappingNode):
            match = next(((k, v) for k, v in node.value if k.value == str(key)), None)
            if match is None:
                return line
            # The key's line: a block mapping or list value starts on the line after its key.
            line = match[0].start_mark.line + 1
            node = match[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def read_yaml_sections(text: str, source: str) -> tuple[dict[str, Any], yaml.Node | None]:
    """(data, node tree) of a YAML file of sections (empty: no sections); `ConfigError` naming
    `source` and the line when it is not valid YAML or not a mapping."""
    try:
        data = yaml.safe_load(text)
        root = yaml.compose(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        raise ConfigError(f"{where}: not valid YAML: {getattr(error, 'problem', error)}") from None
    if data is None:  # an empty file: all defaults
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data, root


def parse_config(text: str, source: str = "<string>", overrides: dict[str, Any] | None = None) -> RunConfig:
    """Validate YAML `text` (plus dotted-key `overrides`) into a `RunConfig`."""
    data, root = read_yaml_sections(text, source)
    overridden = {tuple(dotted.split(".")): dotted for dotted in overrides or {}}
    for dotted, value in (overrides or {}).items():
        target = data
        *parents, leaf = dotted.split(".")
        for part in parents:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ConfigError(f"override {dotted}: {part} is not a section")
        target[leaf] = value
    try:
        return RunConfig.model_validate(data)
    except ValidationError as error:
        problems = []
        for item in error.errors():
            loc = tuple(item["loc"])
            line = line_of(root, loc)
            where = f"{source}:{line}" if line else source
            named = tuple(map(str, loc))
            override = next(  # the override at or under the failing field (a section's own check)
                (d for p, d in overridden.items() if named[: len(p)] == p or (named and p[: len(named)] == named)), None
            )
            if override is not None:  # the bad value came from an override, not from the file
                where = f"override {override}"
            field = ".".join(map(str, loc)) or "(top level)"
            reason = item["msg"]
            if item["type"] == "extra_forbidden":
                reason = "unknown key (check the spelling; see the configuration reference in docs/configuration.md)"
            elif "input" in item and not isinstance(item["input"], dict):
                reason += f" (got {item['input']!r})"
            problems.append(f"{where}: {field}: {reason}")
        raise ConfigError("\n".join(problems)) from None


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Load a run configuration file (the embedded demo default when `path` is None)."""
    path = Path(path) if path else DEFAULT_CONFIG
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"{path}: cannot read the configuration file: {error.strerror}") from None
    return parse_config(text, str(path), overrides)


def _nested_models(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models a field may hold (directly, in a union, or as tuple/list items)."""
    found, pending = [], [annotation]
    while pending:
        candidate = pending.pop(0)
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            found.append(candidate)
        else:
            pending.extend(get_args(candidate))
    return found


def _reference_section(path: str, model: type[BaseModel], lines: list[str]) -> None:
    nested: list[tuple[str, type[BaseModel]]] = []
    lines += [
        f"**`{path}`** ({model.__name__}) — {model.__doc__.strip().splitlines()[0]}",
        "",
        "| key | default | meaning |",
        "|---|---|---|",
    ]
    for name, field in model.model_fields.items():
        description = " ".join((field.description or "").split()).replace("|", "\\|")
        models = _nested_models(field.annotation)
        if models:
            is_list = get_origin(field.annotation) in (tuple, list)
            child = f"{path}.{name}" + ("[]" if is_list else "")
            nested += [(child, model) for model in models]
            shown = "`[]`" if is_list else ("—" if field.default is None else f"see `{child}`")
        else:
            default = field.default
            shown = (
                "—"
                if default is None or default is PydanticUndefined
                else (f"`{list(default)}`" if isinstance(default, tuple) else f"`{default}`")
            )
        lines.append(f"| `{field.alias or name}` | {shown} | {description} |")
    lines.append("")
    for child, inner in nested:
        _reference_section(child, inner, lines)


def reference_markdown() -> str:
    """The configuration reference (docs/configuration.md embeds it; a test keeps the two in sync)."""
    lines: list[str] = []
    for section, info in RunConfig.model_fields.items():
        for model in _nested_models(info.annotation):  # a section that may be absent: `X | None`
            _reference_section(section, model, lines)
    return "\n".join(lines).rstrip() + "\n"
