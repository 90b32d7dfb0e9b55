"""miles plugin: on-policy distillation (registered as algorithm ``"distill"``).

Only thin hook implementations live here; the torch-using logic is in ``algorithm.py`` and
``teacher.py``, imported when the algorithm is built.
"""
from miles import hookimpl


def _make(cfg, **ctx):
    from .algorithm import Distill

    return Distill(cfg)


@hookimpl
def miles_register_algorithms(register):
    from .config import DistillConfig

    register("distill", _make, config=DistillConfig)
