"""Model spec ``lora``: another model spec's model with peft LoRA adapters; only they train."""
from miles import hookimpl


@hookimpl
def miles_register_model_specs(register):
    from .config import LoraSpecConfig

    register("lora", _make, config=LoraSpecConfig)


def _make(cfg, *, pm=None, **_):
    from .spec import LoraSpec

    return LoraSpec(cfg, pm)


@hookimpl
def miles_validate_config(config, pm):
    """The wrapped spec (``model.base``) is resolved through the run's plugin manager, so a
    launch-time plugin's spec can be adapted too."""
    if config.name("model") != "lora":
        return None
    from .config import resolve_base

    from miles import ConfigError

    try:
        resolve_base(config.settings("model").base, pm)
    except ConfigError as e:
        return e.problems
    return None
