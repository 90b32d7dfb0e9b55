"""Algorithm ``diffusion-nft``: DiffusionNFT (arXiv 2509.16117) for flow-matching image models."""
from miles import hookimpl


@hookimpl
def miles_register_algorithms(register):
    from .config import DiffusionNFTConfig

    register("diffusion-nft", _make, config=DiffusionNFTConfig)


def _make(cfg, **_):
    from .algorithm import DiffusionNFT

    return DiffusionNFT(cfg)


@hookimpl
def miles_validate_config(config):
    """What the algorithm needs from the other sections, caught before any model is built."""
    from .config import cross_section_problems

    return cross_section_problems(config)
