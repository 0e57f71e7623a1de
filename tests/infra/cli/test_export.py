"""`rlboost export`: a real run's checkpoint (a `TrainingSession` on the tiny model, two trained
steps, its checkpoints, identity and model record as a run writes them) exported as a PEFT adapter
directory that peft loads to the trainer's logits, as a merged model directory that transformers
(within 1e-4) and vLLM load, and a full run's as its model directory; an unknown run, a run without
a checkpoint or a model record, a damaged checkpoint and an output in the way exit 2 with one line,
having written nothing."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from infra.cli.app import app
from infra.run.config import parse_config
from infra.run.session import TrainingSession
from rl.lora import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE
from rl.model_import import has_chat_template
from rl.models import build_tiny_llama, save_model
from rl.trainer import TrainBatch
from tests.helpers import tiny_run, tiny_shape

runner = CliRunner()
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
PROBE = torch.tensor([[1, 14, 9, 23, 5, 31, 7, 12], [1, 40, 41, 42, 6, 60, 61, 3]])
"""Two token sequences whose logits the exported models must give as the trainer's policy does."""


def logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=PROBE).logits.float()


def batch(seed: int) -> TrainBatch:
    """Four responses with advantages of both signs: a step that moves the policy."""
    rng = torch.Generator().manual_seed(seed)
    prompts = [[1, *torch.randint(4, 60, (5,), generator=rng).tolist()] for _ in range(4)]
    responses = [torch.randint(4, 60, (6,), generator=rng).tolist() for _ in range(4)]
    return TrainBatch(prompts, responses, [[-2.0] * 6 for _ in range(4)], [1.0, -1.0, 0.5, -0.5])


def train_run(tmp_path, base, name: str, lora: dict | None) -> torch.Tensor:
    """A run of two trained steps, checkpointed after each (the driver's files as a run writes
    them); returns its policy's logits on PROBE at the last step."""
    overrides = tiny_run(
        base,
        tmp_path,
        name,
        steps=None,
        overrides={
            "fabric.enabled": False,
            "model.lora": lora,
            "optim.lr": 0.05,
            "run.torch_threads": 1,
            "eval.size": 4,
            "ledger.url": f"sqlite:///{tmp_path / 'ledger.db'}",
        },
    )
    session = TrainingSession(parse_config("", overrides=overrides))
    try:
        for step in (1, 2):
            session.trainer.train_step(batch(step))
            session.checkpoint()
        return logits(session.trainer.model)
    finally:
        session.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(runs directory, base model, {run name: its policy's logits}): a LoRA run and a full one."""
    tmp_path = tmp_path_factory.mktemp("export")
    model, tokenizer = build_tiny_llama(tiny_shape(smallest=True))
    tokenizer.chat_template = TEMPLATE
    base = tmp_path / "base"
    save_model(model, tokenizer, base)
    trained = {
        "lora-run": train_run(tmp_path, base, "lora-run", {"r": 4, "alpha": 8}),
        "full-run": train_run(tmp_path, base, "full-run", None),
    }
    return tmp_path / "runs", base, trained


def export(runs_dir, *args):
    return runner.invoke(app, ["export", "--runs-dir", str(runs_dir), *args])


def base_logits(base) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    return logits(AutoModelForCausalLM.from_pretrained(str(base)))


def test_a_lora_run_exports_a_peft_adapter_that_gives_the_trainers_logits(runs, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    runs_dir, base, trained = runs
    out = tmp_path / "adapter"
    result = export(runs_dir, "--run", "lora-run", "--output", str(out))
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "at step 2" in text and "PEFT adapter" in text and "PeftModel.from_pretrained" in text and str(base) in text
    config = json.loads((out / ADAPTER_CONFIG_FILE).read_text())
    assert config["base_model_name_or_path"] == str(base.resolve()) and config["r"] == 4
    assert (out / ADAPTER_WEIGHTS_FILE).stat().st_size < 100_000  # the adapters, not the model
    assert not list(out.glob("model*.safetensors")) and has_chat_template(out)
    assert AutoTokenizer.from_pretrained(str(out)).chat_template == TEMPLATE

    loaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"]), str(out)
    )
    got = logits(loaded)
    assert torch.allclose(got, trained["lora-run"], atol=1e-6, rtol=0)
    assert (got - base_logits(base)).abs().max() > 1e-2  # the adapters moved the policy
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]  # no staging directory left


def test_a_lora_run_exports_merged_a_model_directory_transformers_loads(runs, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    runs_dir, base, trained = runs
    out = tmp_path / "merged"
    result = export(runs_dir, "--run", "lora-run", "--merge", "--output", str(out))
    assert result.exit_code == 0, result.output
    assert "merged" in result.output and f"vllm serve {out}" in " ".join(result.output.split())
    assert (out / "model.safetensors").exists() and not (out / ADAPTER_CONFIG_FILE).exists()
    assert has_chat_template(out) and AutoTokenizer.from_pretrained(str(out)).chat_template == TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert not any("lora" in name for name, _ in model.named_parameters())
    got = logits(model)
    assert (got - trained["lora-run"]).abs().max() < 1e-4
    assert (got - base_logits(base)).abs().max() > 1e-2


def test_a_full_run_exports_its_model_directory_merge_or_not(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    runs_dir, base, trained = runs
    for flags in ([], ["--merge"]):
        out = tmp_path / f"full{len(flags)}"
        result = export(runs_dir, "--run", "full-run", *flags, "--output", str(out))
        assert result.exit_code == 0, result.output
        assert "at step 2" in result.output and has_chat_template(out)
        got = logits(AutoModelForCausalLM.from_pretrained(str(out)))
        assert torch.allclose(got, trained["full-run"], atol=1e-5, rtol=0)
        assert (got - base_logits(base)).abs().max() > 1e-2


def test_a_run_is_found_by_its_run_id_too(runs, tmp_path):
    runs_dir, _, _ = runs
    run_id = json.loads((runs_dir / "lora-run" / "identity.json").read_text())["run_id"]
    result = export(runs_dir, "--run", run_id, "--output", str(tmp_path / "by-id"))
    assert result.exit_code == 0, result.output
    assert (tmp_path / "by-id" / ADAPTER_WEIGHTS_FILE).exists()


def test_a_damaged_newest_checkpoint_is_skipped_for_the_one_before_and_said(runs, tmp_path):
    runs_dir, _, _ = runs
    copy = tmp_path / "runs"
    shutil.copytree(runs_dir / "lora-run", copy / "lora-run")
    weights = copy / "lora-run" / "checkpoints" / "step_000002" / ADAPTER_WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:-16])
    result = export(copy, "--run", "lora-run", "--output", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "skipped checkpoint step_000002" in text and "truncated" in text and "at step 1" in text


def error_of(runs_dir, run: str, output, *flags) -> str:
    """The one line an export that must fail prints (exit 2, no traceback, nothing written)."""
    before = sorted(output.parent.rglob("*")) if output.parent.exists() else None
    result = export(runs_dir, "--run", run, "--output", str(output), *flags)
    assert result.exit_code == 2, result.output
    assert result.output.startswith("export: ") and result.output.count("\n") == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    after = sorted(output.parent.rglob("*")) if output.parent.exists() else None
    assert after == before, "an export that failed wrote something"
    return result.output


def test_bad_input_exits_2_with_one_line_and_writes_nothing(runs, tmp_path):
    runs_dir, _, _ = runs
    out = tmp_path / "exports" / "out"
    unknown = error_of(runs_dir, "nope", out)
    assert "no run 'nope'" in unknown and "the runs there are full-run, lora-run" in unknown
    assert "--runs-dir" in error_of(tmp_path / "missing", "lora-run", out)

    broken = tmp_path / "broken"
    shutil.copytree(runs_dir / "lora-run", broken / "fresh")
    shutil.rmtree(broken / "fresh" / "checkpoints")
    assert "no checkpoint yet" in error_of(broken, "fresh", out)

    shutil.copytree(runs_dir / "lora-run", broken / "damaged")
    for step in ("step_000001", "step_000002"):
        (broken / "damaged" / "checkpoints" / step / "trainer.pt").write_bytes(b"not a zip")
    assert "trainer.pt is unreadable or truncated" in error_of(broken, "damaged", out)

    shutil.copytree(runs_dir / "lora-run", broken / "unrecorded")
    (broken / "unrecorded" / "model.json").unlink()
    assert "model.json is missing" in error_of(broken, "unrecorded", out)

    out.mkdir(parents=True)
    (out / "keep.txt").write_text("x")
    assert "--force" in error_of(runs_dir, "lora-run", out)
    assert (out / "keep.txt").read_text() == "x"
    assert "which the export reads" in error_of(runs_dir, "lora-run", runs_dir / "lora-run", "--force")

    result = export(runs_dir, "--run", "lora-run", "--output", str(out), "--force")
    assert result.exit_code == 0, result.output
    assert not (out / "keep.txt").exists() and (out / ADAPTER_WEIGHTS_FILE).exists()


@pytest.mark.integration
def test_vllm_serves_the_merged_export(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    from rl.config import VLLMOptions
    from rl.generation import GenerationRequest, SamplingParams
    from rl.vllm_engine import VLLMEngine, import_vllm
    from tests.helpers import hf_on_cpu, match_rate

    import_vllm()
    runs_dir, base, _ = runs
    out = tmp_path / "merged"
    assert export(runs_dir, "--run", "lora-run", "--merge", "--output", str(out)).exit_code == 0
    requests = [
        GenerationRequest(f"p{i}", [1, 10 + i, 20 + i, 30 + i], 16, seed=i, sampling=SamplingParams(greedy=True))
        for i in range(8)
    ]
    merged = hf_on_cpu(AutoModelForCausalLM.from_pretrained(str(out)), eos_token_id=2, pad_token_id=0).generate(
        requests
    )
    original = hf_on_cpu(AutoModelForCausalLM.from_pretrained(str(base)), eos_token_id=2, pad_token_id=0)
    assert match_rate(original.generate(requests), merged) < 0.9  # the merged policy decodes differently
    engine = VLLMEngine(out, 2, VLLMOptions(max_num_seqs=8, kv_cache_bytes=64 << 20), dtype="fp32")
    try:
        assert match_rate(engine.generate(requests), merged) >= 0.99
    finally:
        engine.close()
