"""Weight-transfer benchmark: N fresh instances pull one checkpoint three ways, in one run.

    .venv/bin/python bench/weights.py [--instances 8] [--cap-mb-s 40] [--chunk-mb 4]

A ~200 MB Llama-shaped checkpoint is published by this process (`WeightPublisher`) and pulled by
N instance processes (`python -m tests.infra.weights.instance`) with the store on a local moto S3 server,
three ways: **trainer** (every instance from the trainer only), **store** (every instance from
the object store) and **swarm** (the system: from the trainer and every instance that holds all
or part of the version, each serving every chunk as soon as it has verified it). Every source's
uplink is capped alike (`--cap-mb-s`, emulating a NIC on one machine), and the modes also run
uncapped. It measures the seconds until the last instance holds the verified, decoded version,
against the ideal under the cap; target: swarm / best single source <= 0.2. Last line JSON:
{"trainer_s": .., "store_s": .., "swarm_s": .., "swarm_ratio": .., "efficiency": .., "instances": N,
...} (capped; *_uncapped_s, raw_s, cap_mb_s too), then the delta_* keys (`--delta-only`: just
those; real GRPO steps, bench/weight_deltas.py). Method and the ideals: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import redis
import torch
from weight_deltas import delta_figures

from infra.services.ports import free_port
from infra.services.redis_embedded import EmbeddedRedis
from infra.weights.bandwidth import UploadCap
from infra.weights.config import WeightsConfig
from infra.weights.manifest import encode, fingerprint
from infra.weights.publisher import WeightPublisher
from infra.weights.puller import STORE
from infra.weights.store import WeightStore
from rl import env_vars

REPO = Path(__file__).resolve().parents[1]
BUCKET = "rlboost-bench"
MODES = ("trainer", "store", "swarm")
_RECEIVER = """
import socket, sys, time
size = int(sys.argv[2])
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
buffer = memoryview(bytearray(size))
received = 0
while received < size:
    n = sock.recv_into(buffer[received:])
    if not n:
        sys.exit("connection closed early")
    received += n
print(time.time(), flush=True)
"""


def llama_state_dict(
    hidden: int = 1024, layers: int = 3, mlp: int = 2816, vocab: int = 6144
) -> dict[str, torch.Tensor]:
    """The state dict layout of a Llama with tied embeddings (the names and shapes
    `transformers.LlamaForCausalLM` has), random float32 values: about 200 MB by default."""
    torch.manual_seed(0)
    embed = torch.randn(vocab, hidden) * 0.02
    state_dict = {"model.embed_tokens.weight": embed}
    for i in range(layers):
        prefix = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            state_dict[f"{prefix}self_attn.{name}.weight"] = torch.randn(hidden, hidden) * 0.02
        state_dict[f"{prefix}mlp.gate_proj.weight"] = torch.randn(mlp, hidden) * 0.02
        state_dict[f"{prefix}mlp.up_proj.weight"] = torch.randn(mlp, hidden) * 0.02
        state_dict[f"{prefix}mlp.down_proj.weight"] = torch.randn(hidden, mlp) * 0.02
        state_dict[f"{prefix}input_layernorm.weight"] = torch.ones(hidden)
        state_dict[f"{prefix}post_attention_layernorm.weight"] = torch.ones(hidden)
    state_dict["model.norm.weight"] = torch.ones(hidden)
    state_dict["lm_head.weight"] = embed  # tied: transferred as its own copy
    return state_dict


def _wait_for_port(port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on port {port} after {timeout} s")


class CappedProxy:
    """A TCP proxy to 127.0.0.1:`upstream_port`; everything it sends back to its clients shares one
    `UploadCap` (the object store's emulated uplink)."""

    def __init__(self, upstream_port: int, bytes_per_s: float) -> None:
        self.upstream_port = upstream_port
        self.cap = UploadCap(bytes_per_s)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="store-proxy", daemon=True).start()
        server = asyncio.run_coroutine_threadsafe(asyncio.start_server(self._serve, "127.0.0.1", 0), self.loop).result()
        self.port = server.sockets[0].getsockname()[1]

    async def _serve(self, client_reader, client_writer) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)

        async def pump(reader, writer, cap) -> None:
            try:
                while data := await reader.read(256 * 1024):
                    if cap is not None:
                        await cap.take(len(data))
                    writer.write(data)
                    await writer.drain()
            finally:
                writer.close()

        await asyncio.gather(
            pump(client_reader, upstream_writer, None),
            pump(upstream_reader, client_writer, self.cap),
            return_exceptions=True,
        )

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


class Instances:
    """N `tests.infra.weights.instance` processes, driven over stdin/stdout."""

    def __init__(self, count: int, redis_url: str) -> None:
        self.processes = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.infra.weights.instance",
                    "--redis-url",
                    redis_url,
                    "--instance-id",
                    f"instance-{i}",
                ],
                cwd=REPO,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for i in range(count)
        ]

    def all(self, message: dict, timeout: float = 600) -> list[dict]:
        """Send `message` to every instance at once; their answers, in instance order."""
        line = json.dumps(message) + "\n"
        for process in self.processes:
            process.stdin.write(line)
            process.stdin.flush()
        answers: dict[int, dict] = {}
        by_fd = {process.stdout.fileno(): i for i, process in enumerate(self.processes)}
        deadline = time.monotonic() + timeout
        while len(answers) < len(self.processes):
            waiting = [self.processes[i].stdout for i in range(len(self.processes)) if i not in answers]
            ready, _, _ = select.select(waiting, [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"{len(self.processes) - len(answers)} instances did not answer {message['op']}")
            for stream in ready:
                answers[by_fd[stream.fileno()]] = json.loads(stream.readline())
        return [answers[i] for i in range(len(self.processes))]

    def close(self) -> None:
        for process in self.processes:
            process.stdin.close()
        for process in self.processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


def raw_loopback_copy(payload: bytes, receivers: int) -> float:
    """Seconds to send `payload` to `receivers` processes at once over plain loopback TCP."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        processes = [
            subprocess.Popen(
                [sys.executable, "-c", _RECEIVER, str(port), str(len(payload))], stdout=subprocess.PIPE, text=True
            )
            for _ in range(receivers)
        ]
        connections = [server.accept()[0] for _ in processes]
        start = time.time()
        senders = [threading.Thread(target=conn.sendall, args=(payload,)) for conn in connections]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join()
        done = [float(process.communicate(timeout=120)[0]) for process in processes]
        for conn in connections:
            conn.close()
    return max(done) - start


def run_mode(
    mode: str,
    cap_mb_s: float | None,
    state_dict,
    base: WeightsConfig,
    trainer_store: dict,
    instance_store: dict,
    client: redis.Redis,
    instances: Instances,
    expected: str,
) -> dict:
    """One mode: publish, then every instance pulls; seconds until the last is ready, and sources."""
    run_id = f"bench-{mode}-{'capped' if cap_mb_s else 'uncapped'}-{secrets.token_hex(3)}"
    store_url = f"s3://{BUCKET}/{run_id}"
    serve_from_trainer, serve_from_peers = {"trainer": (True, False), "store": (False, False), "swarm": (True, True)}[
        mode
    ]
    shared = {
        "store_url": store_url,
        "upload_cap_mb_s": cap_mb_s,
        "serve_from_trainer": serve_from_trainer,
        "serve_from_peers": serve_from_peers,
    }
    started = time.monotonic()
    publisher = WeightPublisher(base.model_copy(update=shared | {"store_options": trainer_store}), client, run_id)
    try:
        publisher.publish(1, state_dict)
        publisher.flush(timeout=600)  # served, announced and in the store before the clock starts
        if publisher.last_upload_error is not None:
            raise RuntimeError(f"upload to the store failed: {publisher.last_upload_error}")
        published = time.monotonic()
        pull = {
            "run_id": run_id,
            "config": base.model_copy(update=shared | {"store_options": instance_store}).model_dump(),
        }
        instances.all({"op": "open"} | pull)  # fresh pullers, holding nothing, servers up
        start = time.time()
        answers = instances.all({"op": "pull", "version": 1} | pull)
        errors = [a["error"] for a in answers if a["op"] != "pulled"]
        if errors:
            raise RuntimeError(f"{mode}: {len(errors)} pulls failed: {errors[0]}")
        ready = sorted(a["ready_at"] - start for a in answers)
        digest = publisher.registry.manifest_sha256(1)
        if any(a["report"]["manifest_sha256"] != digest for a in answers):
            raise RuntimeError(f"{mode}: an instance pulled another version")
        if mode == "swarm" and cap_mb_s:
            if any(a["fingerprint"] != expected for a in instances.all({"op": "fingerprint", "version": 1})):
                raise RuntimeError(f"{mode}: an instance holds different weights")
        sources = {"trainer": 0, "peers": 0, "store": 0}
        failures = 0
        for answer in answers:
            failures += len(answer["report"]["failures"])
            for source, nbytes in answer["report"]["bytes_by_source"].items():
                key = "store" if source == STORE else "trainer" if source == publisher.url else "peers"
                sources[key] += nbytes
        instances.all({"op": "drop"})
        WeightStore(store_url, trainer_store).delete(1)
    finally:
        publisher.close()
    print(
        f"  {mode:7s} {'capped' if cap_mb_s else 'uncapped':8s} pull {ready[-1]:6.2f} s "
        f"(publish + upload {published - started:.1f} s, whole mode {time.monotonic() - started:.1f} s)",
        file=sys.stderr,
        flush=True,
    )
    return {"seconds": ready[-1], "ready": ready, "sources": sources, "failures": failures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=8)
    parser.add_argument("--cap-mb-s", type=float, default=40.0, help="emulated uplink of every source, MiB/s")
    parser.add_argument("--chunk-mb", type=float, default=4.0)
    parser.add_argument("--delta-steps", type=int, default=20, help="GRPO steps per model of the delta figures")
    parser.add_argument("--delta-new-tokens", type=int, default=16, help="SmolLM2's tokens per sample there")
    parser.add_argument("--delta-prompts", type=int, help="SmolLM2's prompts per step there (default: its config's)")
    parser.add_argument("--delta-models", default="smollm2,demo")
    parser.add_argument("--delta-only", action="store_true", help="only the delta figures (bench/weight_deltas.py)")
    args = parser.parse_args()
    deltas = lambda: delta_figures(args.delta_steps, args.delta_new_tokens, args.delta_prompts, args.delta_models)  # noqa: E731
    if args.delta_only:
        print(json.dumps(deltas()))
        return
    torch.set_num_threads(1)
    os.environ.setdefault(env_vars.WEIGHTS_SECRET, secrets.token_hex(32))

    began = time.monotonic()
    load_before = os.getloadavg()[0]
    moto_port = free_port()
    moto = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(moto_port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    instances = None
    proxy = None
    try:
        with EmbeddedRedis() as redis_server:
            instances = Instances(args.instances, redis_server.url)  # they import torch meanwhile
            state_dict = llama_state_dict()
            expected = fingerprint(state_dict)
            encoded = encode(state_dict, version=1, chunk_bytes=int(args.chunk_mb * 2**20))
            size = encoded.manifest.total_bytes
            instances.all({"op": "drop"})  # every instance is up and idle
            raw_s = raw_loopback_copy(b"".join(encoded.chunks), args.instances)
            del encoded

            _wait_for_port(moto_port)
            credentials = {"key": "bench", "secret": "bench"}
            direct = credentials | {
                "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{moto_port}", "region_name": "us-west-2"}
            }
            WeightStore(f"s3://{BUCKET}", direct).fs.mkdir(BUCKET)
            proxy = CappedProxy(moto_port, args.cap_mb_s * 2**20)
            through_proxy = credentials | {
                "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{proxy.port}", "region_name": "us-west-2"}
            }
            base = WeightsConfig(chunk_mb=args.chunk_mb, keep_versions=1, keep_in_memory=1, pull_timeout_s=900)
            client = redis.Redis.from_url(redis_server.url)
            print(
                f"  setup {time.monotonic() - began:.1f} s (raw loopback copy {raw_s:.2f} s)",
                file=sys.stderr,
                flush=True,
            )
            results: dict[tuple[str, bool], dict] = {}
            for capped in (True, False):
                for mode in MODES:
                    results[mode, capped] = run_mode(
                        mode,
                        args.cap_mb_s if capped else None,
                        state_dict,
                        base,
                        direct,
                        through_proxy if capped else direct,
                        client,
                        instances,
                        expected,
                    )
    finally:
        if instances is not None:
            instances.close()
        if proxy is not None:
            proxy.close()
        moto.terminate()
        moto.wait(timeout=30)

    n = args.instances
    cap_bytes = args.cap_mb_s * 2**20
    ideal = {
        "trainer": n * size / cap_bytes,
        "store": n * size / cap_bytes,
        "swarm": size / cap_bytes,  # the trainer uploads every byte once; peers trade the rest
    }
    capped = {mode: results[mode, True]["seconds"] for mode in MODES}
    uncapped = {mode: results[mode, False]["seconds"] for mode in MODES}
    ratio = capped["swarm"] / min(capped["trainer"], capped["store"])
    efficiency = raw_s / uncapped["swarm"]

    print(
        f"weights benchmark: {n} instances (separate processes), checkpoint {size / 1e6:.1f} MB "
        f"({len(state_dict)} tensors, {args.chunk_mb:g} MiB chunks), {os.cpu_count()} CPU cores, "
        f"1-min load average {load_before:.1f} before / {os.getloadavg()[0]:.1f} after (other work on the machine "
        f"shows in the uncapped figures, which are CPU-bound)"
    )
    print(
        f"emulated uplink: {args.cap_mb_s:g} MiB/s per source (trainer server, each instance's server, "
        f"and the S3 store behind one capped proxy); downlinks uncapped"
    )
    print(
        f"{'mode':8s} {'capped s':>9s} {'ideal s':>8s} {'uncapped s':>11s}   MB from trainer / peers / store (capped run), failures"
    )
    for mode in MODES:
        sources = results[mode, True]["sources"]
        print(
            f"{mode:8s} {capped[mode]:9.2f} {ideal[mode]:8.2f} {uncapped[mode]:11.2f}   "
            f"{sources['trainer'] / 1e6:7.0f} / {sources['peers'] / 1e6:7.0f} / {sources['store'] / 1e6:7.0f}, "
            f"{results[mode, True]['failures']}"
        )
    staircase = " ".join(f"{t:.1f}" for t in results["swarm", True]["ready"])
    print(f"swarm (capped), instances ready at s: {staircase}; ideal: all at {ideal['swarm']:.1f}")
    print(
        f"raw loopback copy of the same bytes ({n} x {size / 1e6:.0f} MB, one sender, plain TCP): {raw_s:.2f} s "
        f"({n * size / raw_s / 1e9:.2f} GB/s)"
    )
    print(
        f"swarm / single-source (capped): {capped['swarm']:.2f} / {min(capped['trainer'], capped['store']):.2f} = "
        f"{ratio:.3f} (target <= 0.2); uncapped: {uncapped['swarm'] / min(uncapped['trainer'], uncapped['store']):.3f}"
    )
    print(
        f"transfer efficiency (raw loopback copy / uncapped swarm): {raw_s:.2f} / {uncapped['swarm']:.2f} = {efficiency:.3f}"
    )
    print(
        json.dumps(
            {
                **deltas(),
                "trainer_s": round(capped["trainer"], 3),
                "store_s": round(capped["store"], 3),
                "swarm_s": round(capped["swarm"], 3),
                "swarm_ratio": round(ratio, 3),
                "efficiency": round(efficiency, 3),
                "instances": n,
                "cap_mb_s": args.cap_mb_s,
                "raw_s": round(raw_s, 3),
                "trainer_uncapped_s": round(uncapped["trainer"], 3),
                "store_uncapped_s": round(uncapped["store"], 3),
                "swarm_uncapped_s": round(uncapped["swarm"], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
