"""Env ``dataset``: RL prompts from local files (jsonl, json, parquet, arrow) and a built-in reward.

Only the registration hook lives here; the files are read in ``loading``, the env is in ``env``.
"""
from miles import hookimpl


@hookimpl
def miles_register_envs(register):
    from .config import DatasetConfig

    register("dataset", _make, config=DatasetConfig)


def _make(cfg, *, seed: int = 0, **_):
    from .env import DatasetEnv

    return DatasetEnv(cfg, seed=seed)
