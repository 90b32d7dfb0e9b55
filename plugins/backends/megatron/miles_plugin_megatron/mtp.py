"""A model's multi-token-prediction (MTP) layers trained online beside a megatron policy (a
``draft:`` section on a model whose architecture plugin attaches them, ``miles_mtp``).

megatron-core's own MTP block is not used: it shares the policy's embedding and output layer and
adds its loss to the policy's backward, while DeepSeek-V3's and GLM-4.5's checkpoints give each MTP
layer an embedding and head of its own and the ``draft:`` section trains the layers with their own
optimizer, lr, loss weight and clip. So the first MTP layer stays the transformers module the
architecture plugin attached (``miles_mtp.train.MTPTraining``, the fsdp2 trainer's too), in fp32
like the policy's master weights and replicated on every rank, experts included (its weights and
AdamW moments, 16 bytes a parameter, are held whole on each rank: sharding them is not done).

After each policy update a no-grad forward of the updated policy gives the final (normed) hidden
states, caught as the input of the output layer, on the right-aligned rows megatron runs; the layer
learns ``miles_mtp.mtp_loss`` on them, micro-batch by micro-batch, each part divided by the whole
batch's weight so that the parts add up to the fsdp2 trainer's loss. With tensor parallelism every
rank of a TP group sees the same hidden states and takes the same step; data-parallel ranks train
on their own rows and sum the layer's gradients. Qwen3-Next's ``mtp`` block reads the policy's
embedding and LM head, handed in whole (gathered over the TP ranks) before each step. With
pipeline stages only the last stage sees the hidden states: refused.

The layer's weights travel under the checkpoint's own names (``model.layers.<n>.*``, ``mtp.*``) in
``named_weights()`` and ``load_weights``, and so into ``miles export``; megatron checkpoints hold
them and their AdamW moments as replicated tensors (``mtp.``, ``checkpoint.py``). Further MTP
layers (none of the supported checkpoints has one) are carried unchanged.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from miles import MilesError
from miles_mtp import MTPBlock, mtp_layers, mtp_loss
from miles_mtp.train import MTPTraining, response_weights

from . import parallel as par

PART = "mtp."  # the layer's prefix in megatron checkpoints


def training(settings: dict | None, trainer: Any, hf: torch.nn.Module, algorithm: Any) -> "MegatronMTP | None":
    """The MTP layers' training for a ``draft:`` section on a Hugging Face model ``hf`` that carries
    them (None without a section or layers)."""
    if settings is None or not mtp_layers(hf):
        return None
    from miles_draft.config import DraftConfig

    cfg = DraftConfig.model_validate(settings)
    if cfg.vocab is not None:  # EAGLE-3's reduced vocabulary is the head's: MTP layers keep their own LM head
        raise MilesError(f"draft.vocab: {cfg.vocab} applies to a draft head; this model's MTP layers score the "
                         f"whole vocabulary (remove draft.vocab)")
    if cfg.updates_per_step > 1:
        raise MilesError(f"draft.updates_per_step: {cfg.updates_per_step} applies to a draft head; this "
                         f"model's MTP layers train one update per step (use draft.updates_per_step: 1)")
    if trainer.pp > 1:
        raise MilesError(f"draft.train: the megatron trainer trains a model's MTP layers without pipeline "
                         f"stages (trainer.pipeline_parallel is {trainer.pp}): only the last stage sees the "
                         f"final hidden states; use trainer.pipeline_parallel: 1 or remove the draft: section")
    supervised = algorithm is not None and not algorithm.uses_rollout
    return MegatronMTP(cfg, hf, trainer.device, supervised)


class MegatronMTP(MTPTraining):
    """The first MTP layer of ``hf`` (moved to ``device`` in fp32), its optimizer and its names."""

    def __init__(self, cfg: Any, hf: torch.nn.Module, device: torch.device, supervised: bool):
        layer = mtp_layers(hf)[0]
        local = {id(t): k for k, t in layer.state_dict(keep_vars=True).items()}
        # the layer's state-dict names -> the checkpoint's (taken before .to() replaces buffers)
        self.names = {local[id(t)]: name for name, t in hf.state_dict(keep_vars=True).items() if id(t) in local}
        if isinstance(layer, MTPBlock):  # the policy's embedding and head come in before each step
            layer.share(torch.empty(0), torch.empty(0))
        layer.to(device=device, dtype=torch.float32)
        self.rotary = hf.model.rotary_emb.to(device)
        super().__init__(cfg, hf, supervised=supervised)

    def checkpoint_part(self) -> tuple[str, torch.nn.Module, torch.optim.Optimizer]:
        return PART, self.layer, self.optim

    def step(self, trainer: Any, batch: Any) -> dict[str, float]:
        """One optimizer step of the layer on ``batch``, on every rank (collective); metrics
        ``mtp_loss`` (the weighted cross-entropy before the step) and ``mtp_top1``."""
        if not self.active or batch.input_ids.shape[1] < 3:
            return {}
        from .draft import final_states, vocab_weights
        from .rows import aligned_rows

        if isinstance(self.layer, MTPBlock):
            self.layer.share(*vocab_weights(trainer))
        denom = response_weights(batch)[:, 2:].sum().clamp(min=1).to(trainer.device)  # the whole batch's
        sums: dict[str, torch.Tensor] = {}
        self.optim.zero_grad(set_to_none=True)
        with final_states(trainer) as forward:
            for run, real in trainer._micro(batch)[0]:  # every micro-batch runs: MoE collectives line up
                _, hidden = forward(run)
                if real is None:  # a rank out of rows ran only for the collectives
                    continue
                ids, valid, weights = (aligned_rows(real, t) for t in (real.input_ids, real.attention_mask,
                                                                        response_weights(real)))
                pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)  # rows start at 0
                with trainer._autocast(self.layer):
                    loss, top1 = mtp_loss(self.layer, hidden[:len(real)], ids, valid, pos, self.rotary,
                                          weights[:, 2:], denom)
                self.backward(loss)
                for k, v in (("mtp_loss", loss), ("mtp_top1", top1)):
                    sums[k] = sums.get(k, 0) + v.detach()
        self.update(lambda params: par.all_reduce_grads(params, trainer.ps.get_data_parallel_group()))
        out = {k: float(sums.get(k, 0.0)) for k in ("mtp_loss", "mtp_top1")}
        return trainer._sum_dp(out) if trainer.dp > 1 else out  # each DP rank's share: their sum is the whole

    def named(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The layer's weights in the checkpoint's own names."""
        for k, t in self.layer.state_dict().items():
            yield self.names[k], t.detach()

    def take(self, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Load the layer's weights (all of them) out of ``named`` (checkpoint names); the rest."""
        rest = dict(named)
        mine = {k: rest.pop(n) for k, n in self.names.items() if n in rest}
        missing = [n for k, n in self.names.items() if k not in mine]
        if missing:
            raise MilesError(f"load_weights: missing weights {missing[:5]} (the model's MTP layer, which "
                             f"this trainer trains)")
        with torch.no_grad():
            self.layer.load_state_dict(mine, strict=True)
        return rest

