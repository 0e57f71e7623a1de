"""From a prompt's text to the model's input ids: plain, or through the tokenizer's chat template.

`encode_prompt` is the one place every rollout path (in-process rollout and evaluation, the fabric's
token log) turns a `PromptRecord`'s text into ids, driven by the `prompt:` section
(`rl.config.PromptConfig`). `check_chat_template` is called when a run loads its model, so a model
without a chat template fails before any work when the config asks for one.
"""

from __future__ import annotations

from pathlib import Path

from rl.config import PromptConfig


def chat_messages(text: str, config: PromptConfig) -> list[dict[str, str]]:
    """The chat of one prompt: an optional system message, then the prompt as the user's message."""
    system = [{"role": "system", "content": config.system_prompt}] if config.system_prompt is not None else []
    return [*system, {"role": "user", "content": text}]


def check_chat_template(tokenizer, config: PromptConfig, model_path: str | Path) -> None:
    """Raise ValueError (naming the field, the model and the fix) if the config needs a chat
    template the tokenizer does not carry."""
    if config.chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"prompt.chat_template is true but the tokenizer of the model at {model_path} has no chat "
            "template: use an instruct model that ships one (e.g. `rlboost import-model smollm2 --output DIR`, "
            "then model.path: DIR), or set prompt.chat_template: false"
        )


def encode_prompt(tokenizer, text: str, config: PromptConfig) -> list[int]:
    """The input ids of prompt `text`: `tokenizer(text)`, or with `config.chat_template` the chat
    (`chat_messages`) rendered with the generation prompt, the assistant's turn opened."""
    if not config.chat_template:
        return list(tokenizer(text).input_ids)
    check_chat_template(tokenizer, config, getattr(tokenizer, "name_or_path", "?"))
    rendered = tokenizer.apply_chat_template(chat_messages(text, config), tokenize=False, add_generation_prompt=True)
    # The template writes any special tokens (bos, turn markers) itself.
    return list(tokenizer(rendered, add_special_tokens=False).input_ids)
