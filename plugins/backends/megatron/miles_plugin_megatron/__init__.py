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
    """The ``draft:`` section (miles_draft.check, and what this trainer trains of it); no CUDA GPU
    for a cuda device: told with the config, before a run writes anything."""
    out = _draft_problems(config)
    if config.name("trainer") != "megatron" or not config.settings("trainer").device.startswith("cuda"):
        return out or None
    import torch

    if torch.cuda.is_available():
        return out or None
    return out + [f"trainer.device: {config.settings('trainer').device!r}, but torch sees no CUDA GPU here, and "
            f"megatron-core's forward needs one; run on a GPU machine or use trainer.name: fsdp2 on CPU"]


def _draft_problems(config) -> list[str]:
    raw = config.raw.get("draft")
    if raw is None:
        return []
    from miles.config import validate_settings
    from miles_draft.check import problems

    out = problems(config, raw, "megatron", validate_settings)
    if config.name("trainer") != "megatron":
        return out
    if config.settings("trainer").pipeline_parallel > 1:
        out.append("draft.train: trainer megatron trains the draft head (or the model's MTP layers) without "
                   "pipeline stages (only the last stage sees the final hidden states); use "
                   "trainer.pipeline_parallel: 1 or remove the draft: section")
    return out
