"""Architectures ``deepseek_v3`` (DeepSeek-V3, Kimi-K2) and ``deepseek_v4`` (DeepSeek-V4)."""
from miles import hookimpl


@hookimpl
def miles_register_architectures(register):
    register("deepseek_v3", _v3)
    register("deepseek_v4", _v4)


def _v3(cfg=None, **_):
    from .arch import DeepseekV3

    return DeepseekV3()


def _v4(cfg=None, **_):
    from .arch import DeepseekV4

    return DeepseekV4()
