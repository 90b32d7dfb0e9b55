"""Multi-token-prediction (MTP) layers kept beside a Hugging Face causal LM.

Two checkpoint layouts, which transformers ignores when loading:

- DeepSeek-V3 and GLM-4.5 store ``num_nextn_predict_layers`` extra layers after the decoder's, as
  ``model.layers.<num_hidden_layers + k>.*``: a decoder layer of the family plus its own embedding
  (``embed_tokens``), RMSNorms of the embedding and the hidden state (``enorm``, ``hnorm``), their
  projection (``eh_proj``) and an output head (``shared_head.norm``, ``shared_head.head``).
  ``attach_nextn`` appends them to the model's layer list (``nextn_layer``).
- Qwen3-Next and Qwen3.5 store ``mtp_num_hidden_layers`` full-attention decoder layers in one
  ``mtp`` module: ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.fc``,
  ``mtp.layers.<k>.*`` and ``mtp.norm``, sharing the model's embedding and LM head.
  ``attach_block`` sets it as the model's ``mtp`` (``MTPBlock``).

Either way their parameters carry the checkpoint's own names through every ``state_dict``: trainer
checkpoints, weight sync to engines and export keep them (no forward of the model reaches them:
``mtp_loss`` trains them, in the fsdp2 trainer with a top-level ``draft: {train: true}`` section).
``load_missing`` reads them from the checkpoint folder's safetensors. A layer's ``predict``
(``Predicts``, both layouts) is the draft step speculative decoding builds on: from the main
model's last hidden states ``h_i`` and the tokens ``t_{i+1}`` it returns the next hidden states and
the logits of tokens ``t_{i+2}``; ``step`` does the same over a KV cache of the entries before (the
torch engine's ``mtp`` draft).
"""
from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import torch


class Predicts:
    """``predict``/``step`` of an MTP layer over the parts its family names (``parts``) and its
    decoder layer (``decode``): token ``i + 1``'s embedding and hidden state ``i``, each normalised,
    projected to one hidden state, through a decoder layer of the family, normalised and projected
    to logits."""

    def parts(self) -> tuple[Any, ...]:
        """``(embed, embed_norm, hidden_norm, proj, out_norm, head)``: callables on tensors."""
        raise NotImplementedError

    def decode(self, x: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, rotary: torch.nn.Module,
               cache: Any) -> torch.Tensor:
        raise NotImplementedError

    def predict(self, hidden: torch.Tensor, next_ids: torch.Tensor, rotary: torch.nn.Module,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden`` ``[B, S, H]`` (the main model's last hidden states) and
        ``next_ids`` ``[B, S]`` (token ``i + 1`` at position ``i``) -> this layer's hidden
        states and the logits ``[B, S, V]`` of token ``i + 2``; causal over positions 0..S-1
        (``rotary``: the model's rotary embedding)."""
        b, s = next_ids.shape
        positions = torch.arange(s, device=hidden.device)[None].expand(b, -1)
        return self(hidden, next_ids, rotary, positions, attention_mask(hidden.new_ones((1, s)), s, hidden.dtype))

    def step(self, hidden: torch.Tensor, next_ids: torch.Tensor, rotary: torch.nn.Module,
             positions: torch.Tensor, mask: torch.Tensor, cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``predict`` over a transformers KV ``cache`` of earlier entries (None: none), so a
        draft chains one entry at a time: ``positions`` ``[B, S]`` of the entries, ``mask`` the
        additive attention mask ``[B or 1, 1, S, cached + S]`` over the cache's slots and theirs
        (``attention_mask``)."""
        return self(hidden, next_ids, rotary, positions, mask, cache)

    def forward(self, hidden: torch.Tensor, next_ids: torch.Tensor, rotary: torch.nn.Module,
                positions: torch.Tensor, mask: torch.Tensor, cache: Any = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # the whole step in forward: a sharded trainer's hooks gather all of the layer's weights
        # (the model's own forward never calls its MTP layers)
        embed, enorm, hnorm, proj, norm, head = self.parts()
        x = proj(torch.cat([enorm(embed(next_ids)), hnorm(hidden)], -1))
        out = self.decode(x, mask.to(x.dtype), positions, rotary, cache)
        return out, head(norm(out))


def _decoder_kwargs(decoder_cls: type) -> Any:
    """``kwargs(x, mask, positions, rotary, cache)``: the keyword arguments of one forward of a
    ``decoder_cls`` layer on ``x``."""
    # transformers 5.24 renamed the layers' past_key_values argument to cache
    cache_kw = "cache" if "cache" in inspect.signature(decoder_cls.forward).parameters else "past_key_values"

    def kwargs(x: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, rotary: torch.nn.Module,
               cache: Any) -> dict[str, Any]:
        return {"attention_mask": mask, "position_ids": positions, "position_embeddings": rotary(x, positions),
                "use_cache": cache is not None, cache_kw: cache}

    return kwargs


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def nextn_layer(decoder_cls: type, norm_cls: type) -> type:
    """The MTP layer class of DeepSeek's layout: its ``decoder_cls(config, layer_idx)`` with the
    nextn modules added (``norm_cls(size, eps=)`` their RMSNorm), an embedding and head of its own."""
    kwargs = _decoder_kwargs(decoder_cls)

    class NextNLayer(Predicts, decoder_cls):
        def __init__(self, config: Any, layer_idx: int):
            super().__init__(config, layer_idx)
            h, v = config.hidden_size, config.vocab_size
            self.embed_tokens = torch.nn.Embedding(v, h)
            self.enorm = norm_cls(h, eps=config.rms_norm_eps)
            self.hnorm = norm_cls(h, eps=config.rms_norm_eps)
            self.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
            self.shared_head = torch.nn.Module()
            self.shared_head.norm = norm_cls(h, eps=config.rms_norm_eps)
            self.shared_head.head = torch.nn.Linear(h, v, bias=False)

        def parts(self) -> tuple[Any, ...]:
            return (self.embed_tokens, self.enorm, self.hnorm, self.eh_proj, self.shared_head.norm,
                    self.shared_head.head)

        def decode(self, x, mask, positions, rotary, cache):
            return _first(decoder_cls.forward(self, x, **kwargs(x, mask, positions, rotary, cache)))

    return NextNLayer


class MTPBlock(Predicts, torch.nn.Module):
    """Qwen3-Next's and Qwen3.5's layout, the model's ``mtp`` module: ``fc`` projects the normalised
    embedding (``pre_fc_norm_embedding``) and hidden state (``pre_fc_norm_hidden``), ``layers`` holds
    full-attention decoder layers of the family, ``norm`` precedes the model's own LM head; the
    embedding is the model's too. It drafts and learns with ``layers[0]`` (the checkpoints carry one).
    The shared embedding and head stay frozen here: MTP training never moves the policy's weights."""

    def __init__(self, config: Any, decoder_cls: type, norm_cls: type, layer_config: Any, count: int,
                 model: torch.nn.Module):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = norm_cls(h, eps=eps)
        self.pre_fc_norm_hidden = norm_cls(h, eps=eps)
        self.layers = torch.nn.ModuleList(decoder_cls(layer_config, config.num_hidden_layers + k)
                                          for k in range(count))
        self.norm = norm_cls(h, eps=eps)
        self._kwargs = _decoder_kwargs(decoder_cls)
        # the model's embedding and head, unregistered: their names stay the model's own
        self._shared = (model.get_input_embeddings(), model.get_output_embeddings())

    def share(self, embedding: torch.Tensor, head: torch.Tensor) -> None:
        """Use ``embedding`` and ``head`` ``[V, H]`` as the model's shared weights: a trainer whose
        policy holds them outside a transformers model (megatron's) hands in their current values."""
        self._shared = (_Held(embedding), _Held(head))

    def parts(self) -> tuple[Any, ...]:
        embed, head = self._shared
        return (lambda ids: torch.nn.functional.embedding(ids, _frozen(embed.weight)), self.pre_fc_norm_embedding,
                self.pre_fc_norm_hidden, self.fc, self.norm,
                lambda x: torch.nn.functional.linear(x, _frozen(head.weight).to(x.dtype)))

    def decode(self, x, mask, positions, rotary, cache):
        # through the layer's __call__: a sharded trainer's hooks gather its weights
        return _first(self.layers[0](x, **self._kwargs(x, mask, positions, rotary, cache)))


class _Held:
    """A shared weight held as a module holds it (``.weight``), unregistered."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight


def _frozen(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` without its gradient, whole: a sharded trainer keeps the model's root weights
    sharded outside its forward (every rank runs the MTP step, so the gather is collective)."""
    from torch.distributed.tensor import DTensor

    weight = weight.detach()
    return weight.full_tensor() if isinstance(weight, DTensor) else weight


def attention_mask(valid: torch.Tensor, new: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive attention mask ``[B, 1, new, slots]`` of the last ``new`` of ``valid [B, slots]``
    key slots as queries: a query sees the valid slots up to its own (a query with none sees all
    equally, finite: padding)."""
    slots = valid.shape[1]
    at = torch.arange(slots, device=valid.device)
    allowed = valid.bool()[:, None, :] & (at[None, :] <= at[slots - new:, None])[None]
    zero = torch.zeros(allowed.shape, dtype=dtype, device=valid.device)
    return zero.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def mtp_loss(layer: torch.nn.Module, hidden: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor,
             positions: torch.Tensor, rotary: torch.nn.Module, weights: torch.Tensor,
             denom: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of ``layer``'s logits for token ``i + 2`` from the main model's final hidden
    state ``i`` and token ``i + 1`` over sequences ``ids [B, L]`` (``valid``: their attention mask,
    ``positions``: their position ids), weighted by ``weights [B, L - 2]`` per predicted token
    ``2 .. L - 1`` (e.g. response tokens only); and the weighted share of those whose argmax is right.
    ``denom``: the weights' sum over a whole batch these rows are a part of (default: theirs), so
    that the parts' losses add up to the batch's."""
    mask = attention_mask(valid[:, :-1], valid.shape[1] - 1, hidden.dtype)
    _, logits = layer(hidden[:, :-1], ids[:, 1:], rotary, positions[:, :-1], mask)
    logits, labels = logits[:, :-1].float(), ids[:, 2:]
    w = weights.to(logits.dtype)
    denom = w.sum().clamp(min=1) if denom is None else denom
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    top1 = ((logits.argmax(-1) == labels).to(w.dtype) * w).sum() / denom
    return (ce * w).sum() / denom, top1.detach()


def _placed(model: torch.nn.Module, module: torch.nn.Module) -> torch.nn.Module:
    """``module`` initialised as ``model``'s own modules are, in its dtype and on its device."""
    param = next(model.parameters())
    with torch.no_grad():  # transformers allocates some weights empty and fills them in post_init
        for m in module.modules():
            model._init_weights(m)
    return module.to(dtype=param.dtype, device=param.device)


def attach_nextn(model: torch.nn.Module, layer_cls: type, folder: str | None = None) -> list[torch.nn.Module]:
    """Append the config's ``num_nextn_predict_layers`` MTP layers to ``model.model.layers`` (in
    the model's dtype and device) and return them; their weights are read from the Hugging Face
    ``folder`` the model was loaded from (None, or names it lacks: as ``layer_cls`` initialises them)."""
    config = model.config
    layers = []
    for k in range(getattr(config, "num_nextn_predict_layers", 0) or 0):
        layer = _placed(model, layer_cls(config, config.num_hidden_layers + k))
        model.model.layers.append(layer)
        layers.append(layer)
    if layers and folder is not None:
        load_missing(model, folder, names_of(model, layers))
    return layers


def attach_block(model: torch.nn.Module, decoder_cls: type, norm_cls: type, folder: str | None = None,
                 ) -> list[torch.nn.Module]:
    """Qwen3-Next's layout: the config's ``mtp_num_hidden_layers`` full-attention layers of
    ``decoder_cls`` in an ``MTPBlock`` set as ``model.mtp`` (names ``mtp.*``, as the checkpoints
    store them), with its weights from ``folder`` as ``attach_nextn``'s; ``[block]``, or ``[]``
    where the config has none."""
    import copy

    config = model.config
    count = getattr(config, "mtp_num_hidden_layers", 0) or 0
    if not count:
        return []
    # the layers sit past the decoder's: full attention, always a mixture of experts
    layer_config = copy.copy(config)
    layer_config.layer_types = list(config.layer_types) + ["full_attention"] * count
    layer_config.mlp_only_layers = []
    layer_config.decoder_sparse_step = 1
    block = _placed(model, MTPBlock(config, decoder_cls, norm_cls, layer_config, count, model))
    model.mtp = block
    if folder is not None:
        load_missing(model, folder, names_of(model, [block]))
    return [block]


def mtp_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The MTP layers attached to ``model`` (its ``MTPBlock``, or those past its decoder's), in
    order; none where ``model`` has neither."""
    block = model._modules.get("mtp") if isinstance(model, torch.nn.Module) else None
    if isinstance(block, MTPBlock):
        return [block]
    layers = getattr(getattr(model, "model", model), "layers", None)
    config = getattr(model, "config", None)
    if not isinstance(layers, torch.nn.ModuleList) or config is None:
        return []
    return list(layers)[config.num_hidden_layers:]


def outside_mtp(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``model``'s modules but those of its MTP layers (which no forward of the model runs: the
    routers routing replay drives, for example)."""
    skip = {id(m) for layer in mtp_layers(model) for m in layer.modules()}
    return [m for m in model.modules() if id(m) not in skip]


def names_of(model: torch.nn.Module, layers: list[torch.nn.Module]) -> list[str]:
    """The state-dict names of ``layers``' tensors in ``model``."""
    mine = {id(t) for layer in layers for t in layer.state_dict(keep_vars=True).values()}
    return [k for k, t in model.state_dict(keep_vars=True).items() if id(t) in mine]


def load_missing(model: torch.nn.Module, folder: str, names: list[str]) -> list[str]:
    """Read the tensors ``names`` of ``model``'s state dict from the safetensors of a Hugging Face
    ``folder`` (one file or an index), copy them in, and return the names found. Experts stored one
    by one (``experts.<e>.gate_proj/up_proj/down_proj.weight``, as checkpoints and transformers'
    own ``save_pretrained`` write them) fill the fused ``experts.gate_up_proj`` / ``down_proj``. A
    name the folder lacks stays as initialised (a checkpoint saved without MTP layers)."""
    from safetensors import safe_open

    wanted, root = set(names), Path(folder)
    layers = {n.split(".mlp.", 1)[0] + "." for n in names if ".mlp.experts." in n}
    def ours(key: str) -> bool:
        return key in wanted or any(key.startswith(p) for p in layers)

    index = root / "model.safetensors.index.json"
    if index.exists():
        files = {root / f for k, f in json.loads(index.read_text())["weight_map"].items() if ours(k)}
    else:
        files = {root / "model.safetensors"} if (root / "model.safetensors").exists() else set()
    stored: dict[str, torch.Tensor] = {}
    for file in sorted(files):
        with safe_open(str(file), framework="pt") as f:
            stored.update({k: f.get_tensor(k) for k in f.keys() if ours(k)})
    found = {k: stored[k] for k in wanted if k in stored}
    for name in wanted - set(found):
        stem, _, kind = name.rpartition("experts.")
        one = f"{stem}experts.{{}}.{{}}.weight"
        count = sum(1 for k in stored if k.startswith(stem + "experts.") and k.endswith(".down_proj.weight"))
        if not count or kind not in ("gate_up_proj", "down_proj"):
            continue
        if kind == "gate_up_proj":
            found[name] = torch.stack([torch.cat([stored[one.format(e, "gate_proj")], stored[one.format(e, "up_proj")]])
                                       for e in range(count)])
        else:
            found[name] = torch.stack([stored[one.format(e, "down_proj")] for e in range(count)])
    if found:
        model.load_state_dict(found, strict=False)
    return sorted(found)
