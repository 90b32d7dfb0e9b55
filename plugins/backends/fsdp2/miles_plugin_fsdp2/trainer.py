"""A single-rank trainer over a Hugging Face causal LM: AdamW, clipping, micro-batches, LR schedule.

Log-probs are computed only over the response region (``logits_to_keep``), so the LM head never
materialises logits for the prompt.
"""
from __future__ import annotations

import copy
import inspect
import math
import os
from typing import Any, Callable, Iterable, Iterator

import torch

from miles import Batch

from .config import FSDP2Config


def response_logprobs(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """``[B, R]`` log-probs of the response tokens, logits divided by the rollout temperature.

    A rollout batch holds each prompt n times in a row; then the prompt is run once and its KV
    cache shared by its n samples (gradients flow back through the shared cache), which cuts
    the tokens processed by up to half for short responses. Otherwise one plain forward.
    """
    n = _group_size(batch)
    logits = _shared_prompt_logits(model, batch, n) if n > 1 else _full_logits(model, batch)
    if batch.temperature != 1.0:
        logits = logits / batch.temperature
    targets = batch.input_ids[:, batch.prompt_len:]
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def _full_logits(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    R = batch.input_ids.shape[1] - batch.prompt_len
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                position_ids=batch.position_ids, logits_to_keep=R + 1, use_cache=False)
    return out.logits[:, :-1].float()


def _shared_prompt_logits(model: torch.nn.Module, batch: Batch, n: int) -> torch.Tensor:
    P, L = batch.prompt_len, batch.input_ids.shape[1]
    kw = _cache_kwarg(model)
    out = model(input_ids=batch.input_ids[::n, :P], attention_mask=batch.attention_mask[::n, :P],
                position_ids=batch.position_ids[::n, :P], use_cache=True, logits_to_keep=1)
    first = out.logits[:, -1:].float().repeat_interleave(n, dim=0)  # predicts response token 0
    if L - P == 1:
        return first
    cache = getattr(out, kw)
    cache.batch_repeat_interleave(n)
    rest = model(input_ids=batch.input_ids[:, P:L - 1], attention_mask=batch.attention_mask[:, :L - 1],
                 position_ids=batch.position_ids[:, P:L - 1], use_cache=True, **{kw: cache})
    return torch.cat([first, rest.logits.float()], dim=1)


def _group_size(batch: Batch) -> int:
    """n when rows come in runs of n (> 1) identical prompts, else 1."""
    s = batch.samples
    n = 1
    while n < len(s) and s[n].prompt_ids == s[0].prompt_ids:
        n += 1
    if n == 1 or len(s) % n:
        return 1
    same = all(s[i].prompt_ids == s[i - i % n].prompt_ids for i in range(len(s)))
    return n if same else 1


def _cache_kwarg(model: torch.nn.Module) -> str:
    # transformers 5.24 renamed past_key_values -> cache; 5.17 (the GPU box) has only the old name
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _lr_lambda(cfg: FSDP2Config, total: int) -> Callable[[int], float]:
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant" or total <= cfg.warmup_steps:
            return 1.0
        frac = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
        decay = 0.5 * (1 + math.cos(math.pi * frac)) if cfg.schedule == "cosine" else 1 - frac
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay
    return f


class FSDP2Trainer:
    def __init__(self, cfg: FSDP2Config, *, spec: Any, tokenizer: Any, seed: int = 0,
                 total_steps: int = 0, **_):
        self.cfg = cfg
        dev = cfg.device
        self.device = torch.device("cuda" if dev == "auto" and torch.cuda.is_available() else
                                   ("cpu" if dev == "auto" else dev))
        torch.manual_seed(seed)
        self.model = spec.build_model(tokenizer).to(self.device).train()
        self.ref: torch.nn.Module | None = None
        # fused AdamW is one kernel per step instead of several per parameter (CPU and CUDA)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                       weight_decay=cfg.weight_decay, fused=True)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.optim, _lr_lambda(cfg, total_steps))

    def _to(self, batch: Batch) -> Batch:
        if self.device.type == "cpu":
            return batch
        return _move(batch, self.device)

    @torch.no_grad()
    def logprobs(self, batch: Batch, which: str = "policy") -> torch.Tensor:
        model = self.ref if which == "ref" else self.model
        if model is None:
            raise RuntimeError("reference log-probs requested before snapshot_reference()")
        size = self.cfg.micro_batch_size or len(batch)
        return torch.cat([response_logprobs(model, self._to(mb)).cpu() for mb in batch.split(size)])

    def train_step(self, batch: Batch, loss_fn) -> dict[str, float]:
        size = self.cfg.micro_batch_size or len(batch)
        micro = batch.split(size) if size < len(batch) else [batch]
        totals: dict[str, float] = {}
        loss_sum = 0.0
        for mb in micro:
            mb = self._to(mb)
            loss, metrics = loss_fn(mb, response_logprobs(self.model, mb))
            loss.backward()
            loss_sum += float(loss.detach())
            w = len(mb) / len(batch)
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + float(v) * w
        if self.cfg.grad_clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        else:
            norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in self.model.parameters() if p.grad is not None))
        totals.update(loss=loss_sum, grad_norm=float(norm), lr=self.sched.get_last_lr()[0])
        self.optim.step()
        self.sched.step()
        self.optim.zero_grad(set_to_none=True)
        return totals

    def snapshot_reference(self) -> None:
        self.ref = copy.deepcopy(self.model).eval().requires_grad_(False)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self.model.state_dict().items():
            yield name, t.detach()

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.model.load_state_dict(dict(named_tensors), strict=True)

    def save(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        state = {"model": self.model.state_dict(), "optim": self.optim.state_dict(),
                 "sched": self.sched.state_dict(), "ref": self.ref.state_dict() if self.ref else None,
                 "rng": torch.get_rng_state()}
        torch.save(state, os.path.join(path, "trainer.pt"))

    def load(self, path: str) -> None:
        state = torch.load(os.path.join(path, "trainer.pt"), map_location=self.device, weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optim.load_state_dict(state["optim"])
        self.sched.load_state_dict(state["sched"])
        if state["ref"] is not None:
            self.snapshot_reference()
            self.ref.load_state_dict(state["ref"])
        torch.set_rng_state(state["rng"])


def _move(batch: Batch, device: torch.device) -> Batch:
    from dataclasses import fields, replace

    moved = {f.name: getattr(batch, f.name).to(device) for f in fields(batch)
             if isinstance(getattr(batch, f.name), torch.Tensor)}
    return replace(batch, **moved)
