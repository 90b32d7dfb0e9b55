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


@hookimpl
def miles_validate_config(config):
    """``engine.weights_dtype`` against the trainer's precision: Miles' supported pairs
    (``miles_lowp.pairs``), refused before a run starts."""
    if config.name("engine") != "torch" or config.name("trainer") is None:
        return None
    from miles.protocols import TrainsInPrecision
    from miles_lowp.pairs import pair_problem

    engine, trainer = config.settings("engine"), config.settings("trainer")
    if not isinstance(trainer, TrainsInPrecision):  # a trainer without low-precision GEMMs or QAT
        problem = pair_problem("bf16", None, engine.weights_dtype)
        return [problem] if problem else None
    problem = pair_problem(trainer.precision, trainer.qat, engine.weights_dtype)
    if problem is None and trainer.qat is not None and trainer.qat_scope != engine.quant_scope:
        problem = (f"engine.quant_scope: {engine.quant_scope} with trainer.qat_scope: {trainer.qat_scope}: the "
                   f"engine must serve INT4 exactly the weights QAT rounds; set both to the same scope")
    return [problem] if problem else None
