"""Engine benchmark: generation throughput of the HF engine (`rl.engine.HFEngine`) on the demo's
tiny Llama, CPU.

`--samples` requests with random 9-15 token prompts and response budgets of `--min-new` to
`--max-new` tokens run to completion through `generate()` (continuous admission, at most
`--max-batch-size` rows decoded together), after a warm-up on 8 of them; the figure is the fastest
of `--repeats` runs, tokens/s counting every generated token.

    .venv/bin/python bench/engine_throughput.py [--samples 256] [--max-batch-size 64] [--repeats 5] [--threads 1]

Last line JSON: {"tokens_per_s": .., "seconds": .., "tokens": .., ...}.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from rl.engine import HFEngine  # noqa: E402
from rl.generation import GenerationRequest  # noqa: E402
from rl.models import TinyLlamaShape, build_tiny_llama  # noqa: E402


def make_requests(count: int, min_new: int, max_new: int, bos_id: int) -> list[GenerationRequest]:
    """The same requests every run: random prompts over the vocabulary's low ids, random budgets."""
    rng = random.Random(18)
    return [
        GenerationRequest(
            f"t{i}",
            [bos_id] + [rng.randrange(4, 100) for _ in range(rng.randint(8, 14))],
            rng.randint(min_new, max_new),
        )
        for i in range(count)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--min-new", type=int, default=5, help="smallest response budget")
    parser.add_argument("--max-new", type=int, default=20, help="largest response budget")
    parser.add_argument("--max-batch-size", type=int, default=64, help="rows decoded together")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model, tokenizer = build_tiny_llama(TinyLlamaShape(), seed=0)
    engine = HFEngine(
        model.eval(), tokenizer.eos_token_id, tokenizer.pad_token_id, max_batch_size=args.max_batch_size, device="cpu"
    )
    requests = make_requests(args.samples, args.min_new, args.max_new, tokenizer.bos_token_id)
    engine.generate(requests[:8])  # warm-up
    seconds = []
    for repeat in range(args.repeats):
        started = time.perf_counter()
        results = engine.generate(requests)
        seconds.append(time.perf_counter() - started)
        tokens = sum(len(r.token_ids) for r in results)
        print(
            f"repeat {repeat}: {args.samples} samples, {tokens} tokens in {seconds[-1]:.2f} s: "
            f"{tokens / seconds[-1]:,.0f} tokens/s"
        )
    fastest = min(seconds)
    print(
        json.dumps(
            {
                "tokens_per_s": round(tokens / fastest),
                "median_tokens_per_s": round(tokens / statistics.median(seconds)),
                "seconds": round(fastest, 3),
                "tokens": tokens,
                "samples": args.samples,
                "max_batch_size": args.max_batch_size,
                "torch_threads": args.threads,
            }
        )
    )


if __name__ == "__main__":
    main()
