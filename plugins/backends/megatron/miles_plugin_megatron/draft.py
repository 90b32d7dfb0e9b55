"""The speculative-decoding draft head (``miles_draft``) trained online beside a megatron policy.

After each policy update the head takes ``draft.updates_per_step`` steps of its own (``miles_draft.train.HeadTraining``:
its own AdamW, lr, loss weight and clip) on the step's rows: a no-grad forward of the updated
policy gives the final (normed) hidden states of whole rows (the head attends the prompt too),
caught as the input of the output layer, and the logits, gathered over the tensor-parallel
vocabulary shards. With tensor parallelism (sequence
parallelism off) every rank of a TP group holds the same hidden states and the same gathered
logits, so each rank trains its own replica of the head on the same data and takes the same step:
no broadcast of the head is needed. Data-parallel ranks train on their own rows and sum the
head's gradients, so the replicas stay equal there too. With pipeline stages only the last stage
sees the hidden states and the first holds the embedding; ``draft.train`` is refused there.

The head is not a module of the GPTModel: its weights travel beside the policy's under
``draft_head.`` (weight sync, ``load_weights``), are a part of megatron checkpoints
(``checkpoint.py``) and are exported as ``draft_head.safetensors``.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from miles import MilesError
from miles_draft import PREFIX
from miles_draft.train import HeadTraining, denominators

from . import parallel as par


def training(settings: dict | None, trainer: Any, hf_config: Any, algorithm: Any) -> "MegatronDraft | None":
    """The head's training for a ``draft:`` section (None without one)."""
    if settings is None:
        return None
    from miles_draft.config import DraftConfig
    from miles_draft.head import make_head

    if trainer.pp > 1:
        raise MilesError(f"draft.train: the megatron trainer trains the draft head without pipeline stages "
                         f"(trainer.pipeline_parallel is {trainer.pp}): only the last stage sees the final "
                         f"hidden states; use trainer.pipeline_parallel: 1 or remove the draft: section")
    supervised = algorithm is not None and not algorithm.uses_rollout
    cfg = DraftConfig.model_validate(settings)
    head = make_head(hf_config, trainer.device, torch.float32, cfg.vocab)  # fp32 like the policy's master weights
    return MegatronDraft(cfg, head, supervised)


@contextlib.contextmanager
def final_states(trainer: Any) -> Iterator[Callable[[Any], tuple[torch.Tensor, torch.Tensor]]]:
    """The policy in eval mode with its output layer's input caught: yields ``forward(run)``, a
    no-grad forward of a micro-batch giving its logits ``[B, S, V / tp]`` and final (normed) hidden
    states ``[B, S, H]`` in fp32, for a draft (head or MTP layer) to learn from."""
    model = trainer.policy_module()
    caught: list[torch.Tensor] = []
    # first among the output layer's pre-hooks: the GPTModel's sequence-major input, before
    # arch.batch_major_logits transposes it
    hook = model.output_layer.register_forward_pre_hook(lambda _m, args: caught.append(args[0]), prepend=True)

    def forward(run: Any) -> tuple[torch.Tensor, torch.Tensor]:
        caught.clear()
        with torch.no_grad():
            logits = trainer._forward(model, run)
            return logits, caught[0].transpose(0, 1).float()  # [S, B, H] -> [B, S, H]

    model.eval()
    try:
        yield forward
    finally:
        hook.remove()
        model.train()


class MegatronDraft(HeadTraining):
    def checkpoint_part(self) -> tuple[str, torch.nn.Module, torch.optim.Optimizer]:
        return "draft.", self.head, self.optim

    def step(self, trainer: Any, batch: Any) -> dict[str, float]:
        """``passes`` optimizer steps of the head on ``batch``, on every rank (collective); the
        metrics are the first pass's."""
        R = batch.input_ids.shape[1] - batch.prompt_len
        if not self.active or R < 2:
            return {}
        self.observe(batch.input_ids, batch.prompt_len, batch.loss_mask)  # the whole batch: every rank alike
        embedding, lm_head = vocab_weights(trainer)
        denoms = denominators(batch.loss_mask.to(trainer.device), self.cfg.unroll)
        sums: dict[str, torch.Tensor] = {}
        with final_states(trainer) as forward:
            # each pass runs the policy's forward again (same policy, same outputs): keeping every
            # micro-batch's vocabulary-wide targets for the next pass would not fit
            for p in range(self.passes):
                self._pass(trainer, batch, forward, embedding, lm_head, denoms, sums if p == 0 else {})
        out = {k: float(v) for k, v in sums.items()}
        if trainer.dp > 1:  # each DP rank's share of the batch's metrics: their sum is the whole
            keys = ("draft_loss", "draft_top1") + (("draft_vocab_cover",) if self.head.subset() is not None else ())
            out = trainer._sum_dp({k: out.get(k, 0.0) for k in keys})
        return out

    def _pass(self, trainer: Any, batch: Any, forward: Callable, embedding: torch.Tensor,
              lm_head: torch.Tensor, denoms: list[torch.Tensor], sums: dict[str, torch.Tensor]) -> None:
        """One optimizer step of the head over the micro-batches of ``batch`` (``forward``:
        ``final_states``'); ``sums`` gathers its metrics."""
        from .rows import right_aligned

        self.optim.zero_grad(set_to_none=True)
        for run, real in trainer._micro(batch)[0]:  # every micro-batch runs: MoE collectives line up
            logits, hidden = forward(run)  # the head attends all of the hidden states
            with torch.no_grad():
                shifted, index = right_aligned(run)  # rows from position 0; positions before response tokens
                after = index[:, 1:, None]  # the positions of response tokens 0 .. R-2: they predict 1 .. R-1
                logits = logits.gather(1, after.expand(-1, -1, logits.shape[-1]))
                full = torch.cat(par.all_gather(logits, trainer.ps.get_tensor_model_parallel_group()), -1)
                target = torch.log_softmax(full[..., :trainer.arch.vocab].float(), dim=-1)
            if real is None:  # a rank out of rows ran only for the collectives
                continue
            n = len(real)
            # causal attention from position 0 of each row: no padding before a chain start
            nxt = torch.nn.functional.pad(shifted[:n, 1:], (0, 1))
            loss, metrics = self.loss(hidden[:n], nxt, index[:n], target[:n], real.loss_mask, embedding,
                                      lm_head, denoms)
            loss.backward()
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0) + v.detach()
        self.update(lambda params: par.all_reduce_grads(params, trainer.ps.get_data_parallel_group()))

    def named(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The head's weights in the names the engine's head has (``draft_head.``)."""
        for name, t in self.head.state_dict().items():
            yield PREFIX + name, t.detach()

    def load_named(self, named: dict[str, torch.Tensor]) -> None:
        """Weights in ``draft_head.`` names (all of the head's)."""
        state = {k[len(PREFIX):]: v for k, v in named.items()}
        missing = sorted(set(self.head.state_dict()) - set(state))
        if missing:
            raise MilesError(f"load_weights: missing weights {[PREFIX + k for k in missing][:5]}")
        with torch.no_grad():
            self.head.load_state_dict(state, strict=True)


def vocab_weights(trainer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy's whole input embedding and LM head ``[V, H]`` (fp32 master weights, the padding
    rows of the vocabulary dropped), gathered over the tensor-parallel group; detached."""
    model, group = trainer.model, trainer.ps.get_tensor_model_parallel_group()

    def whole(w: torch.Tensor) -> torch.Tensor:
        return torch.cat(par.all_gather(w.detach(), group))[:trainer.arch.vocab]

    embedding = whole(model.embedding.word_embeddings.weight)
    if model.share_embeddings_and_output_weights:
        return embedding, embedding
    return embedding, whole(model.output_layer.weight)


class ExportsHead:
    """``miles.protocols.ExportsDraft`` for the megatron trainer (mixed into it): the policy's weights
    alone, and the head written as ``draft_head.safetensors``."""

    draft: Any
    rank: int

    def model_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        from miles_draft.files import without_head

        return without_head(self.named_weights())  # type: ignore[attr-defined]

    def export_draft(self, folder: str) -> None:
        """The draft head as ``draft_head.safetensors`` in ``folder`` (the engine's
        ``engine.speculative.path`` reads it), if this trainer trains one; every rank holds it,
        rank 0 writes it."""
        if not isinstance(self.draft, MegatronDraft) or self.rank != 0:  # none, or MTP layers: in the model
            return
        from miles_draft.files import save_head

        save_head(dict(self.draft.head.state_dict()), folder)


def split_named(named: Iterable[tuple[str, torch.Tensor]], draft: Any) -> dict[str, torch.Tensor]:
    """``named`` without the head's weights, which go into ``draft``'s head (or without the MTP
    layer's, into the layer ``draft`` trains: ``mtp.MegatronMTP``); a head's weight for a trainer
    without a draft is an error that says so."""
    from miles_draft.files import split

    from .mtp import MegatronMTP

    if isinstance(draft, MegatronMTP):
        return draft.take(dict(named))

    model, head = split(named)
    if head and draft is None:
        raise MilesError(f"load_weights: {PREFIX + next(iter(head))!r} is a draft head's weight, and this "
                         f"trainer trains none (no draft: section)")
    if draft is not None:
        draft.load_named({PREFIX + k: v for k, v in head.items()})
    return dict(model)
