"""Speculative-decoding drafts shared by the torch engine (drafting) and trainers (online training).

``miles_draft.config`` is torch-free; ``miles_draft.head`` and ``miles_draft.train`` import torch.
"""
PREFIX = "draft_head."  # the head's weights sit under this name in the model's state dict
HEAD_FILE = "draft_head.safetensors"  # written beside an exported model
