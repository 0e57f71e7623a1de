"""A standalone weights instance: a process that pulls versions on command and serves them.

    python -m tests.infra.weights.instance --redis-url URL --instance-id ID [--run-dir DIR]

One JSON command per line on stdin, one JSON answer per line on stdout:
- ``{"op": "open", "run_id", "config": {<WeightsConfig>}}`` -> ``{"op": "opened", "url"}``: a fresh
  `WeightPuller` for that run and config (its peer server's URL, or null);
- ``{"op": "pull", "run_id", "version", "config"}`` -> ``{"op": "pulled", "version", "url",
  "ready_at", "report": <PullReport>}`` or ``{"op": "error", "version", "error"}`` (opens a puller
  first unless the current one has that run and config);
- ``{"op": "fingerprint", "version"}`` -> ``{"op": "fingerprint", "version", "fingerprint"}``, of a
  held version (apart from "pull", so checking weights costs no CPU while others still pull);
- ``{"op": "drop"}`` -> ``{"op": "dropped"}``: closes the puller (stops serving, leaves the registry).
End of input closes the puller and exits. A test harness (run from the repository root): the
integration tests use it for peers that are real processes (killed with SIGKILL), bench/weights.py
for its instances; rollout workers embed `WeightPuller`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import redis
import torch

from infra.weights.config import WeightsConfig
from infra.weights.manifest import fingerprint
from infra.weights.puller import WeightPuller


def _answer(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


class _Instance:
    def __init__(self, client: redis.Redis, instance_id: str, run_dir: str | None) -> None:
        self.client = client
        self.instance_id = instance_id
        self.run_dir = run_dir
        self.puller: WeightPuller | None = None
        self._opened_for: tuple[str, WeightsConfig] | None = None

    def open(self, run_id: str, config: WeightsConfig) -> WeightPuller:
        if self.puller is None or self._opened_for != (run_id, config):
            self.drop()
            self.puller = WeightPuller(config, self.client, run_id, self.instance_id, run_dir=self.run_dir)
            self._opened_for = (run_id, config)
        return self.puller

    def drop(self) -> None:
        if self.puller is not None:
            self.puller.close()
        self.puller, self._opened_for = None, None

    def handle(self, command: dict) -> dict:
        op = command["op"]
        if op == "drop":
            self.drop()
            return {"op": "dropped"}
        if op == "fingerprint":
            version = int(command["version"])
            return {"op": "fingerprint", "version": version, "fingerprint": fingerprint(self.puller.pull(version))}
        puller = self.open(command["run_id"], WeightsConfig.model_validate(command.get("config", {})))
        if op == "open":
            return {"op": "opened", "url": puller.url}
        version = int(command["version"])
        try:
            puller.pull(version)
        except Exception as exc:
            return {"op": "error", "version": version, "error": f"{type(exc).__name__}: {exc}"}
        ready_at = time.time()
        return {
            "op": "pulled",
            "version": version,
            "url": puller.url,
            "ready_at": ready_at,
            "report": dataclasses.asdict(puller.last_report),
        }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--instance-id", required=True)
    parser.add_argument("--run-dir", default=None, help="run directory (default store location)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    instance = _Instance(redis.Redis.from_url(args.redis_url), args.instance_id, args.run_dir)
    try:
        for line in sys.stdin:
            _answer(instance.handle(json.loads(line)))
    finally:
        instance.drop()


if __name__ == "__main__":
    main()
