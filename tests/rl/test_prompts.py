"""Prompt encoding (rl/prompts.py) and the `prompt:` section: plain text, a chat template with and
without a system prompt, a missing template named with the fix, and the same ids on every path
(in-process requests, evaluation)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rl.config import PromptConfig, RolloutConfig
from rl.datasets import PromptRecord
from rl.prompts import chat_messages, check_chat_template, encode_prompt
from rl.rollout import build_requests
from rl.tokenizer import build_char_tokenizer

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
"""A small chat template in the usual Jinja form (role markers written as text)."""


@pytest.fixture
def chat_tokenizer():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def text_of(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids)


def test_plain_prompts_are_tokenized_as_before():
    tokenizer = build_char_tokenizer()
    assert encode_prompt(tokenizer, "12+34=", PromptConfig()) == tokenizer("12+34=").input_ids


def test_chat_template_wraps_the_prompt_as_a_user_message_and_opens_the_answer(chat_tokenizer):
    ids = encode_prompt(chat_tokenizer, "12+34=", PromptConfig(chat_template=True))
    assert text_of(chat_tokenizer, ids) == "<user>12+34=\n<assistant>"
    assert chat_tokenizer.bos_token_id not in ids  # the template owns special tokens, none added


def test_system_prompt_comes_first(chat_tokenizer):
    config = PromptConfig(chat_template=True, system_prompt="Be brief.")
    assert chat_messages("q", config) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "q"},
    ]
    ids = encode_prompt(chat_tokenizer, "q", config)
    assert text_of(chat_tokenizer, ids) == "<system>Be brief.\n<user>q\n<assistant>"


def test_a_model_without_a_chat_template_is_refused_with_the_fix(tmp_path):
    tokenizer = build_char_tokenizer()
    with pytest.raises(ValueError) as info:
        check_chat_template(tokenizer, PromptConfig(chat_template=True), tmp_path / "model")
    message = str(info.value)
    assert "prompt.chat_template" in message and str(tmp_path / "model") in message
    assert "rlboost import-model" in message
    check_chat_template(tokenizer, PromptConfig(), tmp_path)  # not asked for: fine
    with pytest.raises(ValueError, match="prompt.chat_template"):
        encode_prompt(tokenizer, "q", PromptConfig(chat_template=True))


def test_prompt_config_validation():
    with pytest.raises(ValidationError, match="system_prompt needs chat_template"):
        PromptConfig(system_prompt="hi")
    with pytest.raises(ValidationError, match="non-empty"):
        PromptConfig(stop=("####", ""))
    assert PromptConfig(stop=["\n\n"]).stop == ("\n\n",)


def test_build_requests_use_the_prompt_section(chat_tokenizer):
    records = [PromptRecord("1+2=", "3", 1), PromptRecord("4+5=", "9", 2)]
    prompt = PromptConfig(chat_template=True, stop=("\n",))
    requests = build_requests(chat_tokenizer, records, 3, RolloutConfig(group_size=2), 0, prompt)
    assert [r.prompt_ids for r in requests] == [
        encode_prompt(chat_tokenizer, rec.prompt, prompt) for rec in records for _ in range(2)
    ]
    assert all(r.sampling.stop == ("\n",) for r in requests)
    plain = build_requests(chat_tokenizer, records, 3, RolloutConfig(group_size=2), 0)
    assert plain[0].prompt_ids == chat_tokenizer("1+2=").input_ids and plain[0].sampling.stop == ()
