"""Env ``tool_use``: multiplication with a calculator tool (the tool-use quickstart).

Only the registration hook lives here; the env is in ``env``, its tools in ``tools``.
"""
from miles import hookimpl


@hookimpl
def miles_register_envs(register):
    from .config import ToolUseConfig

    register("tool-use", _make, config=ToolUseConfig)


def _make(cfg, *, seed: int = 0, **_):
    from .env import ToolUseEnv

    return ToolUseEnv(cfg, seed=seed)
