"""Tool-call formats: the tiny model's text protocol, and chat templates (hand-written ones and
SmolLM2-135M-Instruct's own) that render a tool result once, as the suffix a `tool` message adds;
templates that cannot carry tool calls are refused in one line."""

from __future__ import annotations

import pytest

from rl.environments.protocol import ToolCall, ToolCallError
from rl.environments.tool_calls import (
    ChatTemplateToolFormat,
    TextToolFormat,
    ToolFormatError,
    make_tool_format,
)
from rl.tokenizer import build_char_tokenizer

TEXT = TextToolFormat()

HERMES = """{%- if tools %}<|im_start|>system
Tools:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == "assistant" %}<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls or [] %}<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
"""Qwen2.5's convention, shortened: calls in <tool_call>, results as a user turn in <tool_response>."""

CHATML = """{% for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
"""SmolLM2's: every role rendered alike, tool calls dropped (the call is the assistant's text)."""

STRICT = """{% for message in messages %}{% if message.role not in ["system", "user", "assistant"] %}
{{- raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}{% endif %}
[{{ message.role }}] {{ message.content }}
{% endfor %}"""
DROPS_TOOLS = """{% for message in messages %}{% if message.role in ["user", "assistant"] %}
[{{ message.role }}] {{ message.content }}
{% endif %}{% endfor %}"""
REWRITES = """{{ messages | length }} messages
{% for message in messages %}[{{ message.role }}] {{ message.content }}
{% endfor %}"""
MISTRAL = """{% for message in messages %}{% if message.tool_calls %}[TOOL_CALLS]{{ message.tool_calls | tojson }}
{% elif message.role == "tool" %}[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]
{% else %}[{{ message.role }}] {{ message.content }}
{% endif %}{% endfor %}"""


def tokenizer_with(template: str | None):
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = template
    return tokenizer


@pytest.mark.parametrize(
    ("turn", "call"),
    [
        ('<call>calc {"expr":"417*36"}</call>', ToolCall("calc", {"expr": "417*36"})),
        ('I will compute. <call> calc  {"expr": "1+2"} </call>\n', ToolCall("calc", {"expr": "1+2"})),
        ("<call>now</call>", ToolCall("now", {})),
        ("15012", None),
        ('<call>calc {"expr":"1"}</call> so it is 1', None),  # a call not ending the turn: an answer
    ],
)
def test_text_format_parses_the_call_that_ends_a_turn(turn: str, call: ToolCall | None) -> None:
    assert TEXT.parse(turn) == call


@pytest.mark.parametrize(
    ("turn", "reason"),
    [
        ('<call>calc {"expr":</call>', "arguments: not JSON"),
        ('<call>calc ["417*36"]</call>', "arguments: not a JSON object but list"),
        ("<call>3calc</call>", "a call is <call>NAME {json arguments}</call>"),
        ('calc {"expr":"1"}</call>', "ends with </call> but has no <call>"),
    ],
)
def test_text_format_names_what_is_wrong_with_a_malformed_call(turn: str, reason: str) -> None:
    with pytest.raises(ToolCallError, match=reason.replace("[", r"\[")):
        TEXT.parse(turn)


def test_text_format_renders_results_and_calls_and_ends_turns_at_the_call() -> None:
    assert TEXT.stop == ("</call>",)
    assert TEXT.render("15012") == "<result>15012</result>"
    assert TEXT.call_text("calc", {"expr": "1+2"}) == '<call>calc {"expr":"1+2"}</call>'
    tokenizer = build_char_tokenizer()
    ids = TEXT.encode("42", tokenizer)
    assert tokenizer.decode(ids) == "<result>42</result>" and tokenizer.bos_token_id not in ids
    assert isinstance(make_tool_format(False), TextToolFormat)


@pytest.mark.parametrize("template", [HERMES, CHATML])
def test_a_result_renders_as_what_a_tool_message_adds_to_the_conversation(template: str) -> None:
    tokenizer = tokenizer_with(template)
    format = ChatTemplateToolFormat(tokenizer)
    turn = 'Let me check. <tool_call>{"name": "calc", "arguments": {"expr": "417*36"}}</tool_call>'
    conversation = [{"role": "user", "content": "What is 417*36?"}, {"role": "assistant", "content": turn}]
    whole = tokenizer.apply_chat_template(
        [*conversation, {"role": "tool", "content": "15012"}], tokenize=False, add_generation_prompt=True
    )
    assert whole.endswith(turn + format.render("15012"))
    assert format.render("15012").endswith("<|im_start|>assistant\n")
    assert format.stop == ("</tool_call>",)
    assert format.parse(turn) == ToolCall("calc", {"expr": "417*36"})
    assert format.renders_tools == (template == HERMES)


def test_the_hermes_result_suffix_is_exact() -> None:
    format = ChatTemplateToolFormat(tokenizer_with(HERMES))
    expected = "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert format.render("42") == expected


@pytest.mark.parametrize(
    ("turn", "call"),
    [
        ('<tool_call>{"name": "calc", "arguments": {"expr": "2*3"}}</tool_call>', ToolCall("calc", {"expr": "2*3"})),
        ('<tool_call>[{"name": "calc", "arguments": {"expr": "2*3"}}]</tool_call>', ToolCall("calc", {"expr": "2*3"})),
        (
            '<tool_call>{"name": "calc", "arguments": "{\\"expr\\": \\"2*3\\"}"}</tool_call>',
            ToolCall("calc", {"expr": "2*3"}),
        ),
        ('<tool_call>{"name": "now"}</tool_call>', ToolCall("now", {})),
        ("The answer is 6.", None),
    ],
)
def test_chat_format_parses_the_template_convention(turn: str, call: ToolCall | None) -> None:
    assert ChatTemplateToolFormat(tokenizer_with(HERMES)).parse(turn) == call


@pytest.mark.parametrize(
    ("turn", "reason"),
    [
        ("<tool_call>calc(2*3)</tool_call>", "the tool call: not JSON"),
        ('<tool_call>[{"name": "a"}, {"name": "b"}]</tool_call>', "call one tool per turn, got 2 calls"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'a tool call is {"name"'),
        ('<tool_call>{"name": "calc", "arguments": [1]}</tool_call>', "arguments: not a JSON object but list"),
    ],
)
def test_chat_format_names_what_is_wrong_with_a_malformed_call(turn: str, reason: str) -> None:
    with pytest.raises(ToolCallError, match=reason.replace("[", r"\[").replace("{", r"\{")):
        ChatTemplateToolFormat(tokenizer_with(HERMES)).parse(turn)


def test_chat_format_writes_calls_and_describes_tools() -> None:
    format = ChatTemplateToolFormat(tokenizer_with(CHATML))
    call = format.call_text("calc", {"expr": "1+2"})
    assert format.parse(call) == ToolCall("calc", {"expr": "1+2"})
    prompt = format.system_prompt([{"type": "function", "function": {"name": "calc"}}])
    assert '"name": "calc"' in prompt and "<tool_call>" in prompt and "\n" not in prompt.splitlines()[-1]


@pytest.mark.parametrize(
    ("template", "reason"),
    [
        (None, "the tokenizer has no chat template"),
        (STRICT, "cannot render a tool message (Conversation roles must alternate"),
        (DROPS_TOOLS, "drops tool messages"),
        (REWRITES, "rewrites the conversation before a tool message"),
        (MISTRAL, "writes tool calls as"),
    ],
)
def test_a_template_that_cannot_carry_tool_calls_is_refused_in_one_line(template: str | None, reason: str) -> None:
    with pytest.raises(ToolFormatError) as refused:
        make_tool_format(True, tokenizer_with(template))
    message = str(refused.value)
    assert reason in message and "\n" not in message, message
    assert message.endswith(("prompt.chat_template: false for the text format", "the template's call markers"))


@pytest.mark.integration  # loading the GGUF's tokenizer takes ~25 s (as tests/rl/test_models.py's)
def test_smollm2_chat_template_renders_a_tool_result_as_the_tokens_of_the_whole_conversation() -> None:
    pytest.importorskip("gguf", reason="install the gguf extra: pip install 'rlboost[gguf]'")
    from rl.models import load_tokenizer, smollm2_gguf

    try:
        tokenizer = load_tokenizer(*smollm2_gguf())
    except FileNotFoundError as error:
        pytest.skip(str(error))
    format = ChatTemplateToolFormat(tokenizer)
    assert format.render("15012") == "<|im_end|>\n<|im_start|>tool\n15012<|im_end|>\n<|im_start|>assistant\n"
    turn = '<tool_call>{"name": "calc", "arguments": {"expr": "417*36"}}</tool_call>'
    conversation = [{"role": "user", "content": "What is 417*36?"}, {"role": "assistant", "content": turn}]
    whole = tokenizer.apply_chat_template(
        [*conversation, {"role": "tool", "content": "15012"}], add_generation_prompt=True
    )
    whole = whole if isinstance(whole, list) else whole["input_ids"]
    ids = format.encode("15012", tokenizer)
    assert list(whole[-len(ids) :]) == ids  # the suffix's tokens are the whole rendering's own
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert format.parse(f"Sure. {turn}") == ToolCall("calc", {"expr": "417*36"})
