"""Model spec ``hf``: any Hugging Face causal LM, from a local folder or an inline config."""
from miles import hookimpl


@hookimpl
def miles_register_model_specs(register):
    from .config import HFModelConfig

    register("hf", _make, config=HFModelConfig)


def _make(cfg, *, pm=None, **_):
    from .spec import HFModelSpec

    return HFModelSpec(cfg, pm)


@hookimpl
def miles_validate_config(config, pm):
    """An inline config the architecture plugin of its model_type cannot build (e.g. experts not
    divisible into routing groups) is reported with the other config problems."""
    if config.name("model") != "hf" or config.settings("model").config is None:
        return None
    inline = config.settings("model").config
    if inline["model_type"] not in pm.registry("architectures"):
        return None
    return pm.create("architectures", inline["model_type"], None).check_config(inline) or None
