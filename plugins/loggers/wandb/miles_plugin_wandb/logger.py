"""Weights & Biases sink: ``wandb.init`` once, ``run.log(metrics, step=step)`` per step."""
from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from miles import MilesError
from miles_sinks import earlier_rows, read_config

from .config import WandbConfig
from .offline import last_offline_step

ID_FILE = "wandb_run_id"


def loggable(metrics: dict[str, Any]) -> dict[str, Any]:
    """Numbers and strings of a step; None (a value the step did not have) is left out."""
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float, str))}


class WandbLogger:
    """One W&B run per miles run folder.

    The W&B run id is kept in ``<out_dir>/wandb_run_id``, so rerunning the same command (a resume)
    continues the same W&B run instead of starting a second one. W&B keeps a run's steps
    increasing (it drops a step below the last it holds), so the steps a killed run logged after
    its last checkpoint keep their values and the resumed run starts logging after them. An
    offline run killed before wandb wrote its records loses them: at its first step the rerun
    logs the run folder's earlier steps that the W&B run lacks, so no step is missing.
    """

    def __init__(self, cfg: WandbConfig | None = None, *, out_dir: str, config: dict[str, Any] | None = None):
        import wandb

        cfg = cfg or WandbConfig()
        base = cfg.dir or out_dir
        os.makedirs(base, exist_ok=True)
        id_path = os.path.join(out_dir, ID_FILE)
        run_id = Path(id_path).read_text().strip() if os.path.isfile(id_path) else secrets.token_hex(6)
        # read before init: the segment init opens is still being written
        held = last_offline_step(os.path.join(base, "wandb"), run_id)
        # console capture and system-metrics sampling off: the console logger already prints, and a
        # sampler thread per run costs CPU the rollout needs
        settings = wandb.Settings(console="off", x_disable_stats=True, silent=True)
        try:
            self.run = wandb.init(mode=cfg.mode, project=cfg.project, entity=cfg.entity, tags=cfg.tags or None,
                                  name=cfg.run_name or os.path.basename(os.path.abspath(out_dir)), dir=base,
                                  id=run_id, resume="allow", config=read_config(config, out_dir),
                                  settings=settings, reinit="create_new")
        except Exception as e:  # wandb raises its own error types (auth, network, settings)
            raise MilesError(f"loggers: wandb could not start a {cfg.mode} run ({type(e).__name__}: {e}); "
                             f"use mode: offline (no network) or log in with `wandb login`") from e
        with open(id_path, "w") as f:
            f.write(run_id)
        # online, W&B's server knows the resumed run's next step; offline, the earlier segments do
        self.last_step = max(held, int(getattr(self.run, "starting_step", 0) or 0) - 1)
        self.out_dir, self.first = out_dir, True

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        # W&B drops a step that is not above the last one it holds (a resumed run's replayed
        # steps): those rows are already in the run, so they are skipped here rather than warned about
        steps = [(step, metrics)]
        if self.first:
            steps, self.first = earlier_rows(self.out_dir, step) + steps, False
        for s, m in steps:
            if s > self.last_step:
                self.run.log(loggable(m), step=s)
                self.last_step = s

    def close(self) -> None:
        import wandb

        self.run.finish()
        # finish() returns before wandb's service process has written the run file; teardown
        # waits for that process to exit, so the run folder is complete when the run ends
        wandb.teardown()
