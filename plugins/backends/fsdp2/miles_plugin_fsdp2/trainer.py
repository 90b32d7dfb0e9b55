"""The fsdp2 trainer over a Hugging Face causal LM: AdamW, clipping, micro-batches, LR schedule.
World size 1 is plain torch; more ranks shard every transformer block with FSDP2 (``dist.py``)
and checkpoint through torch.distributed.checkpoint (``checkpoint.py``).

Log-probs are computed only over the response region (``logits_to_keep``), so the LM head never
materialises logits for the prompt; Llama-family models run them through ``fast.py`` (the same
ops without the generic forward's copies). At world size 1 on CPU the cores split each batch
between worker threads of one intra-op thread each (``workers.py``).
"""
from __future__ import annotations

import copy
import functools
import inspect
import itertools
import time
from typing import Any, Iterable, Iterator

import torch
from miles_fastpath.schedule import Tally, lr_lambda, step_or_skip
from miles_telemetry.flops import for_device, seq_lens
from miles_fastpath import cpu_gemm
from miles_lowp.linear import convert as convert_lowp
from miles_lowp.linear import SendsPackedWeights
from miles_rlmath.logprobs import token_logprobs

from miles import Batch, MilesError
from miles.protocols import ScoresActions

from . import dist as dist_
from . import fast
from . import workers
from .config import FSDP2Config


def response_logprobs(model: torch.nn.Module, batch: Batch, shared: bool | None = None,
                      gemm: str = "mkl") -> torch.Tensor:
    """``[B, R]`` log-probs of the response tokens, logits divided by the rollout temperature.

    A rollout batch holds each prompt n times in a row; then the prompt is run once and its KV
    cache shared by its n samples (gradients flow back through the shared cache), which cuts
    the tokens processed by up to half for short responses. Otherwise one plain forward.
    ``shared``: force the choice (ranks of a sharded model must all make the same number of
    forward calls); None = shared when prompts repeat twice on average. ``gemm``: the fast path's
    GEMM library on CPU (``mkl`` or ``onednn``: ``trainer.cpu_gemm``).
    """
    runs = _runs(batch)
    if shared is None:
        shared = 2 * len(runs) <= len(batch)
    if batch.attention_mask.dim() != 2:  # a prepared 4-D mask (packed rows) has no prompt to share
        shared = False
    if fast.usable(model, batch):  # Llama-family decoders: the same ops, fewer copies around them
        logits = fast.response_logits(model, batch, runs if shared else [1] * len(batch), gemm)
    elif shared:
        logits = _shared_prompt_logits(model, batch, runs)
    else:
        logits = _full_logits(model, batch)
    # on CUDA one fused pass over the logits in their own dtype; on CPU the float32 formula
    return token_logprobs(logits, batch.input_ids[:, batch.prompt_len:], batch.temperature)


def split_logprobs(model: torch.nn.Module, batch: Batch, w: workers.Workers, gemm: str = "mkl") -> torch.Tensor:
    """``response_logprobs`` slice by slice on CPU workers, as ``train_step`` computes them at
    world size 1 on CPU (``workers.py``)."""
    return workers.logprobs(lambda b: response_logprobs(model, b, gemm=gemm), batch, _runs(batch), w)


def _full_logits(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    R = batch.input_ids.shape[1] - batch.prompt_len
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                position_ids=batch.position_ids, logits_to_keep=R + 1, use_cache=False)
    return out.logits[:, :-1]


def _shared_prompt_logits(model: torch.nn.Module, batch: Batch, runs: list[int]) -> torch.Tensor:
    P, L = batch.prompt_len, batch.input_ids.shape[1]
    kw = _cache_kwarg(model)
    n = runs[0]
    uniform = all(r == n for r in runs)
    dev = batch.input_ids.device
    # one row per run of identical prompts: every n-th row for whole groups, else each run's first
    rows = slice(None, None, n) if uniform else torch.tensor([0, *itertools.accumulate(runs)][:-1], device=dev)
    out = model(input_ids=batch.input_ids[rows, :P], attention_mask=batch.attention_mask[rows, :P],
                position_ids=batch.position_ids[rows, :P], use_cache=True, logits_to_keep=1)
    reps = n if uniform else torch.tensor(runs, device=dev)
    first = out.logits[:, -1:].repeat_interleave(reps, dim=0)  # predicts response token 0
    if L - P == 1:
        return first
    cache = getattr(out, kw)
    # reorder_cache takes every layer kind along (linear-attention conv and recurrent states too)
    cache.reorder_cache(torch.arange(len(runs), device=dev).repeat_interleave(reps))
    rest = model(input_ids=batch.input_ids[:, P:L - 1], attention_mask=batch.attention_mask[:, :L - 1],
                 position_ids=batch.position_ids[:, P:L - 1], use_cache=True, **{kw: cache})
    return torch.cat([first, rest.logits], dim=1)


def _runs(batch: Batch) -> list[int]:
    """Lengths of the runs of consecutive rows with the same prompt (all 1 without samples)."""
    return prompt_runs(batch.samples) if len(batch.samples) == len(batch) else [1] * len(batch)


def prompt_runs(s: list[Any]) -> list[int]:
    runs: list[int] = []
    for i, x in enumerate(s):
        if i and x.prompt_ids == s[i - 1].prompt_ids:
            runs[-1] += 1
        else:
            runs.append(1)
    return runs


def _group_size(batch: Batch) -> int:
    """n when rows come in runs of n (> 1) identical prompts, else 1."""
    runs = _runs(batch)
    return runs[0] if runs[0] > 1 and all(r == runs[0] for r in runs) else 1


def _cache_kwarg(model: torch.nn.Module) -> str:
    # transformers 5.24 renamed past_key_values -> cache; 5.17 has only the old name
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class FSDP2Trainer(SendsPackedWeights):
    """SPMD: with several ranks every rank builds this with the same config and is called with
    the same global batches; collectives (``train_step``, ``logprobs``, ``named_weights``,
    ``load_weights``, ``snapshot_reference``, ``save``, ``load``) must be called on every rank."""

    def __init__(self, cfg: FSDP2Config, *, spec: Any, tokenizer: Any, seed: int = 0,
                 total_steps: int = 0, draft: dict | None = None, algorithm: Any = None, **_):
        self.cfg, self.spec, self.tokenizer = cfg, spec, tokenizer
        self.rank, local_rank, self.world_size = dist_.world_from_env(cfg.world_size)
        self.device = _pick_device(cfg.device, local_rank, self.world_size)
        self.sharded = self.world_size > 1 if cfg.shard is None else cfg.shard
        if self.world_size > 1 and not self.sharded:
            raise MilesError(f"trainer.shard=false needs world size 1 (this run has {self.world_size} "
                             f"ranks); remove trainer.shard")
        if self.sharded:
            dist_.init_group(self.device, self.world_size)
            dist_.object_group()  # created now: new_group must be called in the same order on all ranks
        torch.manual_seed(seed)  # the same seed on every rank: identical initial weights
        self.model = self._place(spec.build_model(tokenizer)).train()
        self.ref: torch.nn.Module | None = None
        self._state: list[tuple[str, torch.Tensor]] | None = None  # see _state_items
        # fused AdamW is one kernel per step instead of several per parameter (CPU and CUDA)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                       weight_decay=cfg.weight_decay, fused=True)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.optim, lr_lambda(cfg, total_steps))
        # the draft: section: a speculative-decoding draft head on the model (after the policy's
        # optimizer: it has its own), or its MTP layers, trained after each update (miles_draft.train,
        # miles_mtp.train)
        self.draft = _draft_training(draft, self.model, algorithm, 1.0 / self.world_size if self.sharded else 1.0)
        self.gemm = (cpu_gemm.for_model("trainer.cpu_gemm", cfg.cpu_gemm, self.model)
                     if self.device.type == "cpu" else "mkl")
        self.workers = self._workers()
        low = cfg.mixed_precision == "bf16" or next(self.model.parameters()).dtype in (torch.bfloat16, torch.float16)
        self.throughput = for_device(getattr(self.model, "config", None) or {}, self.world_size, self.device,
                                     "bf16" if low else "fp32", cfg.peak_tflops)  # mfu, tokens/GPU/s
        # the exact routine train_step scores log-probs with (the same GEMMs, and slices): true
        # on-policy engines apply it to their own copy of the weights, so rollout and training
        # log-probs agree bit for bit
        self.response_logprobs = (functools.partial(response_logprobs, gemm=self.gemm) if self.workers is None
                                  else functools.partial(split_logprobs, w=self.workers, gemm=self.gemm))
        if isinstance(spec, ScoresActions):
            self.response_logprobs = spec.action_logprobs

    def _workers(self) -> workers.Workers | None:
        """World size 1 on CPU with several intra-op threads: worker threads split the rows."""
        threads = torch.get_num_threads()
        k = self.cfg.cpu_workers or min(threads, 8)
        if self.device.type != "cpu" or self.sharded or k < 2 or isinstance(self.spec, ScoresActions):
            return None
        return workers.Workers(k, max(1, threads // k))

    def _score(self, model: torch.nn.Module, batch: Batch, shared: bool | None = None) -> torch.Tensor:
        """Log-probs ``[B, R]`` of the batch's actions: the model spec's own routine when its model
        is not a causal LM (``ScoresActions``, e.g. a diffusion transformer's denoising steps)."""
        if isinstance(self.spec, ScoresActions):
            return self.spec.action_logprobs(model, batch)
        return response_logprobs(model, batch, shared, self.gemm)

    def _place(self, model: torch.nn.Module) -> torch.nn.Module:
        # trainer.precision / trainer.qat: the linear layers compute in that format, over the same
        # parameters (miles_lowp.linear); the formats say which weights go to the engines packed
        self.packed_formats = convert_lowp(model, self.cfg.precision, self.cfg.qat, self.cfg.qat_scope)
        model = model.to(self.device)
        if self.sharded:
            dist_.shard(model, self.device, self.cfg.mixed_precision)
        if self.cfg.compile and self.device.type == "cuda":
            for layer in dist_.decoder_layers(model):
                layer.compile(dynamic=True)  # rows and lengths change every step: no recompiles
        return model

    def _to(self, batch: Batch) -> Batch:
        if self.device.type == "cpu":
            return batch
        return batch.to(self.device)

    # -- collectives the kernel loop uses ----------------------------------------------------------
    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``obj`` from rank ``src`` on every rank (pickled over gloo, also when the model's group
        is NCCL); the identity at world size 1."""
        if self.world_size == 1:
            return obj
        box = [obj if self.rank == src else None]
        torch.distributed.broadcast_object_list(box, src=src, group=dist_.object_group())
        return box[0]

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier(group=dist_.object_group())

    def reshard(self) -> None:
        """Free the root's gathered weights (FSDP2 keeps them after a forward without backward),
        so the next forward, state dict or weight load sees the sharded parameters."""
        if not self.sharded:
            return
        from torch.distributed.fsdp import FSDPModule

        for m in (self.model, self.ref):
            if isinstance(m, FSDPModule):
                m.reshard()

    # -- micro-batches -----------------------------------------------------------------------------
    def _plan(self, batch: Batch) -> tuple[list[tuple[Batch, bool, bool | None]], list[int]]:
        """This rank's micro-batches as ``(batch, real, shared)``, and every rank's row count.

        With several ranks each takes its slice of the global batch (global loss denominators
        kept); all ranks run the same number of micro-batches with the same kind of forward, since
        FSDP's gathers must line up; a rank out of rows runs a zero-weight dummy row instead.
        """
        size = self.cfg.micro_batch_size
        if self.world_size == 1:
            micro = batch.split(size) if size and size < len(batch) else [batch]
            return [(mb, True, None) for mb in micro], [len(batch)]
        runs = _runs(batch)
        run_of = [r for r, n in enumerate(runs) for _ in range(n)]  # row -> index of its run
        slices = dist_.rank_slices(runs, self.world_size)
        chunks = [[list(r[i:i + (size or len(r))]) for i in range(0, len(r), size or max(len(r), 1))]
                  for r in slices]
        plan = []
        for k in range(max(1, max(len(c) for c in chunks))):
            # the shared-prompt forward if any rank's k-th micro-batch gains from it (a contiguous
            # chunk of rows spans run_of[last] - run_of[first] + 1 prompts)
            shared = any(k < len(c) and 2 * (run_of[c[k][-1]] - run_of[c[k][0]] + 1) <= len(c[k])
                         for c in chunks)
            own = chunks[self.rank][k] if k < len(chunks[self.rank]) else None
            plan.append((batch.select(own or [0]), own is not None, shared))
        return plan, [len(r) for r in slices]

    @torch.no_grad()
    def logprobs(self, batch: Batch, which: str = "policy") -> torch.Tensor:
        model = self.ref if which == "ref" else self.model
        if model is None:
            raise RuntimeError("reference log-probs requested before snapshot_reference()")
        if self.world_size == 1:
            size = self.cfg.micro_batch_size or len(batch)
            out = torch.cat([split_logprobs(model, mb, self.workers, self.gemm) if self.workers is not None
                             else self._score(model, self._to(mb)).cpu()
                             for mb in batch.split(size)])
            self.reshard()
            return out
        plan, counts = self._plan(batch)
        parts = [lp for mb, real, shared in plan
                 for lp in [self._score(model, self._to(mb), shared)] if real]
        self.reshard()
        R = batch.loss_mask.shape[1]
        local = torch.cat(parts) if parts else torch.zeros(0, R, device=self.device)
        return dist_.gather_rows(local, counts).cpu()

    def train_step(self, batch: Batch, loss_fn) -> dict[str, float]:
        t0 = time.perf_counter()
        out = self._train_step(batch, loss_fn)  # its metrics are floats: the device is done
        if self.draft is not None:
            mb = self._to(batch)
            out.update(self.workers.run(self.draft.step, self.model, mb) if self.workers is not None
                       else self.draft.step(self.model, mb))
        return {**out, **self.throughput.metrics(seq_lens(batch), time.perf_counter() - t0)}

    def _train_step(self, batch: Batch, loss_fn) -> dict[str, float]:
        tally = Tally()
        # the whole batch to the device in one go: a copy per micro-batch would wait for the GPU
        for mb, real, shared in self._plan(self._to(batch))[0]:
            if self.workers is not None:  # world size 1 on CPU: the cores split the rows
                fn = lambda b: response_logprobs(self.model, b, gemm=self.gemm)  # noqa: E731
                loss, metrics = workers.train(fn, self.model, mb, _runs(mb), self.workers, loss_fn)
            else:
                lp = self._score(self.model, mb, shared)
                if not real:
                    (lp * 0).sum().backward()  # joins the ranks' gradient reduce-scatter, adds nothing
                    continue
                loss, metrics = loss_fn(mb, lp)
                loss.backward()
            tally.add(loss, metrics, len(mb) / len(batch))  # row weight: the ranks' sums add up
        totals, loss_sum = tally.result()
        if self.world_size > 1:
            # the key has a space so no loss_fn metric can collide with it
            totals = dist_.sum_metrics({**totals, " loss": loss_sum})
            loss_sum = totals.pop(" loss")
        if self.workers is not None:  # on a worker too: an OpenMP team stalls when a core is busy
            return self.workers.run(self._update, totals, loss_sum)
        return self._update(totals, loss_sum)

    def _update(self, totals: dict[str, float], loss_sum: float) -> dict[str, float]:
        """Clip, then the optimizer and LR steps (skipped on a non-finite loss or gradient)."""
        return step_or_skip(self.optim, self.sched, totals, loss_sum, self._clip())

    def _clip(self) -> float:
        """Global gradient norm (before clipping); clips it to ``grad_clip`` if set."""
        params = list(self.model.parameters())
        if self.cfg.grad_clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
        elif self.sharded:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        else:
            norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in params if p.grad is not None))
        return float(_full(norm))

    # -- weights -----------------------------------------------------------------------------------
    def snapshot_reference(self) -> None:
        if not self.sharded:
            self.ref = copy.deepcopy(self.model).eval().requires_grad_(False)
            return
        with torch.random.fork_rng(devices=[]):  # building a model must not move the training RNG
            ref = self._place(self.spec.build_model(self.tokenizer))
        ref.eval().requires_grad_(False)
        self.reshard()
        mine, theirs = self.model.state_dict(), ref.state_dict()
        assert list(mine) == list(theirs), "reference built with other weight names"
        with torch.no_grad():  # same sharding on both: a local copy per rank, no communication
            for name, t in mine.items():
                _local(theirs[name]).copy_(_local(t))
        self.ref = ref

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF names and full tensors, one at a time (each gathered from the ranks' shards just
        before it is yielded), on every rank."""
        if not self.sharded:
            for name, t in self._state_items():
                yield name, t.detach()
            return
        self.reshard()
        for name, t in dist_.full_tensors(self._state_items()):
            yield name, t.detach()

    def model_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``named_weights`` without the draft head's (``miles.protocols.ExportsDraft``)."""
        from miles_draft.files import without_head

        return without_head(self.named_weights())

    def export_draft(self, folder: str) -> None:
        """The draft head as ``draft_head.safetensors`` in ``folder`` (the engine's
        ``engine.speculative.path`` reads it), if this trainer trains one."""
        from miles_draft.train import DraftTraining

        if not isinstance(self.draft, DraftTraining):  # none, or MTP layers: exported with the model
            return
        from miles_draft.files import save_head, split

        head = split(self.named_weights())[1]
        if self.rank == 0:
            save_head(head, folder)

    def _state_items(self) -> list[tuple[str, torch.Tensor]]:
        """The state dict's names with the live parameters and buffers they name, kept: FSDP2
        builds a state dict of DTensors at ~20 us per tensor, at every sync. (The sharded
        parameters stay the same objects, updated in place; a model whose state dict names
        something else is asked each time.)"""
        if self._state is None:
            live = dict(self.model.named_parameters(remove_duplicate=False))
            live.update(self.model.named_buffers(remove_duplicate=False))
            keys = list(self.model.state_dict())
            self._state = [(k, live[k]) for k in keys] if all(k in live for k in keys) else []
        return self._state or list(self.model.state_dict().items())

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Full tensors in HF names (the same on every rank); each rank keeps its shard."""
        if not self.sharded:
            self.model.load_state_dict(dict(named_tensors), strict=True)
            return
        from torch.distributed.tensor import DTensor, distribute_tensor

        self.reshard()
        state, seen = self.model.state_dict(), set()
        with torch.no_grad():
            for name, full in named_tensors:
                if name not in state:
                    raise MilesError(f"load_weights: {name!r} is not a weight of this model "
                                     f"(expected Hugging Face names such as {next(iter(state))!r})")
                dst = state[name]
                if isinstance(dst, DTensor):
                    # every rank holds the full tensor: cut this rank's chunk locally, no scatter
                    full = distribute_tensor(full.detach().to(dst.device, dst.dtype), dst.device_mesh,
                                             dst.placements, src_data_rank=None)
                _local(dst).copy_(_local(full))
                seen.add(name)
        if len(seen) < len(state):
            raise MilesError(f"load_weights: missing weights {sorted(set(state) - seen)[:5]}")

    def save(self, path: str) -> None:
        """Collective: every rank with the same ``path`` (torch.distributed.checkpoint)."""
        from . import checkpoint

        checkpoint.save(self, path)
        if self.draft is not None and self.rank == 0:
            self.draft.save(path)

    def load(self, path: str) -> None:
        """Collective; the checkpoint may come from another world size."""
        from . import checkpoint

        checkpoint.load(self, path)
        if self.draft is not None:
            self.draft.load(path)
        self._state = None  # loaded in place, but asked afresh in case a loader replaced tensors


def _draft_training(settings: dict | None, model: torch.nn.Module, algorithm: Any, share: float) -> Any:
    """The draft's training for a ``draft:`` section (validated by this plugin's
    ``miles_validate_config``), or None: the model's own MTP layers where it carries them (the
    engine's mtp draft; ``share``: a rank's share of their summed sharded gradient), else a draft
    head. A supervised phase (the warm start) always trains it."""
    if settings is None:
        return None
    from miles_draft.config import DraftConfig
    from miles_draft.train import DraftTraining
    from miles_mtp import mtp_layers

    supervised = algorithm is not None and not algorithm.uses_rollout
    cfg = DraftConfig.model_validate(settings)
    if mtp_layers(model):
        from miles_mtp.train import MTPTraining

        if cfg.vocab is not None:  # EAGLE-3's reduced vocabulary is the head's: MTP layers keep their own LM head
            raise MilesError(f"draft.vocab: {cfg.vocab} applies to a draft head; this model's MTP layers score the "
                             f"whole vocabulary (remove draft.vocab)")
        if cfg.updates_per_step > 1:  # MTPTraining takes one step per RL step
            raise MilesError(f"draft.updates_per_step: {cfg.updates_per_step} applies to a draft head; this "
                             f"model's MTP layers train one update per step (use draft.updates_per_step: 1)")

        return MTPTraining(cfg, model, supervised=supervised, share=share)
    return DraftTraining(cfg, model, supervised=supervised)


def _pick_device(name: str, local_rank: int, world: int) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(name)
    if dev.type == "cuda" and dev.index is None and world > 1:
        dev = torch.device("cuda", local_rank)  # torchrun: one GPU per local rank
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)
    return dev


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t
