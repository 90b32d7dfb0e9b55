"""Rollout routing replay, engine side: the experts each token went to, returned with its sample.

When the model spec records routing (``miles.protocols.RecordsRouting``), every generic-path
chunk runs inside the recorder; its forwards are one prefill of the (left-padded) prompts and one
decode per step over ``prompts x n`` rows. A completion's record is its prompt's prefill rows
followed by the decode rows of every response token but the last (which is never fed back):
``[prompt + response - 1, layers, top_k]`` int32, in ``Completion.extras``.

With the MTP layer drafting (``hf_speculative.py``) a step's forward is a verify block of ``k + 1``
positions per row, of which a row keeps the first ``kept`` (its last token and the drafts it
accepted, up to its stop or token budget): only those rows enter the record, so it is what plain
generation of the same tokens records. The MTP layer's own routers are not hooked (the
architectures' ``routers`` skip them), so its draft steps record nothing.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from miles import Completion
from miles.protocols import RecordsRouting


class RoutingLog:
    def __init__(self, recorder: Any):
        self.recorder = recorder

    @classmethod
    def for_spec(cls, spec: Any, model: torch.nn.Module) -> "RoutingLog | None":
        return cls(spec.routing_recorder(model)) if isinstance(spec, RecordsRouting) else None

    def run(self, chunk: Callable[..., list[Completion]], prompts: Sequence[Sequence[int]], n: int,
            *args: Any) -> list[Completion]:
        """``chunk(prompts, n, *args)``'s completions (``n`` per prompt, adjacent), each with its
        routed experts; its forwards after the prefill are one-token decodes."""
        with self.recorder.recording():
            comps = chunk(prompts, n, *args)
        forwards = self.recorder.take()
        if forwards:
            fed = [max(len(c.token_ids) - 1, 0) for c in comps]
            # decode t feeds response token t: a row keeps it while t < its fed count
            self._attach(comps, prompts, n, forwards, [[int(t < f) for f in fed] for t in range(len(forwards) - 1)])
        return comps

    def run_verified(self, chunk: Callable[..., list[Completion]], prompts: Sequence[Sequence[int]], n: int,
                     *args: Any) -> list[Completion]:
        """``run`` for a speculative ``chunk(prompts, n, *args, kept)``: its forwards after the
        prefill are verify blocks ``[rows, k + 1]``, and for each it appends to the list ``kept``
        every row's count of leading block positions whose tokens stay fed (0 for a finished row)."""
        kept: list[torch.Tensor] = []
        with self.recorder.recording():
            comps = chunk(prompts, n, *args, kept)
        forwards = self.recorder.take()
        if forwards:
            if len(forwards) != len(kept) + 1:
                raise RuntimeError(f"routing log: {len(forwards) - 1} verify forwards recorded, "
                                   f"{len(kept)} steps reported")
            # one device-to-host read of every step's counts
            self._attach(comps, prompts, n, forwards, torch.stack(kept).tolist() if kept else [])
        return comps

    def _attach(self, comps: list[Completion], prompts: Sequence[Sequence[int]], n: int,
                forwards: list[torch.Tensor], kept: list[list[int]]) -> None:
        """Each completion's record: its prompt's rows of the prefill ``forwards[0]`` (the prompts
        left-padded to one width), then the first ``kept[s][row]`` positions of step ``s``'s forward."""
        width = max(len(p) for p in prompts)
        prefill = forwards[0].view(len(prompts), width, *forwards[0].shape[1:])
        steps = [f.view(len(comps), -1, *f.shape[1:]) for f in forwards[1:]]
        key = self.recorder.extension
        for r, comp in enumerate(comps):
            p = len(prompts[r // n])
            rows = [prefill[r // n, width - p:]] + [f[r, :c[r]] for f, c in zip(steps, kept)]
            record = torch.cat(rows).contiguous()
            if record.shape[0] != p + max(len(comp.token_ids) - 1, 0):
                raise RuntimeError(f"routing log: {record.shape[0]} routed rows for a prompt of {p} and "
                                   f"{len(comp.token_ids)} generated tokens")
            comp.extras[key] = {"routed_experts": record}


# -- miles serve: SGLang's return_routed_experts ---------------------------------------------------

def encode_routed(experts: torch.Tensor) -> dict:
    """``meta_info`` fields of one output's routed experts: ``routed_experts``, the base64 of the
    int32 ``[prompt + response - 1, layers, top_k]`` array's little-endian bytes in row-major
    order (SGLang's encoding), and ``routed_experts_shape``, its shape (an extension: SGLang's
    clients reshape by their model config)."""
    import base64

    arr = experts.to(torch.int32).contiguous().numpy().astype("<i4", copy=False)
    return {"routed_experts": base64.b64encode(arr.tobytes()).decode("ascii"),
            "routed_experts_shape": list(arr.shape)}


def routed_of(comp: Completion) -> torch.Tensor | None:
    """The routed experts an engine attached to ``comp`` (``RoutingLog.run``), or None."""
    for value in comp.extras.values():
        if isinstance(value, dict) and isinstance(value.get("routed_experts"), torch.Tensor):
            return value["routed_experts"]
    return None


class RoutedFolder:
    """A served model folder whose mixture-of-experts routers record (the ``moe`` model spec over
    the folder); tokenizer and architecture as the plain folder spec's (so the engine learns the
    family's attention, padding rules and MTP layers, which ``draft: mtp`` drafts with)."""

    def __init__(self, folder: Any, routed: Any):
        self.folder, self.routed = folder, routed

    def architecture(self) -> Any:
        return self.folder.architecture()

    def build_tokenizer(self, default: Any = None) -> Any:
        return self.folder.build_tokenizer(default)

    def build_model(self, tokenizer: Any) -> torch.nn.Module:
        return self.routed.build_model(tokenizer)

    def routing_recorder(self, model: torch.nn.Module) -> Any:
        return self.routed.routing_recorder(model)


def with_routing(folder: Any, model_dir: str) -> Any:
    """``folder`` (a folder spec), or for a mixture-of-experts model (``num_experts_per_tok`` in its
    config.json) when a ``moe`` model spec is installed, the folder with recording routers, so that
    ``/generate`` can answer ``return_routed_experts``."""
    import json
    from pathlib import Path

    config = json.loads((Path(model_dir) / "config.json").read_text())
    if "num_experts_per_tok" not in config:
        return folder
    from miles import make_plugin_manager

    pm = make_plugin_manager()
    comp = pm.registry("model_specs").get("moe")
    if comp is None or comp.config is None:
        return folder
    settings = comp.config.model_validate({"base": {"name": "hf", "path": model_dir}, "routing_replay": True})
    spec = pm.create("model_specs", "moe", settings, pm=pm)
    return RoutedFolder(folder, spec) if isinstance(spec, RecordsRouting) else folder
