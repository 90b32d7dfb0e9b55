"""Env ``arith``: zero-padded multi-digit addition with an exact-match verifier (the quickstart), or
arithmetic questions in chat messages graded by their final number, for pretrained chat models."""
from miles import hookimpl


@hookimpl
def miles_register_envs(register):
    from .config import ArithConfig

    register("arith", _make, config=ArithConfig)


def _make(cfg, *, seed: int = 0, **_):
    if cfg.format == "chat":
        from .chat import ArithChatEnv

        return ArithChatEnv(cfg)
    from .env import ArithEnv

    return ArithEnv(cfg, seed=seed)
