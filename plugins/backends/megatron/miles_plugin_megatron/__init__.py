"""Trainer ``megatron``: megatron-core GPT models (tensor / pipeline / expert parallel) built from Hugging
Face configs and weights, with Hugging Face names in and out."""
from miles import hookimpl


@hookimpl
def miles_register_trainers(register):
    from .config import MegatronConfig

    register("megatron", _make, config=MegatronConfig)


def _make(cfg, **context):
    from miles.protocols import CriticAlgorithm

    algorithm = context.get("algorithm")  # None when a trainer is built outside a run (tests, export)
    if isinstance(algorithm, CriticAlgorithm) and algorithm.needs_critic:  # PPO: policy + value model
        from .critic import MegatronCriticTrainer

        return MegatronCriticTrainer(cfg, **context)
    from .trainer import MegatronTrainer

    return MegatronTrainer(cfg, **context)
