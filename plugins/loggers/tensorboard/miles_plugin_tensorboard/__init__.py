"""Logger ``tensorboard``: scalars of every step and the run's config as TensorBoard event files.

Registration imports nothing heavy; the writer (torch's ``SummaryWriter``) loads on first use.
"""
from miles import hookimpl


@hookimpl
def miles_register_loggers(register):
    from .config import TensorBoardConfig

    register("tensorboard", _make, config=TensorBoardConfig)


def _make(cfg, *, out_dir, config=None, **_):
    from .logger import TensorBoardLogger

    return TensorBoardLogger(cfg, out_dir=out_dir, config=config)
