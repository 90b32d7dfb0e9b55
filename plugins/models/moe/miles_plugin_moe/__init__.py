"""Model spec ``moe``: another spec's mixture-of-experts model with rollout routing replay (R3)."""
from miles import hookimpl


@hookimpl
def miles_register_model_specs(register):
    from .config import MoESpecConfig

    register("moe", _make, config=MoESpecConfig)


def _make(cfg, *, pm=None, **_):
    from .spec import make_spec

    return make_spec(cfg, pm)


@hookimpl
def miles_validate_config(config, pm):
    """The wrapped spec (``model.base``) is resolved through the run's plugin manager."""
    if config.name("model") != "moe":
        return None
    from .config import resolve_base

    from miles import ConfigError

    try:
        resolve_base(config.settings("model").base, pm)
    except ConfigError as e:
        return e.problems
    return None
