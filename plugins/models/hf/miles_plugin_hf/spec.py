"""Build a Hugging Face causal LM and tokenizer (no hub access: local folders or inline configs)."""
from __future__ import annotations

from typing import Any

import torch
from miles import MilesError
from miles.protocols import Architecture, CarriesMTP

from .config import HFModelConfig


class HFModelSpec:
    def __init__(self, cfg: HFModelConfig, pm: Any = None):
        self.cfg, self._pm = cfg, pm
        self._arch: list[Architecture | None] = []  # looked up once, on first use

    def model_type(self) -> str | None:
        if self.cfg.config is not None:
            return self.cfg.config["model_type"]
        if self.cfg.gguf_file is not None:  # the GGUF header names the architecture (no tensors read)
            from transformers import AutoConfig

            return AutoConfig.from_pretrained(self.cfg.folder, gguf_file=self.cfg.gguf_file).model_type
        import json
        from pathlib import Path

        return json.loads((Path(self.cfg.folder) / "config.json").read_text()).get("model_type")

    def architecture(self) -> Architecture | None:
        """The ``Architecture`` an installed plugin registers for this model's ``model_type``."""
        if not self._arch:
            from miles import make_plugin_manager

            pm = self._pm if self._pm is not None else make_plugin_manager()
            self._arch.append(pm.architecture(self.model_type()))
        return self._arch[0]

    def build_tokenizer(self, default: Any = None) -> Any:
        from transformers import AutoTokenizer

        folder = self.cfg.tokenizer or self.cfg.folder
        if folder is None:
            if default is None:
                raise MilesError("model.tokenizer is not set and the env offers no tokenizer; "
                                 "set model.tokenizer to a local tokenizer folder")
            return default
        gguf = {"gguf_file": self.cfg.gguf_file} if self.cfg.gguf_file and not self.cfg.tokenizer else {}
        tok = AutoTokenizer.from_pretrained(folder, **gguf)
        if tok.pad_token_id is None:  # batching needs a pad id; eos is the usual stand-in
            tok.pad_token = tok.eos_token
        return tok

    def build_model(self, tokenizer: Any) -> torch.nn.Module:
        """The model, with the multi-token-prediction layers its checkpoint carries where its
        architecture plugin attaches them (``CarriesMTP``; transformers drops them)."""
        model = self._build(tokenizer)
        arch = self.architecture()
        if isinstance(arch, CarriesMTP):
            from_folder = self.cfg.path is not None and self.cfg.gguf_file is None
            arch.attach_mtp(model, self.cfg.folder if from_folder else None)
        return model

    def _build(self, tokenizer: Any) -> torch.nn.Module:
        from transformers import AutoConfig, AutoModelForCausalLM

        dtype = getattr(torch, self.cfg.dtype)
        if self.cfg.gguf_file is not None:
            return _from_gguf(self.cfg.folder, self.cfg.gguf_file, dtype)
        if self.cfg.path is not None:  # an INT4 export (compressed-tensors) loads dequantized, to train on
            from miles_lowp.compressed import dense_load_kwargs

            return AutoModelForCausalLM.from_pretrained(self.cfg.folder, dtype=dtype,
                                                        **dense_load_kwargs(self.cfg.folder))
        kw = dict(self.cfg.config)
        model_type = kw.pop("model_type")
        kw.setdefault("vocab_size", len(tokenizer))
        if kw["vocab_size"] < len(tokenizer):  # token ids past the embedding would fail mid-run
            raise MilesError(f"model.config.vocab_size ({kw['vocab_size']}) is smaller than the tokenizer's "
                             f"{len(tokenizer)} tokens; raise it or leave it out (it defaults to the tokenizer's)")
        for key in ("pad_token_id", "eos_token_id", "bos_token_id"):
            if getattr(tokenizer, key, None) is not None:
                kw.setdefault(key, getattr(tokenizer, key))
        try:
            config = AutoConfig.for_model(model_type, **kw)
        except (ValueError, TypeError) as e:
            raise MilesError(f"model.config: {e}") from None
        return AutoModelForCausalLM.from_config(config, dtype=dtype)

    def save_pretrained(self, named_weights, tokenizer: Any, path: str) -> None:
        """Write a Hugging Face folder (config, safetensors, tokenizer) into ``path``, which must be
        new or empty: nothing already there is removed or overwritten."""
        import os

        if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
            raise MilesError(f"{path} exists and is not an empty folder; pick a new folder")
        model = self.build_model(tokenizer)
        model.load_state_dict(dict(named_weights), strict=True)
        model.save_pretrained(path, safe_serialization=True)
        tokenizer.save_pretrained(path)


def _from_gguf(folder: str, name: str, dtype: torch.dtype) -> torch.nn.Module:
    """A causal LM from a GGUF file, dequantized by transformers' GGUF loader. The model keeps no
    trace of the file's quantization, so it trains, checkpoints and saves as a plain float model
    (transformers refuses to save a model that still carries the GGUF quantizer)."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    except (ValueError, OSError, KeyError) as e:
        raise MilesError(f"model.gguf_file {name} in {folder} could not be loaded: {str(e)[:300]}") from None
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model
