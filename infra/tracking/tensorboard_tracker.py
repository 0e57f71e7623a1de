"""The TensorBoard tracker: event files written by `torch.utils.tensorboard.SummaryWriter` (it
needs the `tensorboard` package) in `<dir>/<run name>-<flow run id>`; a resumed run writes on in
the same directory. Metrics are scalars, the configuration and the final checkpoint texts, the
curves an image."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from infra.tracking.channel import Artifact, Finish, Metrics, Op, Params, Text
from infra.tracking.config import TensorboardTracking
from infra.tracking.run_info import TrackedRun

LOCAL_UI = "http://localhost:6006"
"""Where `tensorboard --logdir` serves by default."""


class TensorboardTracker:
    def __init__(self, settings: TensorboardTracking, run: TrackedRun) -> None:
        self.root = (settings.dir or run.directory / "tensorboard").resolve()
        saved = run.saved or {}
        self.logdir = Path(saved["logdir"]) if "logdir" in saved else self.root / run.label
        self.run = run
        self.writer = None

    def start(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(self.logdir))
        self.writer.add_text("prefect_flow_run_id", self.run.flow_run_id)
        self.writer.flush()
        self.run.save({"logdir": str(self.logdir)})

    def send(self, ops: Sequence[Op]) -> None:
        if self.writer is None:
            self.start()
        writer = self.writer
        assert writer is not None
        for op in ops:
            if isinstance(op, Metrics):
                for key, value in op.values.items():
                    writer.add_scalar(key, value, op.step)
            elif isinstance(op, Params):
                rows = "\n".join(f"| {key} | {value} |" for key, value in op.values.items())
                writer.add_text("config", "| key | value |\n|---|---|\n" + rows)
            elif isinstance(op, Artifact):
                from matplotlib.image import imread

                writer.add_image(op.path.stem, imread(op.path), dataformats="HWC")
            elif isinstance(op, Text):
                writer.add_text(op.name, op.text)
            elif isinstance(op, Finish):
                writer.close()
                self.writer = None
                return
        writer.flush()

    def link(self) -> tuple[str, str]:
        return f"{LOCAL_UI}/?runFilter={self.logdir.name}", f"TensorBoard run: `tensorboard --logdir {self.root}`"
