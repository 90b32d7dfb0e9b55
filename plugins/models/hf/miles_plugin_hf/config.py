from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class HFModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(None, description="local Hugging Face model folder (weights + config)")
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
        if self.path is not None and not Path(self.path).is_dir():
            raise ValueError(f"model.path {self.path} is not a folder")
        if self.config is not None and "model_type" not in self.config:
            raise ValueError("model.config needs a model_type, e.g. qwen2 or llama")
        if self.tokenizer is not None and not Path(self.tokenizer).is_dir():
            raise ValueError(f"model.tokenizer {self.tokenizer} is not a folder")
        return self
