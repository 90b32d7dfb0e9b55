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


@hookimpl
def miles_validate_config(config):
    """No CUDA GPU for a cuda device: told with the config, before a run writes anything."""
    if config.name("trainer") != "megatron" or not config.settings("trainer").device.startswith("cuda"):
        return None
    import torch

    if torch.cuda.is_available():
        return None
    return [f"trainer.device: {config.settings('trainer').device!r}, but torch sees no CUDA GPU here, and "
            f"megatron-core's forward needs one; run on a GPU machine or use trainer.name: fsdp2 on CPU"]
