"""The draft head's file: ``draft_head.safetensors`` beside an exported model (or anywhere)."""
from __future__ import annotations

import os
from typing import Iterable, Iterator

import torch

from . import HEAD_FILE, PREFIX


def split(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[tuple[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """A model's named weights without the head's, and the head's (names without ``draft_head.``)."""
    model, head = [], {}
    for name, t in named:
        if name.startswith(PREFIX):
            head[name[len(PREFIX):]] = t
        else:
            model.append((name, t))
    return model, head


def without_head(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A model's named weights without the head's (the policy's alone, as an export writes them)."""
    return ((name, t) for name, t in named if not name.startswith(PREFIX))


def save_head(head: dict[str, torch.Tensor], folder: str) -> str:
    from safetensors.torch import save_file

    path = os.path.join(folder, HEAD_FILE)
    save_file({k: v.detach().contiguous().cpu() for k, v in head.items()}, path)
    return path


def head_file(path: str) -> str:
    """``path`` itself, or the ``draft_head.safetensors`` in the folder ``path``."""
    return os.path.join(path, HEAD_FILE) if os.path.isdir(path) else path


def load_head(module: torch.nn.Module, path: str) -> None:
    """Weights of ``module`` (a ``DraftHead``) from ``path``; a clear error names the file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from miles import MilesError

    file = head_file(path)
    if not os.path.isfile(file):
        raise MilesError(f"draft head {file} does not exist; export a run that trained one (a draft: section) "
                         f"with miles export, or leave engine.speculative.path unset")
    try:
        state = load_file(file)
    except (SafetensorError, OSError) as e:
        raise MilesError(f"draft head {file} is not a readable safetensors file ({e})") from None
    for name in ("draft_vocab", "vocab_counts"):  # a file of a head without them scores every token
        if name not in state and name in module.state_dict():
            state[name] = module.state_dict()[name]
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as e:
        first = str(e).splitlines()[1].strip() if len(str(e).splitlines()) > 1 else str(e)
        raise MilesError(f"draft head {file} does not fit this model ({first}); it was trained for another "
                         f"model") from None
