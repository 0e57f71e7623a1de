"""The record of one evaluation (`EvalResult`): what the trackers, the ledger's eval $ and the CLI report.

An evaluation is `eval.samples` responses to each of `eval.size` held-out problems by one policy
version (a step's, or a checkpoint's), scored as pass@k and avg@k (`rl.pass_at_k`), either in the
training process (`in_process`) or on the run's rollout fabric (`fabric`). `to_json` is one flat
JSON object; `write` puts it under the run's directory, `<run>/evals/step_NNNNNN.<where>.json`;
`metrics` is what the experiment trackers get (under `eval/`).
It loads no runtime (pydantic and the standard library), as the step record.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

Where = Literal["in_process", "fabric"]


class EvalResult(BaseModel):
    """pass@k and avg@k of one policy version, and what the evaluation took."""

    model_config = ConfigDict(frozen=True)

    run: str
    """The run's name (`run.name`)."""
    step: int
    """The policy version evaluated (= the step that produced it; 0 is the base policy)."""
    where: Where
    pass_at_k: dict[int, float]
    """Unbiased pass@k for each `eval.k`."""
    avg_at_k: float
    """Mean accuracy over every sample (unbiased avg@k for every k; the step table's eval accuracy)."""
    problems: int
    samples: int
    """Samples scored in all (problems x `eval.samples`, less those failed for the infrastructure)."""
    temperature: float
    seconds: float
    checkpoint: str | None = None
    """The checkpoint directory evaluated (None: the training process's live policy)."""
    preemptions: int = 0
    """Instances preempted while the evaluation ran on the fabric."""
    migrations: int = 0
    """Samples continued on another instance from their logged tokens."""
    tokens: int = 0
    """Tokens the instances generated for it (wasted ones included)."""
    cost_usd: float = 0.0
    """Its eval $: what the fabric's instances cost while they ran it (the ledger's run `ledger_run_id`)."""
    ledger_run_id: str | None = None

    def to_json(self) -> dict:
        return json.loads(self.model_dump_json())

    def write(self, run_dir: Path) -> Path:
        """Write the record to `<run_dir>/evals/step_NNNNNN.<where>.json` atomically; returns the file."""
        path = Path(run_dir) / "evals" / f"step_{self.step:06d}.{self.where}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text(self.model_dump_json(indent=1) + "\n")
        os.replace(temporary, path)
        return path

    def metrics(self) -> dict[str, float]:
        """Its numbers as tracker metrics: `pass_at_<k>` for each k, `avg_at_k`, `samples`, and the
        eval $ (`cost_usd`) of a fabric evaluation (names MLflow accepts: no `@`)."""
        metrics = {f"pass_at_{k}": value for k, value in sorted(self.pass_at_k.items())}
        metrics |= {"avg_at_k": self.avg_at_k, "samples": float(self.samples)}
        if self.where == "fabric":
            metrics["cost_usd"] = self.cost_usd
        return metrics

    def line(self) -> str:
        """One human line: `step 3: pass@1 0.41, pass@4 0.72, avg@k 0.41 (64 samples, 8 problems)`."""
        passes = ", ".join(f"pass@{k} {v:.3f}" for k, v in sorted(self.pass_at_k.items()))
        return f"step {self.step}: {passes}, avg@k {self.avg_at_k:.3f} ({self.samples} samples of {self.problems} problems)"
