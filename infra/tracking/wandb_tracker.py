"""The W&B tracker: one `wandb` run per rl-train run, online or offline (its files under the run's
directory, `wandb sync` them later). Its id is the Prefect flow run id of the invocation that
started it, its name `<run name>-<flow run id>`; a resumed run continues it (`resume="allow"`)."""

from __future__ import annotations

from collections.abc import Sequence

from infra.tracking.channel import Artifact, Finish, Metrics, Op, Params, Text
from infra.tracking.config import WandbTracking
from infra.tracking.run_info import TrackedRun

INIT_TIMEOUT_S = 30


class WandbTracker:
    def __init__(self, settings: WandbTracking, run: TrackedRun) -> None:
        self.settings, self.run = settings, run
        self.id = (run.saved or {}).get("id") or run.flow_run_id
        self.wandb_run = None
        self.step: int | None = None
        """The last step logged: an image or a summary goes in its row (W&B's steps only increase)."""

    def start(self) -> None:
        import wandb

        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True, init_timeout=INIT_TIMEOUT_S)
        self.wandb_run = wandb.init(
            project=self.settings.project,
            entity=self.settings.entity,
            mode=self.settings.mode,
            dir=str(self.run.directory.resolve()),
            id=self.id,
            name=self.run.label,
            resume="allow",
            reinit="create_new",
            tags=[f"prefect:{self.run.flow_run_id}"],
            config={"prefect_flow_run_id": self.run.flow_run_id},
            settings=settings,
        )
        self.run.save({"id": self.id})

    def send(self, ops: Sequence[Op]) -> None:
        import wandb

        if self.wandb_run is None:
            self.start()
        run = self.wandb_run
        assert run is not None
        for op in ops:
            if isinstance(op, Metrics):
                self.step = max(op.step, self.step or 0)
                run.log(dict(op.values), step=self.step)
            elif isinstance(op, Params):
                run.config.update(dict(op.values), allow_val_change=True)
            elif isinstance(op, Artifact):
                run.log({op.path.stem: wandb.Image(str(op.path))}, step=self.step)
            elif isinstance(op, Text):
                run.summary[op.name] = op.text
            elif isinstance(op, Finish):
                run.finish()
                self.wandb_run = None
                return

    def link(self) -> tuple[str, str] | None:
        run = self.wandb_run
        if run is None:
            return None
        if self.settings.mode == "online" and run.url:
            return run.url, "W&B run"
        sync_dir = run.settings.sync_dir
        return f"file://{sync_dir}", f"W&B offline run: `wandb sync {sync_dir}`"
