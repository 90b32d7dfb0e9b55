"""Architecture ``gpt_oss`` (gpt-oss)."""
from miles import hookimpl


@hookimpl
def miles_register_architectures(register):
    register("gpt_oss", _make)


def _make(cfg=None, **_):
    from .arch import GptOss

    return GptOss()
