"""The megatron trainer: a megatron-core ``GPTModel`` (tensor / pipeline / expert parallel, local
layer spec) built from the model spec's Hugging Face model, AdamW over fp32 master weights; bf16
compute runs a bf16 copy of the model (``compute.py``; bf16 autocast with pipeline stages).

SPMD like the fsdp2 trainer: every rank builds it with the same config and is called with the same
global batches. Data-parallel ranks take row slices of a batch; the ranks of one tensor-parallel
group (and of one pipeline, ``pipeline.py``) take the same rows. Weights enter and leave in
Hugging Face names (``convert.py``).
"""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from miles_fastpath.schedule import Tally, lr_lambda, step_or_skip
from miles_rlmath.logprobs import fused_available, token_logprobs
from miles_telemetry.flops import for_device, seq_lens
from miles import Batch, MilesError
from miles.protocols import EditsMegatronLayers, KnowsArchitecture
from miles_lowp.linear import SendsPackedWeights

from . import arch as arch_
from . import compute as compute_
from . import convert
from . import draft as draft_
from . import lowp as lowp_
from . import mtp as mtp_
from . import parallel as par
from . import pipeline
from . import replay as replay_
from .config import MegatronConfig
from .rows import right_aligned


class MegatronTrainer(draft_.ExportsHead, SendsPackedWeights):
    """Collectives (``train_step``, ``logprobs``, ``named_weights``, ``load_weights``,
    ``snapshot_reference``, ``save``, ``load``) must be called on every rank."""

    def __init__(self, cfg: MegatronConfig, *, spec: Any, tokenizer: Any, seed: int = 0,
                 total_steps: int = 0, draft: dict | None = None, algorithm: Any = None, **_: Any):
        self.cfg, self.spec, self.tokenizer = cfg, spec, tokenizer
        self.rank, local_rank, self.world_size = par.world_from_env(cfg.world_size)
        self.device = par.pick_device(cfg.device, local_rank, self.world_size)
        torch.manual_seed(seed)  # the same seed on every rank: identical initial weights
        hf = spec.build_model(tokenizer)  # the source of the config and the initial weights
        family = spec.architecture() if isinstance(spec, KnowsArchitecture) else None
        self.arch = arch_.arch_of(hf.config, family)
        self.throughput = for_device(hf.config, self.world_size, self.device, cfg.precision,
                                     cfg.peak_tflops)  # mfu, tokens/GPU/s
        par.check_layout(cfg, self.arch, self.world_size)
        lowp_.check_arch(cfg, self.arch)
        self.tp, self.ep, self.pp = cfg.tensor_parallel, cfg.expert_parallel, cfg.pipeline_parallel
        self.vp = cfg.virtual_pipeline_parallel
        par.init(self.device, self.world_size, self.tp, self.pp, self.ep, self.vp, self.arch.expert_tp(self.tp))
        from megatron.core import parallel_state as ps

        self.ps = ps
        self.tp_rank, self.ep_rank = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
        self.dp, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self.stage = ps.get_pipeline_model_parallel_rank()
        self.last_stage = self.stage == self.pp - 1
        if self.device.type == "cuda":
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(seed)
        hf_state = hf.state_dict()
        self.hf_names = list(hf_state)
        self.fused_experts = any(k.endswith("experts.gate_up_proj") for k in hf_state)
        # R3: the spec records routing, so the MoE routers replay the rollout's experts
        self.replay = replay_.table_for(spec, hf, self.arch)
        # the architecture inserts modules megatron-core lacks, then the spec edits, then R3's router
        self.edit = _edits(family.megatron_layer_spec if isinstance(family, EditsMegatronLayers) else None,
                           spec.megatron_layer_spec if isinstance(spec, EditsMegatronLayers) else None,
                           replay_.spec_edit(self.replay) if self.replay is not None else None)
        self.model, self.compute = self._build(), None
        full = convert.hf_to_full(hf_state, self.arch, self.tp)
        # HF weights Megatron builds nothing for (a checkpoint's multi-token-prediction layers,
        # kept by the spec): carried unchanged, so weight sync and export keep them; with a draft:
        # section the first MTP layer trains instead (mtp.py), else a draft head (draft.py)
        built = set(convert.full_to_hf(full, self.arch, self.fused_experts))
        self.draft: Any = mtp_.training(draft, self, hf, algorithm)
        trained = set(self.draft.names.values()) if self.draft is not None else set()
        self.carried = {k: v for k, v in hf_state.items() if k not in built and k not in trained}
        self._load_full(full)
        # trainer.precision fp8 / mxfp8, trainer.qat: HF names of the weights the forward rounds,
        # sent packed (miles.protocols.SendsPacked); _build makes the linears compute so
        self.packed_formats = lowp_.formats(hf, cfg)  # (it converts hf: last use)
        hf_config = hf.config
        del hf, hf_state
        self.model.train()
        dtype = compute_dtype(cfg, self.device, self.pp)
        if dtype is not None:
            self.compute = compute_.ComputeCopy(self.model, lambda: self._build(dtype=dtype))
        if cfg.compile and self.device.type == "cuda":
            from .compiled import compile_layers

            compile_layers(self.policy_module())
        self.ref: torch.nn.Module | None = None
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                       weight_decay=cfg.weight_decay, fused=True)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.optim, lr_lambda(cfg, total_steps))
        # the draft: section on a model without MTP layers: a speculative-decoding draft head beside
        # the policy, with its own optimizer, trained after each update (draft.py)
        if self.draft is None:
            self.draft = draft_.training(draft, self, hf_config, algorithm)

    def _build(self, head: bool = True, tied: bool | None = None,
               dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        """This rank's part of a GPTModel: its pipeline stage, or with virtual stages its chunks
        (``pipeline.Chunks``). ``head=False``: no final norm and output layer (the critic's)."""
        from megatron.core import parallel_state as ps

        with torch.random.fork_rng(devices=[]):  # building must not shift the run's random stream
            cfg = arch_.transformer_config(self.arch, tp=self.tp, pp=self.pp, ep=self.ep, vp=self.vp,
                                           params_dtype=dtype, fused=self.device.type == "cuda")
            # gloo (CPU) has no batched send/recv between pipeline stages
            cfg.batch_p2p_comm = self.device.type == "cuda"
            if self.vp == 1:
                model = arch_.build_gpt(self.arch, cfg, tp=self.tp, edit=self.edit, pre_process=self.stage == 0,
                                        post_process=head and self.last_stage, tied=tied).to(self.device)
            else:
                model = pipeline.Chunks([arch_.build_gpt(
                    self.arch, cfg, tp=self.tp, edit=self.edit, tied=tied, vp_stage=c,
                    pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=c),
                    post_process=head and ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=c))
                    for c in range(self.vp)]).to(self.device)
        lowp_.apply(model, self.cfg, self.arch, self.tp)
        return model

    def _load_full(self, full: dict[str, torch.Tensor], model: torch.nn.Module | None = None) -> None:
        """Full Megatron tensors -> this rank's shards, into ``model`` (default: the policy)."""
        model = model or self.model
        mine = convert.shard(full, self.arch, tp=self.tp, tp_rank=self.tp_rank, ep=self.ep, ep_rank=self.ep_rank)
        if self.pp > 1:
            mine = pipeline.to_stage(mine, self.arch.num_layers, self.pp, self.stage, self.arch.tied, self.vp)
        own = {k for k in model.state_dict() if not k.endswith("_extra_state")}
        if set(mine) != own:
            raise MilesError(f"trainer megatron: weights do not match the model (missing "
                             f"{sorted(own - set(mine))[:3]}, unexpected {sorted(set(mine) - own)[:3]})")
        model.load_state_dict(mine, strict=False)
        if model is self.model:
            self.weights_changed()

    def weights_changed(self) -> None:
        """The fp32 policy weights changed outside an optimizer step (a load): the bf16 copy
        follows before its next forward."""
        if self.compute is not None:
            self.compute.stale()

    def policy_module(self) -> torch.nn.Module:
        """The model that runs the policy's forward and backward: the bf16 copy, if any."""
        return self.compute.model() if self.compute is not None else self.model

    # -- collectives the kernel loop uses ---------------------------------------------------------
    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if self.world_size == 1:
            return obj
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src, group=par.object_group())
        return box[0]

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=par.object_group())

    # -- forward -----------------------------------------------------------------------------------
    def _autocast(self, model: torch.nn.Module) -> Any:
        """bf16 autocast for a model with fp32 weights (a bf16 model needs none)."""
        fp32 = next(model.parameters()).dtype == torch.float32
        if self.cfg.precision != "fp32" and self.device.type == "cuda" and fp32:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _scored(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """``[B, R]`` log-probs of the response tokens (logits over the rollout temperature),
        computed over the vocabulary shards of the tensor-parallel group. Private: it runs a
        Megatron model, so this trainer does not offer ``ExactScoring`` (an engine would apply the
        routine to its own Hugging Face model)."""
        return self._from_logits(self._forward(model, batch), batch)

    def _forward(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """The model's (or this pipeline stage's) output on the right-aligned rows: logits
        ``[B, S, V / tp]`` where it has the output layer (the last stage), else hidden states
        ``[S, B, H]`` in fp32 (the dtype stages send; the critic's backbone, before its norm)."""
        ids, _ = right_aligned(batch)
        pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        with self._replaying(batch, ids.shape[1]), self._autocast(model):
            out = model(ids, pos, None)
        return out if model.post_process else out.float()

    def _replaying(self, batch: Batch, width: int) -> Any:
        """With R3, the forwards inside use the batch's recorded experts."""
        if self.replay is None:
            return contextlib.nullcontext()
        return self.replay.replaying(batch, width)

    def _from_logits(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        _, index = right_aligned(batch)
        targets = batch.input_ids[:, batch.prompt_len:]
        if self.tp == 1 and fused_available(logits.device):  # one pass over the bf16 logits, no copies
            return token_logprobs(logits, targets, batch.temperature, index, self.arch.vocab)
        V = logits.shape[-1]
        logits = logits.gather(1, index.unsqueeze(-1).expand(-1, -1, V)).float()
        if batch.temperature != 1.0:
            logits = logits / batch.temperature
        start = self.tp_rank * V
        if start + V > self.arch.vocab:  # rows padded so the vocabulary splits evenly: never sampled
            cols = torch.arange(start, start + V, device=logits.device) >= self.arch.vocab
            logits = logits.masked_fill(cols, float("-inf"))
        return -vocab_parallel_cross_entropy(logits, targets)

    def _my_rows(self, n: int) -> tuple[list[int], list[int]]:
        """This data-parallel rank's rows of an ``n``-row batch, and every DP rank's row count."""
        base, extra = divmod(n, self.dp)
        counts = [base + (r < extra) for r in range(self.dp)]
        start = sum(counts[:self.dp_rank])
        return list(range(start, start + counts[self.dp_rank])), counts

    def _micro(self, batch: Batch) -> tuple[list[tuple[Batch, Batch | None]], list[int]]:
        """``(micro-batch to run, its real rows or None)`` for this rank, and every DP rank's row
        count. Every DP rank runs as many micro-batches; with expert parallelism each k-th one also
        has the same row count on every rank (the MoE token all-gather needs equal sizes), topped
        up with copies of a row whose log-probs are dropped (a rank out of rows runs only those)."""
        rows, counts = self._my_rows(len(batch))
        size = self.cfg.micro_batch_size or max(1, max(counts))
        steps = max(1, -(-max(counts) // size))
        if self.vp > 1:  # the interleaved schedule runs micro-batches in groups of pipeline_parallel
            steps = -(-steps // self.pp) * self.pp
        plan = []
        for k in range(steps):
            own = rows[k * size:(k + 1) * size]
            width = max(1, len(own))
            if self.pp > 1:  # the pipeline sends activations of one shape: every micro-batch full
                width = size
            elif self.ep > 1:
                width = max(1, max(len(range(k * size, min((k + 1) * size, c))) for c in counts))
            run = batch.select(own + [own[0] if own else 0] * (width - len(own))).to(self.device)
            plan.append((run, batch.select(own).to(self.device) if own else None))
        return plan, counts

    @torch.no_grad()
    def logprobs(self, batch: Batch, which: str = "policy") -> torch.Tensor:
        model = self.ref if which == "ref" else self.policy_module()
        if model is None:
            raise RuntimeError("reference log-probs requested before snapshot_reference()")
        model.eval()
        out = self._rows(model, batch, self._forward, self._from_logits)
        if model is not self.ref:
            model.train()
        return out

    def _rows(self, model: torch.nn.Module, batch: Batch, forward: Any, score: Any) -> torch.Tensor:
        """The batch's ``[B, R]`` no-grad scores, gathered over the DP ranks (on the CPU):
        ``forward(model, run)`` runs the model (or this pipeline stage), ``score(last_stage_output,
        run)`` -> ``[B, R]``."""
        plan, counts = self._micro(batch)
        rows, R = counts[self.dp_rank], batch.input_ids.shape[1] - batch.prompt_len
        if self.pp > 1:
            def rows_of(run: Batch, real: Batch | None, output: torch.Tensor) -> tuple[torch.Tensor, Any]:
                x = score(output, run)
                return x.sum() * 0, x[:len(real)] if real is not None else None

            out = pipeline.run(model, plan, forward, rows_of, forward_only=True)
            local = torch.zeros(rows, R, device=self.device)
            if self.last_stage and rows:
                local = torch.cat([x for x in out if x is not None])
            local = pipeline.tensor_from_last_stage(local)
        else:
            parts = []
            for run, real in plan:  # every micro-batch runs, so the ranks' MoE collectives line up
                x = score(forward(model, run), run)
                if real is not None:
                    parts.append(x[:len(real)])
            local = torch.cat(parts) if parts else torch.zeros(0, R, device=self.device)
        return par.gather_rows(local, counts, self.ps.get_data_parallel_group()).cpu()

    def _loss(self, model: torch.nn.Module, batch: Batch, forward: Any, score: Any,
              loss_fn: Any) -> tuple[dict[str, float], float]:
        """Forward/backward of ``loss_fn(micro_batch, score(forward(model, run), run))`` over this
        rank's micro-batches (through the pipeline schedule with stages): ``(metrics, loss)`` of this
        DP rank, on every stage."""
        def loss_of(run: Batch, mb: Batch | None, output: torch.Tensor) -> tuple[torch.Tensor, Any]:
            x = score(output, run)
            if mb is None:  # a rank out of rows: in the graph (its collectives), adds nothing
                return (x * 0).sum(), None
            if len(x) > len(mb):  # top-up rows: in the graph (their collectives), not in the loss
                x = x[:len(mb)] + 0 * x[len(mb):].sum()
            loss, metrics = loss_fn(mb, x)
            kept = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}
            return loss, (loss.detach(), kept, len(mb) / len(batch))  # read back once, by the Tally below

        plan = self._micro(batch)[0]
        if self.pp > 1:
            done = [x for x in pipeline.run(model, plan, forward, loss_of, forward_only=False) if x is not None]
        else:
            done = []
            for run, mb in plan:
                loss, out = loss_of(run, mb, forward(model, run))
                loss.backward()
                if out is not None:
                    done.append(out)
        tally = Tally()
        for loss, metrics, weight in done:
            tally.add(loss, metrics, weight)
        result = tally.result()
        return pipeline.from_last_stage(result) if self.pp > 1 else result

    def train_step(self, batch: Batch, loss_fn: Any) -> dict[str, float]:
        t0 = time.perf_counter()
        out = self._train_step(batch, loss_fn)  # its metrics are floats: the device is done
        if self.draft is not None:
            out.update(self.draft.step(self, batch))
        return {**out, **self.throughput.metrics(seq_lens(batch), time.perf_counter() - t0)}

    def _train_step(self, batch: Batch, loss_fn: Any) -> dict[str, float]:
        totals, loss_sum = self._loss(self.policy_module(), batch, self._forward, self._from_logits, loss_fn)
        if self.pp > 1 and self.arch.tied:
            pipeline.sum_tied_grads(self.model)
        if self.dp > 1:  # each rank's loss is its share of the global mean: the sum is the whole
            totals = self._sum_dp({**totals, " loss": loss_sum})
            loss_sum = totals.pop(" loss")
        self._reduce_grads()
        return self._update(totals, loss_sum)

    def _sum_dp(self, metrics: dict[str, float]) -> dict[str, float]:
        keys = sorted(metrics)
        t = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.ps.get_data_parallel_group())
        return dict(zip(keys, t.tolist()))

    def _reduce_grads(self, named: list[tuple[str, torch.nn.Parameter]] | None = None) -> None:
        """Sum gradients over the data-parallel ranks (experts: over the expert-data-parallel ones).
        ``named``: Megatron-named parameters (default: the policy's)."""
        named = named if named is not None else list(self.model.named_parameters())
        dense = [p for n, p in named if "local_experts" not in n]
        experts = [p for n, p in named if "local_experts" in n]
        par.all_reduce_grads(dense, self.ps.get_data_parallel_group())
        if self.tp > 1 and not self.arch.kv_lora_rank:  # per-head q/k norms (not MLA's latent ones) and
            # the DeltaNet's gated norm see only this rank's heads: each holds a partial sum
            par.all_reduce_grads([p for n, p in named if n.endswith(("q_layernorm.weight", "k_layernorm.weight",
                                                                     "self_attention.out_norm.weight"))],
                                 self.ps.get_tensor_model_parallel_group())
        if experts:
            par.all_reduce_grads(experts, self.ps.get_expert_data_parallel_group())
            if self.tp > 1:  # each saw every TP rank's copy of the tokens (tp_train.py)
                torch._foreach_mul_([p.grad for p in experts if p.grad is not None], 1 / self.tp)
        if self.tp > 1 and self.arch.hf_attention:  # DeepSeek-V4's attention: the parts its heads share
            par.all_reduce_grads([p for n, p in named if ".self_attention.hf." in n  # see this rank's heads
                                  and convert.tp_dim(pipeline.unchunked(n)) is None],
                                 self.ps.get_tensor_model_parallel_group())

    def _clip(self, named: list[tuple[str, torch.nn.Parameter]] | None = None) -> float:
        """The global gradient norm, after scaling the gradients down to ``grad_clip``."""
        named = named if named is not None else list(self.model.named_parameters())
        norm = self._grad_norm(named)
        if self.cfg.grad_clip is not None and math.isfinite(norm):
            scale = self.cfg.grad_clip / (norm + 1e-6)
            if scale < 1:
                for _, p in named:
                    if p.grad is not None:
                        p.grad.mul_(scale)
        return norm

    def _update(self, totals: dict[str, float], loss_sum: float) -> dict[str, float]:
        out = step_or_skip(self.optim, self.sched, totals, loss_sum, self._clip())
        self.weights_changed()
        return out

    def _grad_norm(self, named: list[tuple[str, torch.nn.Parameter]]) -> float:
        """Global L2 norm of the gradient: TP-sharded weights summed over the TP group, replicated
        ones counted once, experts summed over the expert-parallel group too. Sharding is read from
        the weight's name: megatron-core sets its ``tensor_model_parallel`` attribute only when it
        initialises the weight itself."""
        grads: dict[str, list[torch.Tensor]] = {"dense": [], "expert": []}
        copy = self.pp > 1 and self.arch.tied and self.stage > 0  # the last stage's tied-embedding copy
        for n, p in named:
            if p.grad is None or (copy and n == pipeline.last_prefix(self.vp) + "output_layer.weight"):
                continue
            if "local_experts" in n:
                grads["expert"].append(p.grad)
            elif convert.tp_dim(pipeline.unchunked(n)) is not None or self.tp_rank == 0:  # sharded, or once
                grads["dense"].append(p.grad)
        # a few multi-tensor kernels, not four per parameter (hundreds of expert weights)
        dense, expert = (torch.nn.utils.get_total_norm(g, foreach=True).double().square() if g
                         else torch.zeros((), dtype=torch.float64, device=self.device) for g in grads.values())
        if self.tp > 1:
            dist.all_reduce(dense, group=self.ps.get_tensor_model_parallel_group())
        if self.arch.moe and self.tp * self.ep > 1:
            dist.all_reduce(expert, group=self.ps.get_expert_tensor_and_model_parallel_group())
        total = dense + expert
        if self.pp > 1:
            dist.all_reduce(total, group=self.ps.get_pipeline_model_parallel_group())
        return float(total.sqrt())

    # -- weights -----------------------------------------------------------------------------------
    def snapshot_reference(self) -> None:
        # in the policy's compute precision, so both score a batch alike before the first step
        ref = self._build(dtype=self.compute.copy_dtype if self.compute is not None else torch.float32)
        ref.load_state_dict(self.model.state_dict())
        self.ref = ref.eval().requires_grad_(False)

    def full_groups(self, model: torch.nn.Module | None = None,
                    tensors: dict[str, torch.Tensor] | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """Full Megatron tensors, one decoder layer (or one other weight) at a time, gathered from
        the TP and EP shards just before they are yielded, on every rank. ``tensors``: local
        tensors shaped like the model's (e.g. an optimizer moment) instead of its weights."""
        local = tensors if tensors is not None else {
            k: v for k, v in (model or self.model).state_dict().items() if not k.endswith("_extra_state")}
        if self.pp == 1:
            yield from self._gathered(local)
            return
        if self.arch.tied and self.stage > 0:  # the first stage sends the embedding
            local.pop(pipeline.last_prefix(self.vp) + "output_layer.weight", None)
        local = {pipeline.to_full_name(k, self.arch.num_layers, self.pp, self.stage, self.vp): v
                 for k, v in local.items()}
        yield from pipeline.across_stages(self._gathered(local), self.stage, self.pp, self.device)

    def _gathered(self, local: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
        """``full_groups`` within one pipeline stage: TP and EP shards gathered, a group at a time."""
        tp_group = self.ps.get_tensor_model_parallel_group()
        ep_group = self.ps.get_expert_model_parallel_group()
        for names in convert.layer_groups(local):
            full: dict[str, torch.Tensor] = {}
            for name in names:
                t = local[name].detach()
                parts = par.all_gather(t, tp_group) if convert.tp_dim(name, self.arch) is not None else [t]
                merged = convert.tp_merge(name, parts, self.arch)
                if "local_experts" in name and self.ep > 1:
                    for r, x in enumerate(par.all_gather(merged, ep_group)):
                        full[convert.expert_global(name, self.arch, self.ep, r)] = x
                else:
                    full[convert.expert_global(name, self.arch, self.ep, self.ep_rank)] = merged
            yield full

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF names and full tensors, a layer at a time (no full-model copy on any rank)."""
        for full in self.full_groups():
            yield from convert.full_to_hf(full, self.arch, self.fused_experts).items()
        yield from self.carried.items()
        if self.draft is not None:  # every rank holds the whole head (or MTP layer)
            yield from self.draft.named()

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Full tensors in HF names (the same on every rank); each rank keeps its shards."""
        named = draft_.split_named(named_tensors, self.draft)
        unknown = sorted(set(named) - set(self.hf_names))
        if unknown:
            raise MilesError(f"load_weights: {unknown[0]!r} is not a weight of this model (expected "
                             f"Hugging Face names such as {self.hf_names[0]!r})")
        self.carried.update({k: v.detach().cpu() for k, v in named.items() if k in self.carried})
        try:
            full = convert.hf_to_full(named, self.arch, self.tp)
        except KeyError as e:
            raise MilesError(f"load_weights: missing weight {e}") from None
        with torch.no_grad():
            self._load_full({k: v.to(self.device) for k, v in full.items()})

    def save(self, path: str) -> None:
        from . import checkpoint

        checkpoint.save(self, path)

    def load(self, path: str) -> None:
        from . import checkpoint

        checkpoint.load(self, path)


def compute_dtype(cfg: MegatronConfig, device: torch.device, pp: int) -> torch.dtype | None:
    """The dtype of the policy's compute copy (None: the fp32 policy runs itself): bf16 on
    CUDA, except with pipeline stages, which send fp32 activations and keep autocast."""
    if cfg.precision != "fp32" and device.type == "cuda" and pp == 1:
        return torch.bfloat16
    return None


def _edits(*edits: Any) -> Any:
    """The layer-spec edits applied in order (None: no edit)."""
    edits = [e for e in edits if e is not None]
    if not edits:
        return None

    def edit(spec: Any) -> Any:
        for e in edits:
            spec = e(spec)
        return spec

    return edit
