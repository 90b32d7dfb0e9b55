"""miles plugin: supervised fine-tuning (registered as algorithm ``"sft"``).

Only thin hook implementations live here; the torch-using logic is in ``algorithm.py``.
"""
from miles import hookimpl


def _make(cfg, **ctx):
    from .algorithm import SFT

    return SFT(cfg)


@hookimpl
def miles_register_algorithms(register):
    from .config import SFTConfig

    register("sft", _make, config=SFTConfig)
