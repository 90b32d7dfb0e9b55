"""Tiny Hugging Face models of every supported family, and a model spec over them, for tests."""
from __future__ import annotations

from typing import Any

import torch

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "attention_bias": False},
    "qwen2": {"model_type": "qwen2", "tie_word_embeddings": True},
    "qwen3": {"model_type": "qwen3", "head_dim": 16},
    "qwen3_moe": {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                      "moe_intermediate_size": 32, "head_dim": 16},
}
BASE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8,
            "num_key_value_heads": 4, "vocab_size": 101, "max_position_embeddings": 64}


def hf_config(family: str, **over: Any) -> Any:
    from transformers import AutoConfig

    kw = {**BASE, **FAMILIES[family], **over}
    return AutoConfig.for_model(kw.pop("model_type"), **kw)


def hf_model(family: str, seed: int = 0, **over: Any) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(hf_config(family, **over)).eval()


class Spec:
    """A model spec over an inline config, as the hf spec builds one."""

    def __init__(self, family: str, **over: Any):
        self.family, self.over = family, over

    def build_tokenizer(self, default: Any = None) -> Any:
        return default

    def build_model(self, tokenizer: Any) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(hf_config(self.family, **self.over))


def batch(seed: int = 1, rows: int = 4, vocab: int = 101, prompt: int = 3, response: int = 5) -> Any:
    """Left-padded prompts (``prompt`` to ``prompt + 2`` tokens) and right-padded responses
    (``response - 3`` to ``response``) of different lengths."""
    from miles import Batch, Sample, Task

    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(rows):
        p = torch.randint(1, vocab, (prompt + i % 3,), generator=g).tolist()
        r = torch.randint(1, vocab, (response - i % 4,), generator=g).tolist()
        samples.append(Sample(task=Task(prompt="x"), prompt_ids=p, response_ids=r, loss_mask=[1] * len(r),
                              logprobs=[0.0] * len(r), reward=float(i % 2)))
    return Batch.from_samples(samples, pad_id=0, advantages=[1.0 if i % 2 else -1.0 for i in range(rows)])


def hf_logprobs(model: torch.nn.Module, b: Any) -> torch.Tensor:
    """The HF model's ``[B, R]`` response log-probs on a padded batch, computed on the model's
    device and returned on the CPU."""
    dev = next(model.parameters()).device
    ids = b.input_ids.to(dev)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=b.attention_mask.to(dev),
                       position_ids=b.position_ids.to(dev)).logits[:, b.prompt_len - 1:-1].float()
    if b.temperature != 1.0:
        logits = logits / b.temperature
    return logits.log_softmax(-1).gather(-1, ids[:, b.prompt_len:, None])[..., 0].cpu()


def read_tensors(path: str, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """The global tensors under ``prefix`` of a megatron checkpoint folder (decoder weights stacked
    over layers, as megatron-core stores them), read in one process without a process group."""
    import torch.distributed.checkpoint as dcp
    from miles_safeload import SafeReader

    meta = SafeReader(path).read_metadata()
    want = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
            if k.startswith(prefix) and "optim." not in k and isinstance(m, dcp.TensorStorageMetadata)}
    dcp.load(want, storage_reader=SafeReader(path), no_dist=True)
    return {k.removeprefix(prefix): v for k, v in want.items()}
