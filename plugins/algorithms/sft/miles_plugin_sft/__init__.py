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
def miles_validate_warm_start(settings, pm):
    """``run.warm_start`` by this plugin's schema, its algorithm registered."""
    from .warmstart import check

    return check(settings, pm)


@hookimpl
def miles_validate_config(config, pm):
    """``run.warm_start.trainer`` over the trainer section, checked by the trainer's own schema."""
    if config.run.warm_start is None or config.name("trainer") not in pm.registry("trainers"):
        return None
    from .warmstart import settings, trainer_settings

    problems = []
    ws = settings(config.run.warm_start, problems)
    if ws is not None:
        trainer_settings(config, pm, ws, problems)
    return problems
