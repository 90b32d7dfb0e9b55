"""Trainer ``fsdp2``: PyTorch training of a Hugging Face causal LM (world size 1 is plain torch)."""
from miles import hookimpl


@hookimpl
def miles_register_trainers(register):
    from .config import FSDP2Config

    register("fsdp2", _make, config=FSDP2Config)


def _make(cfg, **context):
    from miles.protocols import CriticAlgorithm

    algorithm = context.get("algorithm")  # None when a trainer is built outside a run (tests, export)
    if isinstance(algorithm, CriticAlgorithm) and algorithm.needs_critic:  # PPO: policy + value model
        from .critic import CriticTrainer

        return CriticTrainer(cfg, **context)
    from .trainer import FSDP2Trainer

    return FSDP2Trainer(cfg, **context)


@hookimpl
def miles_validate_config(config):
    """The top-level ``draft:`` section (online training of a speculative-decoding draft head)."""
    raw = config.raw.get("draft")
    if raw is None:
        return None
    from miles.config import validate_settings
    from miles_draft.check import problems

    return problems(config, raw, "fsdp2", validate_settings)
