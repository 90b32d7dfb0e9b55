"""miles plugin: supervised fine-tuning (registered as algorithm ``"sft"``) and the supervised
warm start before RL (``run.warm_start``, hook ``miles_warm_start``).

Only thin hook implementations live here; the torch-using logic is in ``algorithm.py``, the warm
start in ``warmstart.py``.
"""
from miles import hookimpl


def _make(cfg, **ctx):
    from .algorithm import SFT

    return SFT(cfg)


@hookimpl
def miles_register_algorithms(register):
    from .config import SFTConfig

    register("sft", _make, config=SFTConfig)


@hookimpl
def miles_warm_start(run, settings):
    from .warmstart import warm_start

    return warm_start(run, settings)


@hookimpl
def miles_validate_config(config, pm):
    """``run.warm_start`` by this plugin's schema, its algorithm registered, and its ``trainer``
    over the trainer section checked by the trainer's own schema; problems name ``run.warm_start.<key>``."""
    if config.run.warm_start is None:
        return None
    from .warmstart import check

    return check(config, pm)
