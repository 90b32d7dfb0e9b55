"""The ``lora`` model spec: peft LoRA adapters injected into the base spec's Hugging Face model.

``build_model`` returns the base model itself with adapter layers injected (peft's LoRA tuner
wraps each targeted ``nn.Linear``), so parameter names stay Hugging Face names plus
``.base_layer`` / ``.lora_A.default`` / ``.lora_B.default`` and the forward signature is the base
model's. The base weights are frozen (``requires_grad=False``), so only adapters train.

Weight sync: ``sync_filter(name)`` tells the loop which weights change during training; after the
first, full sync (the engine builds the same adapted model and must receive the base once) only
adapter tensors move. ``save_pretrained`` merges the adapters into the base weights
(``merge_and_unload``) and writes a plain Hugging Face folder.
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from typing import Any

import torch

from .config import LoraSpecConfig, resolve_base

ADAPTER_MARK = "lora_"  # peft names adapter tensors lora_A / lora_B (and lora_embedding_*)


class LoraSpec:
    def __init__(self, cfg: LoraSpecConfig):
        from miles import make_plugin_manager

        self.cfg = cfg
        name, settings = resolve_base(cfg.base)
        self.base = make_plugin_manager().create("model_specs", name, settings)

    def build_tokenizer(self, default: Any = None) -> Any:
        return self.base.build_tokenizer(default)

    def peft_config(self):
        from peft import LoraConfig

        return LoraConfig(r=self.cfg.r, lora_alpha=self.cfg.alpha, lora_dropout=self.cfg.dropout,
                          target_modules=self.cfg.target_modules, bias="none", task_type="CAUSAL_LM")

    def _peft_model(self, tokenizer: Any):
        import warnings

        from peft import get_peft_model

        base = self.base.build_model(tokenizer)
        with warnings.catch_warnings():  # peft 0.21 asks transformers 5 a deprecated question
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            return get_peft_model(base, self.peft_config())

    def build_model(self, tokenizer: Any) -> torch.nn.Module:
        # the tuned HF model inside peft's wrappers: adapters injected, base frozen, HF forward
        return self._peft_model(tokenizer).base_model.model

    @staticmethod
    def sync_filter(name: str) -> bool:
        """True for weights training changes (the adapters); the frozen base is synced once."""
        return ADAPTER_MARK in name

    def save_pretrained(self, named_weights: Iterable[tuple[str, torch.Tensor]], tokenizer: Any,
                        path: str) -> None:
        """Merge the adapters into the base weights and write a plain Hugging Face folder
        (config, safetensors, tokenizer) that ``AutoModelForCausalLM`` loads, atomically."""
        peft_model = self._peft_model(tokenizer)
        peft_model.base_model.model.load_state_dict(dict(named_weights), strict=True)
        merged = peft_model.merge_and_unload()
        tmp = f"{path.rstrip('/')}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        merged.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
