"""miles-safeload: torch.distributed.checkpoint folders loaded without running code planted in
them (allow-listed unpickling of ``.metadata`` and of non-tensor items). A library: the fsdp2 and
megatron trainers import it."""
from .reader import MetadataUnpickler, SafeReader

__all__ = ["MetadataUnpickler", "SafeReader"]
