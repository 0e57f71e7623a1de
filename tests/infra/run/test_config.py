"""Tests for rl/config.py and infra/run/config.py: the demo file, strict validation, precise errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from infra.run.config import DEFAULT_CONFIG, ConfigError, RunConfig, load_config, parse_config

BASE = """\
run:
  name: t
  steps: 10
grpo:
  clip_eps: 0.2
  aggregation: token
optim:
  lr: 0.001
"""


def error_of(text: str, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(text, "cfg.yaml", **kwargs)
    return str(info.value)


def test_demo_file_loads_with_its_values():
    assert DEFAULT_CONFIG.name == "demo.yaml" and DEFAULT_CONFIG.exists()
    config = load_config()
    assert isinstance(config, RunConfig)
    assert config.run.steps == 250
    assert config.optim.micro_batch_size == 256
    assert config.pretrain.families == ("add",)
    assert config.pretrain.corpus_error_rate == pytest.approx(0.3)
    assert load_config(DEFAULT_CONFIG) == config


def test_empty_text_gives_defaults():
    assert parse_config("", "cfg.yaml") == RunConfig()


def test_unknown_nested_key_names_file_line_and_path():
    text = BASE + "rollout:\n  group_size: 4\n  grup_size: 4\n"
    message = error_of(text)
    assert message.startswith("cfg.yaml:11: rollout.grup_size: unknown key"), message


def test_unknown_key_with_a_block_value_points_at_the_key_line():
    text = "grpo:\n  nested:\n    x: 1\n"
    assert error_of(text).startswith("cfg.yaml:2: grpo.nested: unknown key")


def test_unknown_section():
    assert error_of(BASE + "rollouts:\n  group_size: 4\n").startswith("cfg.yaml:9: rollouts: unknown key")


def test_string_for_an_int():
    message = error_of(BASE.replace("steps: 10", "steps: ten"))
    assert message.startswith("cfg.yaml:3: run.steps: ")
    assert "integer" in message and "'ten'" in message


def test_out_of_range_value():
    message = error_of(BASE.replace("clip_eps: 0.2", "clip_eps: 1.5"))
    assert message == "cfg.yaml:5: grpo.clip_eps: Input should be less than 1 (got 1.5)"


def test_bad_literal():
    message = error_of(BASE.replace("aggregation: token", "aggregation: foo"))
    assert message.startswith("cfg.yaml:6: grpo.aggregation: ")
    assert "'token'" in message and "'sequence'" in message and "'foo'" in message


def test_bad_family():
    message = error_of(BASE + "data:\n  family: mul\n")
    assert message.startswith("cfg.yaml:9: data: ")
    assert "family" in message and "'mul'" in message


def test_bad_pretrain_family_and_head_dim():
    message = error_of("pretrain:\n  families: [add, div]\n")
    assert message.startswith("cfg.yaml:1: pretrain: ") and "div" in message
    message = error_of("model:\n  hidden_size: 64\n  num_heads: 4\n")
    assert message.startswith("cfg.yaml:1: model: ") and ">= 32" in message


def test_file_source_needs_paths():
    message = error_of(BASE + "data:\n  source: file\n")
    assert message.startswith("cfg.yaml:9: data: ") and "path" in message
    # With both paths it validates.
    config = parse_config(BASE + "data:\n  source: file\n  path: a.jsonl\n  eval_path: b.jsonl\n")
    assert config.data.path == Path("a.jsonl")


def test_list_element_error_names_the_index_and_its_line():
    message = error_of("optim:\n  betas:\n    - 0.9\n    - x\n")
    assert message.startswith("cfg.yaml:4: optim.betas.1: ")


def test_invalid_yaml_names_the_line():
    text = BASE + "rollout:\n  group_size: [4\n  max_new_tokens: 3\n"
    message = error_of(text)
    match = re.match(r"cfg\.yaml:(\d+): not valid YAML", message)
    assert match, message
    assert int(match.group(1)) in (10, 11, 12)
    message = error_of("run:\n  name: a\n\tsteps: 3\n")
    assert message.startswith("cfg.yaml:3: not valid YAML"), message


@pytest.mark.parametrize("text,kind", [("- 1\n- 2\n", "list"), ("[]\n", "list"), ("hello\n", "str"), ("3\n", "int")])
def test_top_level_must_be_a_mapping(text, kind):
    message = error_of(text)
    assert message.startswith("cfg.yaml: the top level must be a mapping") and kind in message


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope" / "run.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(missing)
    assert str(missing) in str(info.value)
    assert "No such file" in str(info.value)


def test_load_config_reports_the_real_file_name(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(BASE.replace("clip_eps: 0.2", "clip_eps: 1.5"))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}:5: grpo.clip_eps:")


def test_multiple_errors_are_reported_together():
    text = BASE.replace("steps: 10", "steps: -1").replace("aggregation: token", "aggregation: x")
    text += "rollout:\n  bogus: 1\n"
    lines = error_of(text).splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("cfg.yaml:3: run.steps: ")
    assert any(line.startswith("cfg.yaml:6: grpo.aggregation: ") for line in lines)
    assert any(line.startswith("cfg.yaml:10: rollout.bogus: unknown key") for line in lines)


def test_dotted_overrides_apply():
    config = parse_config(
        BASE,
        "cfg.yaml",
        overrides={"grpo.clip_eps": 0.3, "rollout.group_size": 3, "run.name": "x", "optim.lr": "0.5"},
    )
    assert config.grpo.clip_eps == pytest.approx(0.3)
    assert config.rollout.group_size == 3  # a section absent from the file is created
    assert config.run.name == "x"
    assert config.run.steps == 10  # untouched values stay
    assert config.optim.lr == pytest.approx(0.5)


def test_bad_override_is_named_as_an_override_not_a_file_line():
    message = error_of(BASE, overrides={"grpo.clip_eps": 1.5})
    assert message == "override grpo.clip_eps: grpo.clip_eps: Input should be less than 1 (got 1.5)"
    message = error_of(BASE, overrides={"grpo.unknown": 1})
    assert message.startswith("override grpo.unknown: grpo.unknown: unknown key")


def test_override_through_a_scalar_is_an_error():
    message = error_of(BASE, overrides={"run.name.first": "x"})
    assert "override run.name.first" in message


def test_sections_are_frozen():
    config = load_config()
    with pytest.raises(Exception):
        config.grpo.clip_eps = 0.5  # type: ignore[misc]


def test_prompt_section_errors_name_the_field():
    assert "cfg.yaml:1: prompt: Value error, system_prompt needs chat_template" in error_of(
        "prompt:\n  system_prompt: Be brief.\n"
    )
    assert "prompt: Value error, stop strings must be non-empty" in error_of("prompt:\n  stop: ['']\n")
    config = parse_config('prompt:\n  chat_template: true\n  system_prompt: Be brief.\n  stop: ["\\n\\n"]\n')
    assert config.prompt.chat_template and config.prompt.stop == ("\n\n",)
    assert parse_config("").prompt.stop == () and not parse_config("").prompt.chat_template


def test_reward_format_errors_name_the_field(tmp_path):
    message = error_of("reward:\n  format: '['\n")
    assert message.startswith("cfg.yaml:1: reward: Value error, format '[' is neither family, boxed, gsm8k nor")
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "q", "answer": "1"}\n')
    text = f"data:\n  source: file\n  path: {data}\n  eval_path: {data}\nreward:\n  format_weight: 0.5\n"
    assert "reward.format: 'family' needs data.source: arithmetic" in error_of(text)
    assert parse_config(text + "  format: gsm8k\n").reward.format_pattern(None).startswith("(?s)")


def test_the_smollm2_file_loads_with_a_vllm_engine_for_every_instance():
    config = load_config(DEFAULT_CONFIG.parent / "smollm2.yaml")
    assert config.prompt.chat_template and config.data.family == "words" and config.fabric.enabled
    spec = config.engine_spec()
    assert spec.kind == "vllm" and spec.vllm.max_model_len == 512
    assert {pool.engine_spec(spec).kind for pool in config.fabric.pools} == {"vllm"}


def test_the_trainers_machine_is_priced_once():
    """`ledger.trainer` beside a colocated reserved pool would count the trainer's machine twice."""
    trainer = "ledger:\n  trainer: {machine_type: a2-highgpu-1g, price_per_hour: 3.67}\n"
    assert parse_config(trainer).ledger.trainer.price_per_hour == 3.67  # no colocated pool
    demo = DEFAULT_CONFIG.read_text()
    with pytest.raises(ConfigError, match="pool 'reserved' is colocated.*Remove ledger.trainer"):
        parse_config(demo + trainer, "demo.yaml")
    assert load_config().ledger.trainer is None
