"""Every configuration shipped in deployments/configs/ loads (a key renamed in the code and not in
a shipped file fails here, not on a user's machine), and the tool call the SmolLM2 calculator
configuration shows its model in the system message is one the chat format parses into a call the
calculator answers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from infra.run.config import load_config
from rl.environments.calculator import TOOL, calc
from rl.environments.tool_calls import CHAT_CALL_CLOSE, CHAT_CALL_OPEN, ChatTemplateToolFormat
from rl.models import load_tokenizer, smollm2_gguf

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "deployments" / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.name)
def test_a_shipped_configuration_loads(path: Path) -> None:
    config = load_config(str(path), None)
    assert config.run.name


@pytest.mark.integration  # loading the GGUF's tokenizer takes 6-25 s (as tests/rl/test_tool_calls.py's)
def test_the_smollm2_calculators_system_message_shows_a_call_the_calculator_answers() -> None:
    (path,) = (path for path in CONFIGS if path.name == "smollm2-calculator.yaml")
    config = load_config(str(path), None)
    assert config.prompt.chat_template and config.environment is not None
    assert config.environment.name == "calculator" and config.prompt.system_prompt is not None
    shown = re.search(re.escape(CHAT_CALL_OPEN) + ".*?" + re.escape(CHAT_CALL_CLOSE), config.prompt.system_prompt)
    assert shown is not None, config.prompt.system_prompt
    chat = ChatTemplateToolFormat(load_tokenizer(*smollm2_gguf()))
    assert not chat.renders_tools  # why the system message shows the call: the template writes no tool schema
    call = chat.parse(f"I will use the tool. {shown.group(0)}")
    assert call is not None and call.name == TOOL
    assert calc(call.arguments["expr"]) == str(12 * 34)
