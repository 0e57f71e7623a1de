"""The training session applies the `prompt:` section: a model without a chat template is refused
when the session loads it (naming the field, the model and the fix), and an in-process rollout
encodes prompts with the chat template and ends responses at the stop strings."""

from __future__ import annotations

import pytest

from infra.run.config import parse_config
from infra.run.session import TrainingSession
from rl.generation import FINISH_STOP
from rl.models import build_tiny_llama, save_model
from rl.prompts import encode_prompt
from rl.rollout import read_samples
from tests.helpers import tiny_run, tiny_shape

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
STOPS = ["1", "2", "3", "4", "5"]


def config_for(tmp_path, model, **prompt):
    overrides = tiny_run(
        model,
        tmp_path,
        steps=None,
        overrides={
            "run.torch_threads": 1,
            "rollout.prompts_per_step": 2,
            "rollout.group_size": 2,
            "rollout.max_new_tokens": 16,
            "eval.size": 4,
            "ledger.url": f"sqlite:///{tmp_path / 'ledger.db'}",
            **{f"prompt.{k}": v for k, v in prompt.items()},
        },
    )
    return parse_config("", overrides=overrides)


def tiny_model(path, chat_template: str | None):
    model, tokenizer = build_tiny_llama(tiny_shape(smallest=True))
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    save_model(model, tokenizer, path)
    return path


def test_a_model_without_a_chat_template_is_refused_before_any_work(tmp_path):
    model = tiny_model(tmp_path / "plain", None)
    with pytest.raises(ValueError) as info:
        TrainingSession(config_for(tmp_path, model, chat_template=True))
    message = str(info.value)
    assert "prompt.chat_template" in message and str(model) in message and "rlboost import-model" in message
    assert not (tmp_path / "ledger.db").exists()  # the ledger was never opened


def test_in_process_rollout_uses_the_chat_template_and_stops(tmp_path):
    model = tiny_model(tmp_path / "chat", TEMPLATE)
    session = TrainingSession(config_for(tmp_path, model, chat_template=True, system_prompt="Add.", stop=STOPS))
    try:
        samples = read_samples(session.rollout(1)["path"])
        records = session._records()
        tokenizer = session.tokenizer
        stopped = 0
        for sample in samples:
            assert sample.prompt_ids == encode_prompt(tokenizer, records[sample.group].prompt, session.config.prompt)
            text = tokenizer.decode(sample.response_ids, skip_special_tokens=True)
            if sample.finish_reason == FINISH_STOP and sample.response_ids[-1] != tokenizer.eos_token_id:
                stopped += 1
                assert text[-1] in STOPS
            assert not any(s in tokenizer.decode(sample.response_ids[:-1], skip_special_tokens=True) for s in STOPS)
        assert stopped >= 1
        assert tokenizer.decode(samples[0].prompt_ids, skip_special_tokens=True).startswith("<system>Add.\n<user>")
        assert 0.0 <= session.evaluate() <= 1.0  # evaluation encodes and stops the same way
    finally:
        session.close()
