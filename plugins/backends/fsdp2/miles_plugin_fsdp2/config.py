from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class FSDP2Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    world_size: Literal[1] = Field(1, description="trainer ranks (multi-rank FSDP2 needs a launcher; "
                                                  "only 1 is supported so far)")
    device: str = Field("cpu", description="cpu, cuda, cuda:N or auto")
    lr: float = Field(1e-4, gt=0, description="AdamW peak learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    grad_clip: float | None = Field(1.0, gt=0, description="max global grad norm (null = off)")
    micro_batch_size: int | None = Field(None, gt=0, description="rows per forward/backward "
                                         "(gradient accumulation); null = the whole batch at once")
    warmup_steps: int = Field(0, ge=0, description="linear LR warm-up, in optimizer steps")
    schedule: Literal["constant", "cosine", "linear"] = Field("constant", description="LR decay after warm-up")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="floor of the decayed LR, as a fraction of lr")
