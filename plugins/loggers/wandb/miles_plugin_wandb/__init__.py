"""Logger ``wandb``: every step's metrics and the run's config as a Weights & Biases run.

Offline by default (no network, no account): ``wandb sync <dir>/wandb/offline-run-*`` uploads it
later. Registration imports nothing heavy; ``wandb`` loads when the logger is built.
"""
from miles import hookimpl


@hookimpl
def miles_register_loggers(register):
    from .config import WandbConfig

    register("wandb", _make, config=WandbConfig)


def _make(cfg, *, out_dir, config=None, **_):
    from .logger import WandbLogger

    return WandbLogger(cfg, out_dir=out_dir, config=config)
