"""Trainer ``megatron``: megatron-core GPT models (tensor / pipeline / expert parallel) built from Hugging
Face configs and weights, with Hugging Face names in and out."""
from miles import hookimpl


@hookimpl
def miles_register_trainers(register):
    from .config import MegatronConfig

    register("megatron", _make, config=MegatronConfig)


def _make(cfg, **context):
    if getattr(context.get("algorithm"), "needs_critic", False):  # PPO: policy + value model
        from .critic import MegatronCriticTrainer

        return MegatronCriticTrainer(cfg, **context)
    from .trainer import MegatronTrainer

    return MegatronTrainer(cfg, **context)
