"""Token-log benchmark: append throughput on loopback Redis, and the logging overhead of a real
rollout (HF engine, tiny model) that flushes every k tokens as the rollout worker does (the due
flushes of each engine step in one round trip on the `FlushPipeline`, overlapping the next engine
step), against the same rollout with no logging, measured side by side in one run.

Append throughput is what the token log sustains for a fleet: `--clients` processes (instances),
each with its own connection and its own `--samples` leased samples, flush `--chunk` tokens per
sample per round trip, all at once; tokens/s is everything they logged over the wall time from the
first start to the last end (`flushes_per_s`: tokens/s / `--chunk`); one client alone too. `--cluster`
runs them as instances of one run with `--shards` shards on a local 3-master Redis Cluster as well.

    .venv/bin/python bench/tokenlog.py [--clients 3] [--samples 64] [--chunk 16] [--calls 400] [--flush-tokens 8] [--cluster]

Last line JSON: {"tokens_per_s": .., "overhead": .., ...}. Targets: >= 1,000,000 tokens/s and
overhead <= 3% of rollout time.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis  # noqa: E402
import torch  # noqa: E402

from infra.rollout.flush_pipeline import FlushPipeline  # noqa: E402
from infra.rollout.tokenlog import Flush, GroupSpec, TokenLog  # noqa: E402
from infra.services.redis_cluster import LocalRedisCluster  # noqa: E402
from infra.services.redis_embedded import EmbeddedRedis, RedisSettings  # noqa: E402
from rl.engine import HFEngine  # noqa: E402
from rl.generation import GenerationRequest, SamplingParams  # noqa: E402
from rl.models import TinyLlamaShape, build_tiny_llama  # noqa: E402


def append_throughput(client: redis.Redis, run_id: str, samples: int, chunk: int, calls: int) -> float:
    """Tokens/s of `TokenLog.log` batches of `samples` x `chunk` tokens (with exactly-once offsets)."""
    log = TokenLog(client, run_id)
    log.enqueue_step(0, 0, [GroupSpec(g, [1, 2, 3], 1, chunk * (calls + 1)) for g in range(samples)])
    claims = log.claim(0, "bench", 0, samples)
    tokens, logprobs = list(range(chunk)), [-0.5] * chunk
    started = time.perf_counter()
    for call in range(calls):
        accepted = log.log([Flush(c.sample_id, "bench", c.epoch, tokens, logprobs, call * chunk) for c in claims])
        assert all(accepted)
    return samples * chunk * calls / (time.perf_counter() - started)


def _steps(samples: int, chunk: int, calls: int) -> list[GroupSpec]:
    return [GroupSpec(g, [1, 2, 3], 1, chunk * (calls + 1)) for g in range(samples)]


def _append_client(
    url: str, run_id: str, instance: str, enqueue: bool, samples: int, chunk: int, calls: int, barrier, results
) -> None:
    client = RedisSettings(url=url).client()  # a cluster client on a cluster node
    log = TokenLog(client, run_id)
    if enqueue:
        log.enqueue_step(0, 0, _steps(samples, chunk, calls))
    claims = log.claim(0, instance, 0, samples)
    assert len(claims) == samples
    tokens, logprobs = list(range(chunk)), [-0.5] * chunk
    barrier.wait()
    started = time.time()
    for call in range(calls):
        accepted = log.log([Flush(c.sample_id, instance, c.epoch, tokens, logprobs, call * chunk) for c in claims])
        assert all(accepted)
    results.put((started, time.time(), samples * chunk * calls))


def fleet_throughput(
    url: str, run_id: str, clients: int, samples: int, chunk: int, calls: int, shards: int | None = None
) -> float:
    """Tokens/s that `clients` concurrent appenders (separate processes) log together: each in a run
    of its own, or (with `shards`) all as instances of one run whose token log has that many shards."""
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(clients), context.Queue()
    if shards is None:
        jobs = [(url, f"{run_id}-{i}", "bench", True) for i in range(clients)]
    else:
        client = RedisSettings(url=url).client()
        TokenLog(client, run_id, shards=shards).enqueue_step(0, 0, _steps(clients * samples, chunk, calls))
        client.close()
        jobs = [(url, run_id, f"bench-{i}", False) for i in range(clients)]
    processes = [
        context.Process(target=_append_client, args=(*job, samples, chunk, calls, barrier, results)) for job in jobs
    ]
    for process in processes:
        process.start()
    done = [results.get(timeout=600) for _ in processes]
    for process in processes:
        process.join()
        if process.exitcode != 0:
            raise RuntimeError(f"an appender exited with {process.exitcode}")
    return sum(n for _, _, n in done) / (max(end for _, end, _ in done) - min(start for start, _, _ in done))


def _all_accepted(results: list[bool]) -> None:
    if not all(results):
        raise RuntimeError(f"{results.count(False)} flushes rejected in a benchmark with no revocation")


def rollout(
    engine: HFEngine, requests: list[GenerationRequest], log: TokenLog | None, flush_tokens: int, claims: dict | None
) -> tuple[float, int]:
    """Run all requests through the engine; with a log, flush every `flush_tokens` per sample as
    a rollout worker does: all flushes due after an engine step go in one pipelined round trip."""
    buffers: dict[str, tuple[list[int], list[float]]] = {r.sample_id: ([], []) for r in requests}
    logged = dict.fromkeys(buffers, 0)
    pipeline = FlushPipeline(log) if log is not None else None
    started = time.perf_counter()
    for request in requests:
        engine.add(request)
    tokens = 0
    while engine.has_work():
        due = []
        for chunk in engine.step():
            ids, lps = buffers[chunk.sample_id]
            ids.extend(chunk.token_ids)
            lps.extend(chunk.logprobs)
            tokens += len(chunk.token_ids)
            if log is not None and (len(ids) >= flush_tokens or chunk.finish_reason):
                epoch = claims[chunk.sample_id]
                due.append(
                    Flush(
                        chunk.sample_id,
                        "bench",
                        epoch,
                        list(ids),
                        list(lps),
                        logged[chunk.sample_id],
                        chunk.finish_reason,
                    )
                )
                logged[chunk.sample_id] += len(ids)
                ids.clear()
                lps.clear()
        if due:
            pipeline.submit(due, _all_accepted)
    if pipeline is not None:
        pipeline.settle()
        pipeline.close()
    return time.perf_counter() - started, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=3, help="concurrent appending instances")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--flush-tokens", type=int, default=8)
    parser.add_argument("--rollout-samples", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--cluster", action="store_true", help="also measure the clients on a local 3-master Redis Cluster"
    )
    parser.add_argument("--shards", type=int, default=6, help="the token log's shards on the cluster")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cluster: dict[str, float | int] = {}
    if args.cluster:
        with LocalRedisCluster(masters=3) as local:
            tokens_per_s_cluster = max(
                fleet_throughput(
                    local.url, f"bench-cluster-{r}", args.clients, args.samples, args.chunk, args.calls, args.shards
                )
                for r in range(5)
            )
        print(
            f"{args.clients} clients on a 3-master cluster, {args.shards} shards: {tokens_per_s_cluster:,.0f} tokens/s"
        )
        cluster = {
            "tokens_per_s_cluster": round(tokens_per_s_cluster),
            "flushes_per_s_cluster": round(tokens_per_s_cluster / args.chunk),
            "masters": 3,
            "shards": args.shards,
        }

    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        one_client = max(
            append_throughput(client, f"bench-append-{r}", args.samples, args.chunk, args.calls)
            for r in range(args.repeats)
        )
        print(f"one client, log {args.samples} samples x {args.chunk} tokens per call: {one_client:,.0f} tokens/s")
        tokens_per_s = max(
            fleet_throughput(server.url, f"bench-fleet-{r}", args.clients, args.samples, args.chunk, args.calls)
            for r in range(5)
        )
        print(f"{args.clients} clients at once, each the same: {tokens_per_s:,.0f} tokens/s together")

        model, tokenizer = build_tiny_llama(TinyLlamaShape(), seed=0)
        engine = HFEngine(
            model.eval(), tokenizer.eos_token_id, tokenizer.pad_token_id, max_batch_size=256, device="cpu"
        )
        prompt = tokenizer("123+456+78=").input_ids
        times = {"engine_only": [], "with_log": []}
        for repeat in range(args.repeats):
            # Back to back so both see the same machine load, in alternating order so neither
            # always runs second (on a warmer cache).
            for mode in ["engine_only", "with_log"] if repeat % 2 == 0 else ["with_log", "engine_only"]:
                requests = [
                    GenerationRequest(
                        f"{repeat}/{i}/0",
                        prompt,
                        args.max_new_tokens,
                        seed=repeat,
                        sampling=SamplingParams(),
                        stop_token_ids=(),
                    )
                    for i in range(args.rollout_samples)
                ]
                log = claims = None
                if mode == "with_log":
                    log = TokenLog(client, f"bench-rollout-{repeat}")
                    log.enqueue_step(
                        repeat, 0, [GroupSpec(i, prompt, 1, args.max_new_tokens) for i in range(args.rollout_samples)]
                    )
                    claimed = log.claim(repeat, "bench", 0, args.rollout_samples)
                    claims = {c.sample_id: c.epoch for c in claimed}
                    # The token log names samples "<step>/<group>/<index>": align request ids with it.
                    requests = [
                        GenerationRequest(
                            c.sample_id, prompt, args.max_new_tokens, seed=repeat, sampling=SamplingParams()
                        )
                        for c in claimed
                    ]
                seconds, tokens = rollout(engine, requests, log, args.flush_tokens, claims)
                times[mode].append(seconds)
                print(f"repeat {repeat} {mode:12s} {seconds:.3f} s, {tokens} tokens")
        engine_only, with_log = min(times["engine_only"]), min(times["with_log"])
        # The median of the paired ratios (each pair ran back to back): robust to the machine's
        # speed drifting between repeats, which the ratio of two minima is not.
        overhead = statistics.median(w / e for w, e in zip(times["with_log"], times["engine_only"])) - 1
        print(
            f"rollout {args.rollout_samples} samples: fastest engine only {engine_only:.3f} s, fastest with token log "
            f"{with_log:.3f} s; overhead (median of paired ratios) {overhead:.2%}"
        )
    print(
        json.dumps(
            {
                "tokens_per_s": round(tokens_per_s),
                "flushes_per_s": round(tokens_per_s / args.chunk),
                **cluster,
                "overhead": round(overhead, 4),
                "tokens_per_s_one_client": round(one_client),
                "clients": args.clients,
                "engine_only_s": round(engine_only, 3),
                "with_log_s": round(with_log, 3),
                "flush_tokens": args.flush_tokens,
            }
        )
    )


if __name__ == "__main__":
    main()
