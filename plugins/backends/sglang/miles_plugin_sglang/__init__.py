"""miles plugin: the ``sglang`` rollout engine, a client of SGLang servers (or ``miles serve``)."""
from miles import hookimpl


def _make_engine(cfg, **context):
    # Deferred so that `miles plugins` imports neither httpx nor torch.
    from .engine import SGLangEngine

    return SGLangEngine(cfg, **context)


@hookimpl
def miles_register_engines(register):
    from .config import SGLangEngineConfig

    register("sglang", _make_engine, config=SGLangEngineConfig)
