"""Model spec ``hf``: any Hugging Face causal LM, from a local folder or an inline config."""
from miles import hookimpl


@hookimpl
def miles_register_model_specs(register):
    from .config import HFModelConfig

    register("hf", _make, config=HFModelConfig)


def _make(cfg, *, pm=None, **_):
    from .spec import HFModelSpec

    return HFModelSpec(cfg, pm)
