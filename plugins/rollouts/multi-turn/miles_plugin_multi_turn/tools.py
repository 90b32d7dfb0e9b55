"""The env capability this rollout needs (``miles.protocols.OffersTools``), checked up front."""
from __future__ import annotations

from typing import Any

from miles import MilesError
from miles.protocols import OffersTools


def tool_env(env: Any) -> OffersTools:
    """``env`` if it offers tools, else an error that says what to pick instead."""
    if not isinstance(env, OffersTools):
        raise MilesError(f"rollout.name: multi_turn needs an env that offers tools (tools() and "
                         f"call_tool(name, arguments, task)); {type(env).__name__} has none: pick a "
                         f"tool env (e.g. env.name: tool_use) or rollout.name: single_turn")
    return env
