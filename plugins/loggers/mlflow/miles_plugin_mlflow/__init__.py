"""Logger ``mlflow``: every step's metrics and the run's config as an MLflow run.

The default tracking store is a SQLite file in the run folder (no server, no network).
Registration imports nothing heavy; ``mlflow`` loads when the logger is built.
"""
from miles import hookimpl


@hookimpl
def miles_register_loggers(register):
    from .config import MlflowConfig

    register("mlflow", _make, config=MlflowConfig)


def _make(cfg, *, out_dir, config=None, **_):
    from .logger import MlflowLogger

    return MlflowLogger(cfg, out_dir=out_dir, config=config)
