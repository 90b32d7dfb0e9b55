"""The ``moe`` model spec: the base spec's mixture-of-experts model with replayable routers.

With ``routing_replay`` on (R3), the spec offers two capabilities:

* ``routing_recorder(model)`` (``miles.protocols.RecordsRouting``): engines record, for every token
  they feed through the model, the expert ids each MoE layer chose, and return them with the
  sample as ``Sample.extensions["moe"]["routed_experts"]``: int32 ``[prompt + response - 1,
  layers, top_k]`` (every prompt token and every response token but the last, which is never fed
  back; SGLang's ``return_routed_experts`` layout).
* ``action_logprobs(model, batch)`` (``ScoresActions``): the trainer's forward replays those
  experts for prompt and response tokens alike, so the trainer computes the rollout's function.
  Gate weights are recomputed from the trainer's own router logits over the recorded experts,
  so the router keeps learning. A sample without a record (e.g. a demonstration) is routed as
  usual.
"""
from __future__ import annotations

from collections.abc import Iterable
import contextlib
from typing import Any

import torch
from miles import Batch, MilesError
from miles.protocols import Architecture, KnowsArchitecture, RoutesExperts
from miles_tokens import routed_experts_rows

from .config import MoESpecConfig, resolve_base
from .router import RoutingState, find_state, install

EXTENSION = "moe"  # Sample.extensions key (the plugin id)


def routing_state(model: torch.nn.Module) -> RoutingState:
    """The routing state shared by ``model``'s replayable routers (copies of a model have their own)."""
    state = find_state(model)
    if state is not None:
        return state
    raise MilesError(f"{type(model).__name__} was not built by the moe model spec (no replayable router)")


def make_spec(cfg: MoESpecConfig, pm: Any = None) -> "MoESpec":
    return (R3Spec if cfg.routing_replay else MoESpec)(cfg, pm)


class MoESpec:
    """A mixture-of-experts model whose routers route as usual (R3 off)."""

    def __init__(self, cfg: MoESpecConfig, pm: Any = None):
        from miles import make_plugin_manager

        self.cfg = cfg
        pm = pm if pm is not None else make_plugin_manager()
        name, settings = resolve_base(cfg.base, pm)
        self.base = pm.create("model_specs", name, settings, pm=pm)
        self._known = sorted(pm.registry("architectures"))

    def architecture(self) -> Architecture | None:
        return self.base.architecture() if isinstance(self.base, KnowsArchitecture) else None

    def build_tokenizer(self, default: Any = None) -> Any:
        return self.base.build_tokenizer(default)

    def build_model(self, tokenizer: Any) -> torch.nn.Module:
        model = self.base.build_model(tokenizer)
        arch = self.architecture()
        try:
            install(model, arch if isinstance(arch, RoutesExperts) else None)
        except ValueError as e:
            plugins = f"; architecture plugins installed: {', '.join(self._known)}" if self._known else ""
            raise MilesError(f"model.name moe: {e}: use model_type qwen3_moe or mixtral (built in), or one "
                             f"an architecture plugin registers with routers{plugins}") from None
        return model

    def save_pretrained(self, named_weights: Iterable[tuple[str, torch.Tensor]], tokenizer: Any,
                        path: str) -> None:
        # router parameters keep their Hugging Face names, so the base spec writes the folder
        self.base.save_pretrained(named_weights, tokenizer, path)


class RoutingRecorder:
    """Engine side of R3: ``recording()`` logs each forward's experts, ``take()`` returns them."""

    extension = EXTENSION

    def __init__(self, state: RoutingState):
        self.state = state

    def recording(self) -> contextlib.AbstractContextManager:
        return self.state.recording()

    def take(self) -> list[torch.Tensor]:
        return self.state.take()

    # miles.protocols.RecordsGraphReplays: the engine's decode steps replayed from a CUDA graph
    def mark(self) -> int:
        return self.state.mark()

    def split_off(self, mark: int) -> list[torch.Tensor]:
        return self.state.split_off(mark)

    def log_copies(self, entries: list[torch.Tensor]) -> None:
        self.state.log_copies(entries)


class R3Spec(MoESpec):
    """A mixture-of-experts model with rollout routing replay."""

    def routing_recorder(self, model: torch.nn.Module) -> RoutingRecorder:
        return RoutingRecorder(routing_state(model))

    def action_logprobs(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """``[B, R]`` log-probs of the response tokens with the recorded experts replayed."""
        state = routing_state(model)
        L, P = batch.input_ids.shape[1], batch.prompt_len
        experts = replay_table(batch, state.num_layers, state.top_k)
        arch = self.architecture()
        if arch is None or arch.padded_batches or batch.attention_mask.dim() != 2:
            with state.replaying(experts.view(-1, state.num_layers, state.top_k)):
                out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                            position_ids=batch.position_ids, use_cache=False)
            logits = out.logits[:, P - 1:L - 1].float()
        else:  # layers that ignore the padding mask: each row from its first prompt token, unpadded
            rows = []
            for i, s in enumerate(batch.samples):
                start = P - len(s.prompt_ids)
                with state.replaying(experts[i, start:]):
                    out = model(input_ids=batch.input_ids[i:i + 1, start:], use_cache=False)
                rows.append(out.logits[0, P - 1 - start:L - 1 - start])
            logits = torch.stack(rows).float()
        if batch.temperature != 1.0:
            logits = logits / batch.temperature
        targets = batch.input_ids[:, P:]
        return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def replay_table(batch: Batch, layers: int, top_k: int) -> torch.Tensor:
    """``[B, P+R, layers, top_k]`` expert ids laid out like the batch's tokens (left-padded prompt,
    then the response); -1 where nothing was recorded (padding, the last response token)."""
    starts = [batch.prompt_len - len(s.prompt_ids) for s in batch.samples]  # each row's first prompt token
    try:
        table = routed_experts_rows(batch.samples, EXTENSION, layers, top_k, batch.input_ids.shape[1], starts)
    except ValueError as e:
        raise MilesError(f"routing replay: {e}; were they recorded by another model? set "
                         f"model.routing_replay=false") from None
    return table.to(batch.input_ids.device)
