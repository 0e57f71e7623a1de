"""Tool-call formats: how a model's turn calls a tool, and how the result is written back.

* `TextToolFormat`, the tiny model's plain text: the turn ends with ``<call>NAME {json}</call>``
  (the stop string ``</call>`` ends it) and the result follows as ``<result>TEXT</result>``.
* `ChatTemplateToolFormat`, instruct models: the turn ends with the chat template's call
  convention, ``<tool_call>{"name": .., "arguments": {..}}</tool_call>`` (SmolLM2, Qwen, Hermes);
  a result is rendered once, by the tokenizer's `apply_chat_template`, as the text that appending a
  `tool` message adds after the assistant's turn, plus the next assistant generation prompt. A
  template that cannot render a tool message, or renders calls in another convention, is refused
  when the format is made (`ToolFormatError`, one line).

Both are pure text; the tokenizer is the caller's (no torch import). `make_tool_format` picks one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from rl.environments.protocol import ToolCall, ToolCallError, ToolFormat

CALL_OPEN, CALL_CLOSE = "<call>", "</call>"
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"
CHAT_CALL_OPEN, CHAT_CALL_CLOSE = "<tool_call>", "</tool_call>"
_TEXT_CALL = re.compile(r"\s*(?P<name>[A-Za-z_][A-Za-z0-9_]*)\s*(?P<arguments>.*?)\s*", re.DOTALL)
_TURN = "\x1frlboost-turn\x1f"
"""Stands for the model's turn in the conversation rendered to find a tool message's suffix."""
_RESULT = "\x1frlboost-result\x1f"
_PROBE = "rlboost_probe_tool"


class ToolFormatError(ValueError):
    """A tokenizer whose chat template cannot carry tool calls and results; says why and the fix."""


def _trailing_call(turn_text: str, open_marker: str, close_marker: str) -> str | None:
    """The text between the call markers that end `turn_text` (trailing whitespace allowed);
    None when the turn does not end with `close_marker`."""
    text = turn_text.rstrip()
    if not text.endswith(close_marker):
        return None
    start = text.rfind(open_marker, 0, len(text) - len(close_marker))
    if start < 0:
        raise ToolCallError(f"the turn ends with {close_marker} but has no {open_marker}")
    return text[start + len(open_marker) : len(text) - len(close_marker)]


def _json_object(text: str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ToolCallError(f"{what}: not JSON ({error.msg} at character {error.pos})") from None
    if not isinstance(value, dict):
        raise ToolCallError(f"{what}: not a JSON object but {type(value).__name__}")
    return value


def compact_json(value: Any) -> str:
    """JSON without spaces (the tiny model's demonstrations write arguments this way)."""
    return json.dumps(value, separators=(",", ":"))


class TextToolFormat(ToolFormat):
    """``<call>NAME {json arguments}</call>`` ends a turn; ``<result>TEXT</result>`` answers it."""

    stop = (CALL_CLOSE,)

    def parse(self, turn_text: str) -> ToolCall | None:
        body = _trailing_call(turn_text, CALL_OPEN, CALL_CLOSE)
        if body is None:
            return None
        match = _TEXT_CALL.fullmatch(body)
        if match is None:
            raise ToolCallError(f"a call is {CALL_OPEN}NAME {{json arguments}}{CALL_CLOSE}, got {body[:60]!r}")
        arguments = match["arguments"]
        return ToolCall(match["name"], _json_object(arguments, "arguments") if arguments else {})

    def render(self, result: str) -> str:
        return f"{RESULT_OPEN}{result}{RESULT_CLOSE}"

    def call_text(self, name: str, arguments: Mapping[str, Any]) -> str:
        """How a turn writes the call (demonstrations): ``<call>calc {"expr":"1+2"}</call>``."""
        return f"{CALL_OPEN}{name} {compact_json(dict(arguments))}{CALL_CLOSE}"


class ChatTemplateToolFormat(ToolFormat):
    """Tool calls in a chat template's convention; results rendered by `apply_chat_template`.

    `tokenizer` is a Hugging Face tokenizer with a chat template. Made once per worker; refuses
    (`ToolFormatError`) a template that cannot render a `tool` message after an assistant turn, or
    one that renders an assistant's tool call other than between `call_open` and `call_close` (a
    template that drops tool calls, as SmolLM2's ChatML, renders the turn's call as its text).
    """

    def __init__(self, tokenizer: Any, call_open: str = CHAT_CALL_OPEN, call_close: str = CHAT_CALL_CLOSE) -> None:
        self.tokenizer = tokenizer
        self.call_open, self.call_close = call_open, call_close
        self.stop = (call_close,)
        _check_template(self)
        self.renders_tools = _renders(self, [{"role": "user", "content": "?"}], tools=[_probe_schema()])
        """Whether the template writes `tools=` schemas into the prompt itself (else use `system_prompt`)."""

    def render_text(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> str:
        """`messages` rendered by the chat template as text."""
        text = self.tokenizer.apply_chat_template(list(messages), tokenize=False, **kwargs)
        assert isinstance(text, str), "apply_chat_template(tokenize=False) returns text"
        return text

    def parse(self, turn_text: str) -> ToolCall | None:
        body = _trailing_call(turn_text, self.call_open, self.call_close)
        if body is None:
            return None
        try:
            value = json.loads(body)
        except json.JSONDecodeError as error:
            raise ToolCallError(f"the tool call: not JSON ({error.msg} at character {error.pos})") from None
        if isinstance(value, list):  # SmolLM2's function-calling data writes a list of calls
            if len(value) != 1:
                raise ToolCallError(f"call one tool per turn, got {len(value)} calls")
            value = value[0]
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            raise ToolCallError('a tool call is {"name": "<tool>", "arguments": {...}}')
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):  # OpenAI's convention: the arguments as a JSON string
            arguments = _json_object(arguments, "arguments")
        if not isinstance(arguments, dict):
            raise ToolCallError(f"arguments: not a JSON object but {type(arguments).__name__}")
        return ToolCall(value["name"], arguments)

    def render(self, result: str) -> str:
        """What a `tool` message with `result` adds after the assistant's turn (closing that turn),
        plus the generation prompt of the next assistant turn."""
        turn = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _TURN}]
        text = self.render_text([*turn, {"role": "tool", "content": result}], add_generation_prompt=True)
        return text[text.index(_TURN) + len(_TURN) :]

    def call_text(self, name: str, arguments: Mapping[str, Any]) -> str:
        """How a turn writes the call: ``<tool_call>{"name": "calc", "arguments": {...}}</tool_call>``."""
        return f"{self.call_open}{json.dumps({'name': name, 'arguments': dict(arguments)})}{self.call_close}"

    def system_prompt(self, schemas: Sequence[Mapping[str, Any]]) -> str:
        """A system message describing the tools and the call convention, for a template that does
        not render `tools=` itself (Hermes' wording, which SmolLM2 and Qwen were tuned on)."""
        tools = "\n".join(json.dumps(schema) for schema in schemas)
        return (
            "You may call one of these tools:\n<tools>\n" + tools + "\n</tools>\n"
            f'To call a tool, end your turn with {self.call_open}{{"name": <tool name>, "arguments": <JSON object>}}'
            f"{self.call_close}; its result comes back in the next message. Give the final answer without a tool call."
        )


def _probe_schema() -> dict[str, Any]:
    parameters = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    return {"type": "function", "function": {"name": _PROBE, "description": "probe", "parameters": parameters}}


def _renders(format: ChatTemplateToolFormat, messages: list[dict[str, Any]], **kwargs: Any) -> bool:
    """Whether rendering `messages` writes the probe tool's name (False if the template raises)."""
    try:
        return _PROBE in format.render_text(messages, **kwargs)
    except Exception:  # a template's raise_exception or a jinja error: it cannot render this
        return False


def _check_template(format: ChatTemplateToolFormat) -> None:
    refuse = (
        "choose an instruct model whose chat template renders tool messages (SmolLM2, Qwen2.5), "
        "or prompt.chat_template: false for the text format"
    )
    if not getattr(format.tokenizer, "chat_template", None):
        raise ToolFormatError(f"the tokenizer has no chat template; {refuse}")
    turn = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _TURN}]
    try:
        before = format.render_text(turn)
        after = format.render_text([*turn, {"role": "tool", "content": _RESULT}], add_generation_prompt=True)
    except Exception as error:  # the template's own raise_exception, or a jinja error
        reason = " ".join(str(error).split())
        raise ToolFormatError(f"the chat template cannot render a tool message ({reason}); {refuse}") from None
    cut = after.find(_TURN)
    if cut < 0 or _RESULT not in after[cut:]:
        raise ToolFormatError(f"the chat template drops tool messages (the tool's result is not rendered); {refuse}")
    cut += len(_TURN)
    if before[:cut] != after[:cut]:
        raise ToolFormatError(f"the chat template rewrites the conversation before a tool message; {refuse}")
    call = {"type": "function", "function": {"name": _PROBE, "arguments": {"x": 1}}}
    calling = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    try:
        rendered = format.render_text(calling)
    except Exception as error:
        reason = " ".join(str(error).split())
        raise ToolFormatError(
            f"the chat template cannot render an assistant's tool call ({reason}); {refuse}"
        ) from None
    name = rendered.find(_PROBE)
    if name >= 0 and format.call_open not in rendered[:name]:
        shown = " ".join(rendered[max(0, name - 40) : name + 40].split())
        raise ToolFormatError(
            f"the chat template writes tool calls as {shown!r}, not between {format.call_open} and "
            f"{format.call_close}; give ChatTemplateToolFormat the template's call markers"
        )


def make_tool_format(chat_template: bool, tokenizer: Any = None) -> ToolFormat:
    """The format of a run: the chat template's (`prompt.chat_template: true`, with `tokenizer`)
    or the plain text one."""
    if chat_template:
        return ChatTemplateToolFormat(tokenizer)
    return TextToolFormat()
