"""Diffusion models on diffusers: model spec and engine ``diffusers``, rollout ``diffusion``,
env ``shapes`` (coloured shapes with a pixel verifier)."""
from miles import hookimpl


@hookimpl
def miles_register_model_specs(register):
    from .config import DiffusersModelConfig

    register("diffusers", _spec, config=DiffusersModelConfig)


@hookimpl
def miles_register_engines(register):
    from .config import DiffusersEngineConfig

    register("diffusers", _engine, config=DiffusersEngineConfig)


@hookimpl
def miles_register_rollouts(register):
    from .config import DiffusionRolloutConfig

    register("diffusion", _rollout, config=DiffusionRolloutConfig)


@hookimpl
def miles_register_envs(register):
    from .config import ShapesEnvConfig

    register("shapes", _env, config=ShapesEnvConfig)


def _spec(cfg, **_):
    from .spec import DiffusersSpec

    return DiffusersSpec(cfg)


def _engine(cfg, **context):
    from .engine import DiffusersEngine

    return DiffusersEngine(cfg, **context)


def _rollout(cfg, **context):
    from .rollout import DiffusionRollout

    return DiffusionRollout(cfg, **context)


def _env(cfg, *, seed: int = 0, **_):
    from .env import ShapesEnv

    return ShapesEnv(cfg, seed=seed)


@hookimpl
def miles_validate_config(config):
    """The diffusion pieces only work together: caught before any model is built."""
    from .config import cross_section_problems

    return cross_section_problems(config)
