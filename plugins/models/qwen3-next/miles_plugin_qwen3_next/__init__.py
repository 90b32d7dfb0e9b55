"""Architectures ``qwen3_next`` (Qwen3-Next) and ``qwen3_5_moe_text`` (Qwen3.5/3.6 MoE, text)."""
from miles import hookimpl


@hookimpl
def miles_register_architectures(register):
    register("qwen3_next", _make)
    register("qwen3_5_moe_text", _make)


def _make(cfg=None, **_):
    from .arch import Qwen3Next

    return Qwen3Next()
