"""Architectures ``glm4_moe`` (GLM-4.5 to 4.7) and ``glm_moe_dsa`` (GLM-5)."""
from miles import hookimpl


@hookimpl
def miles_register_architectures(register):
    register("glm4_moe", _glm4_moe)
    register("glm_moe_dsa", _glm_moe_dsa)


def _glm4_moe(cfg=None, **_):
    from .arch import Glm4Moe

    return Glm4Moe()


def _glm_moe_dsa(cfg=None, **_):
    from .arch import GlmMoeDsa

    return GlmMoeDsa()
