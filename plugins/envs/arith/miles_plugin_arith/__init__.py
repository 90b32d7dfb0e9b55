"""Env ``arith``: zero-padded multi-digit addition with an exact-match verifier (the quickstart)."""
from miles import hookimpl


@hookimpl
def miles_register_envs(register):
    from .config import ArithConfig

    register("arith", _make, config=ArithConfig)


def _make(cfg, *, seed: int = 0, **_):
    from .env import ArithEnv

    return ArithEnv(cfg, seed=seed)
