"""The ``lora`` model spec: peft LoRA adapters injected into the base spec's model.

``build_model`` returns the base model itself with adapter layers injected (peft's LoRA tuner
wraps each targeted ``nn.Linear``), so parameter names stay the base's names plus
``.base_layer`` / ``.lora_A.default`` / ``.lora_B.default`` and the forward signature is the base
model's. The base weights are frozen (``requires_grad=False``), so only adapters train.

The base may be a causal LM (``hf``) or any other spec, e.g. a diffusion transformer
(``diffusers``, a ``ScoresActions`` spec): every public capability the lora spec does not define
itself (``action_logprobs``, a text encoder, ...) is the base spec's, so engines and trainers see
the base spec with adapters.

Weight sync: ``sync_filter(name)`` tells the loop which weights change during training; after the
first, full sync (the engine builds the same adapted model and must receive the base once) only
adapter tensors move. ``save_pretrained`` merges the adapters into the base weights
(``merge_and_unload``) and writes the base's own folder: a plain Hugging Face folder for a causal
LM, the base spec's export (e.g. a diffusers folder) otherwise.
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from typing import Any

import torch
from miles import MilesError
from miles.protocols import Exports

from .config import LoraSpecConfig, resolve_base

ADAPTER_MARK = "lora_"  # peft names adapter tensors lora_A / lora_B (and lora_embedding_*)


class LoraSpec:
    def __init__(self, cfg: LoraSpecConfig, pm: Any = None):
        from miles import make_plugin_manager

        self.cfg = cfg
        pm = pm if pm is not None else make_plugin_manager()  # the run's, when the kernel builds it
        name, settings = resolve_base(cfg.base, pm)
        self.base = pm.create("model_specs", name, settings, pm=pm)

    def __getattr__(self, name: str) -> Any:
        # only reached for attributes the lora spec lacks: the base spec's capabilities
        base = self.__dict__.get("base")
        if name.startswith("_") or base is None:
            raise AttributeError(name)
        return getattr(base, name)

    @property
    def causal_lm(self) -> bool:
        """A base that scores its own actions (e.g. a diffusion transformer) is not a causal LM."""
        from miles.protocols import ScoresActions

        return not isinstance(self.base, ScoresActions)

    def build_tokenizer(self, default: Any = None) -> Any:
        return self.base.build_tokenizer(default)

    def peft_config(self):
        from peft import LoraConfig

        return LoraConfig(r=self.cfg.r, lora_alpha=self.cfg.alpha, lora_dropout=self.cfg.dropout,
                          target_modules=self.cfg.target_modules, bias="none",
                          task_type="CAUSAL_LM" if self.causal_lm else None)

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
        (config, safetensors, tokenizer) that ``AutoModelForCausalLM`` loads, atomically; for a
        base that is not a causal LM, the base spec writes the merged weights its own way."""
        peft_model = self._peft_model(tokenizer)
        peft_model.base_model.model.load_state_dict(dict(named_weights), strict=True)
        merged = peft_model.merge_and_unload()
        if not self.causal_lm:
            if not isinstance(self.base, Exports):
                raise MilesError(f"model.base: spec {type(self.base).__name__} cannot export; "
                                 f"miles export needs a base spec with save_pretrained")
            self.base.save_pretrained(merged.state_dict().items(), tokenizer, path)
            return
        tmp = f"{path.rstrip('/')}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        merged.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
