"""TensorBoard sink: one scalar per numeric metric per step, the config as a text summary."""
from __future__ import annotations

import glob
import os
from typing import Any

from miles_sinks import HeldPoints, config_text, earlier_rows, numeric

from .config import TensorBoardConfig


class TensorBoardLogger:
    """Writes ``<log_dir>/events.out.tfevents.*``; open it with ``tensorboard --logdir <log_dir>``.

    The writer opens at the first logged step: a rerun (event files already there) starts with a
    purge marker at that step, so TensorBoard drops the points a killed run wrote from there on
    (after its last checkpoint, or all of them when it restarts from step 0) instead of showing
    them twice. When the event files lack some earlier steps of the run folder's metrics.jsonl
    (points a killed writer had not flushed), the marker goes at the first of them and those steps
    are written again from metrics.jsonl, in step order, so no step is missing either.
    """

    def __init__(self, cfg: TensorBoardConfig | None = None, *, out_dir: str,
                 config: dict[str, Any] | None = None):
        cfg = cfg or TensorBoardConfig()
        self.log_dir = cfg.log_dir or os.path.join(out_dir, "tensorboard")
        self.flush_secs = cfg.flush_secs
        self.config = config_text(config, out_dir)
        self.out_dir = out_dir
        self.writer: Any = None

    def _open(self, step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        resumed = bool(glob.glob(os.path.join(self.log_dir, "events.out.tfevents.*")))
        earlier = earlier_rows(self.out_dir, step)
        purge, start = None, -1  # earlier steps from ``start`` on are written (all: no event files yet)
        if resumed:  # from the first step whose points are not all there (a killed writer's unflushed tail)
            held = self._held()
            purge = start = min([s for s, row in earlier if held.fresh(s, numeric(row))] + [step])
        self.writer = SummaryWriter(self.log_dir, purge_step=purge, flush_secs=self.flush_secs)
        if self.config is not None:
            # markdown code block: TensorBoard's text tab keeps the YAML's indentation
            self.writer.add_text("config", "```yaml\n" + self.config + "```", global_step=step)
        for s, row in earlier:
            if s >= start:  # in step order, after the purge marker
                for key, value in numeric(row).items():
                    self.writer.add_scalar(key, value, global_step=s)

    def _held(self) -> HeldPoints:
        """The scalar points the event files already there hold, as TensorBoard reads them."""
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        ea = EventAccumulator(self.log_dir, size_guidance={"scalars": 0})
        ea.Reload()
        return HeldPoints((tag, e.step) for tag in ea.Tags()["scalars"] for e in ea.Scalars(tag))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if self.writer is None:
            self._open(step)
        for key, value in numeric(metrics).items():
            # NaN/inf are written as they are: TensorBoard marks them, which is the signal wanted
            self.writer.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
