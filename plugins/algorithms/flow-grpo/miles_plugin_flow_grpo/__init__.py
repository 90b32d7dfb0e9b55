"""Algorithm ``flow-grpo``: GRPO over the denoising steps of flow-matching image samples."""
from miles import hookimpl


@hookimpl
def miles_register_algorithms(register):
    from .config import FlowGRPOConfig

    register("flow-grpo", _make, config=FlowGRPOConfig)


def _make(cfg, **_):
    from .algorithm import FlowGRPO

    return FlowGRPO(cfg)


@hookimpl
def miles_validate_config(config):
    """What the algorithm needs from the other sections, caught before any model is built."""
    from .config import cross_section_problems

    return cross_section_problems(config)
