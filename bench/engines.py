"""Engine benchmark: the same requests through `HFEngine` and `VLLMEngine` on the same model, CPU.

The demo's tiny Llama (`--model-dir` for another Hugging Face directory, e.g. SmolLM2-135M made
into one) decodes `--samples` random prompts of `--new-tokens` response tokens (temperature 1,
keyed sampling) on each engine after a warm-up; the figures are the fastest of `--repeats` runs.
Then, on vLLM: every sample released at a random position and resumed (`resume_token_match`, the
fraction of tokens equal to the uninterrupted run), the largest log-prob difference from HF over
each response's prefix where both drew the same tokens, and the seconds of an in-place weight reload
(median of 5, prefix-cache reset included).

    .venv/bin/python bench/engines.py [--samples 64] [--new-tokens 32] [--repeats 3] [--threads 1]

Needs vLLM (`make vllm-setup`). Last line JSON: {"model", "hf_tokens_per_s", "vllm_tokens_per_s",
"speedup", "resume_token_match", "logprob_max_abs_diff", "reload_s"}.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from rl.config import VLLMOptions  # noqa: E402
from rl.engine import HFEngine  # noqa: E402
from rl.generation import GenerationEngine, GenerationRequest, GenerationResult  # noqa: E402
from rl.models import TinyLlamaShape, build_tiny_llama, load_model, save_model  # noqa: E402
from rl.vllm_engine import VLLMEngine  # noqa: E402


def make_requests(count: int, new_tokens: int, bos_id: int | None, vocab: int) -> list[GenerationRequest]:
    """Random 8-14 token prompts over the vocabulary's low ids, after the bos token if there is one."""
    rng = random.Random(18)
    start = [] if bos_id is None else [bos_id]
    return [
        GenerationRequest(f"t{i}", start + [rng.randrange(4, vocab) for _ in range(rng.randint(8, 14))], new_tokens)
        for i in range(count)
    ]


def fastest(engine: GenerationEngine, requests: list[GenerationRequest], repeats: int) -> tuple[float, list]:
    """(tokens/s of the fastest of `repeats` runs, the results of the last)."""
    engine.generate(requests[:8])  # warm-up
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        results = engine.generate(requests)
        seconds.append(time.perf_counter() - started)
    return sum(len(r.token_ids) for r in results) / min(seconds), results


def released_and_resumed(engine: GenerationEngine, requests: list[GenerationRequest]) -> list[GenerationResult]:
    """Release every request at a random position, then resume it with its tokens so far."""
    rng = random.Random(5)
    stops = {r.sample_id: rng.randrange(1, r.max_new_tokens) for r in requests}
    partial = {r.sample_id: [] for r in requests}
    for request in requests:
        engine.add(request)
    while engine.has_work():
        for chunk in engine.step():
            partial[chunk.sample_id] += chunk.token_ids
            if chunk.finish_reason is not None:
                stops[chunk.sample_id] = -1
        for sample_id, tokens in partial.items():
            if 0 <= stops[sample_id] <= len(tokens):
                engine.release(sample_id)
                stops[sample_id] = -1
    resumed = [
        GenerationRequest(r.sample_id, r.prompt_ids, r.max_new_tokens, r.seed, r.sampling, partial[r.sample_id])
        for r in requests
    ]
    return engine.generate(resumed)


def token_match(got: list[GenerationResult], want: list[GenerationResult]) -> float:
    same = sum(x == y for a, b in zip(got, want) for x, y in zip(a.token_ids, b.token_ids))
    return same / sum(max(len(a.token_ids), len(b.token_ids)) for a, b in zip(got, want))


def logprob_max_abs_diff(got: list[GenerationResult], want: list[GenerationResult]) -> float:
    """Largest log-prob difference over each pair's common token prefix (the same contexts)."""
    diffs = [0.0]
    for a, b in zip(got, want):
        for x, y, p, q in zip(a.token_ids, b.token_ids, a.new_logprobs, b.new_logprobs):
            if x != y:
                break
            diffs.append(abs(p - q))
    return max(diffs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, help="a Hugging Face model directory (default: the tiny Llama)")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads, both engines (vLLM runs in this process)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model_dir
        if model_dir is None:
            model_dir = Path(scratch) / "tiny"
            save_model(*build_tiny_llama(TinyLlamaShape(), seed=0), model_dir)
        model, tokenizer = load_model(model_dir)
        requests = make_requests(
            args.samples, args.new_tokens, tokenizer.bos_token_id, min(model.config.vocab_size, 1000)
        )
        eos = tokenizer.eos_token_id

        hf_tokens_per_s, hf_results = fastest(
            HFEngine(model, eos, tokenizer.pad_token_id, max_batch_size=args.samples, device="cpu"),
            requests,
            args.repeats,
        )
        print(f"HF:   {hf_tokens_per_s:,.0f} tokens/s")
        engine = VLLMEngine(
            model_dir, eos, VLLMOptions(max_num_seqs=args.samples, kv_cache_bytes=512 << 20), dtype="fp32"
        )
        vllm_tokens_per_s, vllm_results = fastest(engine, requests, args.repeats)
        print(
            f"vLLM: {vllm_tokens_per_s:,.0f} tokens/s; HF vs vLLM token match {token_match(vllm_results, hf_results):.4f}"
        )
        resume_match = token_match(released_and_resumed(engine, requests), vllm_results)
        logprob_diff = logprob_max_abs_diff(vllm_results, hf_results)
        state = model.state_dict()
        reloads = []
        for version in range(1, 6):
            started = time.perf_counter()
            engine.load_weights(state, version)
            reloads.append(time.perf_counter() - started)
        engine.close()
    print(
        json.dumps(
            {
                "model": args.model_dir.name if args.model_dir else "tiny-llama (demo shape)",
                "hf_tokens_per_s": round(hf_tokens_per_s),
                "vllm_tokens_per_s": round(vllm_tokens_per_s),
                "speedup": round(vllm_tokens_per_s / hf_tokens_per_s, 2),
                "resume_token_match": round(resume_match, 4),
                "logprob_max_abs_diff": float(f"{logprob_diff:.3g}"),
                "reload_s": round(statistics.median(reloads), 4),
            }
        )
    )


if __name__ == "__main__":
    main()
