"""Importing models (rl/model_import.py): SmolLM2's GGUF loads through `load_model` and generates
(loaded once for the module, ~30 s) and becomes a plain HF directory (converted once, ~30 s) that
`load_model` loads and generates with, with the same logits as the GGUF-loaded model and its chat
template; an HF directory is re-saved in another dtype; bad sources and outputs are refused with
what is wrong."""

from __future__ import annotations

import json

import pytest
import torch

from rl.generation import GenerationRequest, SamplingParams
from rl.model_import import SMOLLM2, ModelImportError, has_chat_template, import_model, resolve_source
from rl.models import load_model, smollm2_gguf
from rl.prompts import encode_prompt
from tests.helpers import hf_on_cpu, save_tiny_model


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    pytest.importorskip("gguf", reason="install the gguf extra: pip install 'rlboost[gguf]'")
    try:
        smollm2_gguf()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    output = tmp_path_factory.mktemp("import") / "smollm2"
    result = import_model(SMOLLM2, output)
    print(f"\nSmolLM2 GGUF -> HF directory in {result.seconds:.1f} s")
    return result


@pytest.fixture(scope="module")
def smollm2_from_gguf():
    """SmolLM2-135M loaded from its GGUF file (model, tokenizer): read it, don't train it."""
    pytest.importorskip("gguf", reason="install the gguf extra: pip install 'rlboost[gguf]'")
    try:
        directory, name = smollm2_gguf()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    return load_model(directory, gguf_file=name)


@pytest.mark.integration
def test_smollm2_gguf_loads_and_generates(smollm2_from_gguf):
    model, tokenizer = smollm2_from_gguf
    assert model.config.model_type == "llama"
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True)
    prompt_ids = prompt if isinstance(prompt, list) else prompt["input_ids"]
    engine = hf_on_cpu(model, tokenizer.eos_token_id, tokenizer.pad_token_id or tokenizer.eos_token_id)
    [result] = engine.generate([GenerationRequest("q", list(prompt_ids), 12, sampling=SamplingParams(greedy=True))])
    text = tokenizer.decode(result.token_ids, skip_special_tokens=True)
    assert len(result.token_ids) > 0 and text.strip(), f"empty generation: {result}"


@pytest.mark.integration
def test_smollm2_imports_to_safetensors_with_its_chat_template(smollm2):
    output = smollm2.output
    assert (output / "model.safetensors").is_file() and (output / "config.json").is_file()
    assert not list(output.glob("*.gguf")) and not output.with_name(output.name + ".tmp").exists()
    assert "quantization_config" not in json.loads((output / "config.json").read_text())
    assert smollm2.chat_template and has_chat_template(output)
    assert smollm2.dtype == "fp32" and 130e6 < smollm2.parameters < 140e6
    assert smollm2.source.endswith(".gguf")


@pytest.mark.integration
def test_imported_smollm2_matches_the_gguf_logits_and_generates(smollm2, smollm2_from_gguf):
    from rl.config import PromptConfig

    model, tokenizer = load_model(smollm2.output)
    reference, reference_tokenizer = smollm2_from_gguf
    config = PromptConfig(chat_template=True)
    prompt = encode_prompt(tokenizer, "Sam has 7 apples and buys 5 more. How many apples now?", config)
    assert prompt == encode_prompt(
        reference_tokenizer, "Sam has 7 apples and buys 5 more. How many apples now?", config
    )
    with torch.no_grad():
        got = model(torch.tensor([prompt])).logits
        want = reference(torch.tensor([prompt])).logits
    assert torch.equal(got, want)
    engine = hf_on_cpu(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    [result] = engine.generate([GenerationRequest("q", prompt, 16, sampling=SamplingParams(greedy=True))])
    assert tokenizer.decode(result.token_ids, skip_special_tokens=True).strip()


def test_an_hf_directory_is_resaved_in_another_dtype(tmp_path):
    source = save_tiny_model(tmp_path / "tiny")
    result = import_model(source, tmp_path / "bf16", dtype="bf16")
    model, _ = load_model(result.output, dtype=torch.bfloat16)
    original, _ = load_model(source)
    from safetensors import safe_open

    with safe_open(str(result.output / "model.safetensors"), "pt") as weights:
        assert {weights.get_tensor(k).dtype for k in weights.keys()} == {torch.bfloat16}
    for key, value in original.state_dict().items():
        assert torch.equal(model.state_dict()[key], value.to(torch.bfloat16))
    assert not result.chat_template  # the char tokenizer has none


def test_bad_sources_and_outputs_are_refused(tmp_path):
    with pytest.raises(ModelImportError, match="does not exist"):
        resolve_source(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelImportError, match="holds no model"):
        resolve_source(tmp_path / "empty")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ModelImportError, match="not a .gguf file"):
        resolve_source(tmp_path / "notes.txt")
    source = save_tiny_model(tmp_path / "tiny")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(ModelImportError, match="not empty .*--force"):
        import_model(source, tmp_path / "taken")
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"
    with pytest.raises(ModelImportError, match="--dtype"):
        import_model(source, tmp_path / "out", dtype="int4")
    with pytest.raises(ModelImportError, match="own directory"):
        import_model(source, source, force=True)
    result = import_model(source, tmp_path / "taken", force=True)
    assert not (result.output / "keep.txt").exists() and (result.output / "config.json").is_file()
