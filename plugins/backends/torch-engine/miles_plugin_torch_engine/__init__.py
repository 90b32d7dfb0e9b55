"""miles plugin: the built-in ``torch`` rollout engine (KV-cached batched sampling on one device)."""
from miles import hookimpl


def _make_engine(cfg, **context):
    # Deferred so that `import miles_plugin_torch_engine` (and `miles plugins`) never imports torch.
    from .engine import TorchEngine

    return TorchEngine(cfg, **context)


@hookimpl
def miles_register_engines(register):
    from .config import TorchEngineConfig

    register("torch", _make_engine, config=TorchEngineConfig)


@hookimpl(trylast=True)
def miles_serve(model_dir, host, port, api_key, settings):
    from .server import serve

    return serve(model_dir, host=host, port=port, api_key=api_key, settings=settings)
