"""Model spec ``lora``: another model spec's model with peft LoRA adapters; only they train."""
from miles import hookimpl


@hookimpl
def miles_register_model_specs(register):
    from .config import LoraSpecConfig

    register("lora", _make, config=LoraSpecConfig)


def _make(cfg, **_):
    from .spec import LoraSpec

    return LoraSpec(cfg)
