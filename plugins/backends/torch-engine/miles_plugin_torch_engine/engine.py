"""The ``torch`` rollout engine: batched, KV-cached sampling with a Hugging Face causal LM."""
from __future__ import annotations

import inspect
import threading
from typing import Any, Iterable, Iterator, Sequence

import torch
from miles import Completion, MilesError, SamplingParams

from .config import TorchEngineConfig
from .hf_graphs import MIN_STEPS, GraphStep, static_cache, static_layers
from .weights import WeightReceiver

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _left_pad(prompts: Sequence[Sequence[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = [[pad] * (width - len(p)) + list(p) for p in prompts]
    mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
    return (torch.tensor(ids, dtype=torch.long, device=device),
            torch.tensor(mask, dtype=torch.long, device=device))


def _repeat_cache(cache: Any, n: int, rows: int, device: Any = None) -> Any:
    """The prefilled cache with every row repeated ``n`` times (samples of a prompt are adjacent)."""
    if n == 1:
        return cache
    if hasattr(cache, "reorder_cache"):  # transformers Cache objects (in place), every layer kind:
        # attention keys/values, linear-attention conv and recurrent states, compressor buffers
        # built on the cache's device: each layer would otherwise copy it from the host
        cache.reorder_cache(torch.arange(rows, device=device).repeat_interleave(n))
        return cache
    # legacy tuple-of-(key, value) caches of custom models
    return tuple(tuple(t.repeat_interleave(n, dim=0) for t in layer) for layer in cache)


def _filter(logp: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``logp`` with tokens outside the top-k / nucleus set to -inf (renormalised between filters,
    as Hugging Face does)."""
    if 0 < top_k < logp.shape[-1]:
        kth = logp.topk(top_k, dim=-1).values[:, -1:]
        logp = logp.masked_fill(logp < kth, float("-inf"))
    if top_p < 1.0:
        logp = torch.log_softmax(logp, dim=-1)
        sorted_lp, order = logp.sort(dim=-1, descending=True)
        probs = sorted_lp.exp()
        # drop a token once the tokens ranked above it already cover top_p (the first always stays)
        drop = (probs.cumsum(dim=-1) - probs) > top_p
        sorted_lp = sorted_lp.masked_fill(drop, float("-inf"))
        logp = torch.full_like(logp, float("-inf")).scatter(-1, order, sorted_lp)
    return logp


def _sample(logits: torch.Tensor, params: SamplingParams,
            gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its log-prob under ``log_softmax(logits / T)`` (before filtering,
    which is what the trainer recomputes)."""
    logits = logits.float()
    if params.temperature <= 0:
        tok = logits.argmax(dim=-1)
        return tok, torch.log_softmax(logits, dim=-1).gather(-1, tok[:, None]).squeeze(-1)
    logp = torch.log_softmax(logits / params.temperature, dim=-1)
    probs = _filter(logp, params.top_k, params.top_p).exp()
    # exponential race (argmax p/E, E ~ Exp(1)) samples from p without multinomial's host sync;
    # -log(U) is ~2x faster than exponential_ on CPU
    noise = torch.rand(probs.shape, generator=gen, device=probs.device).log_().neg_()
    tok = (probs / noise).argmax(dim=-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


class TorchEngine(WeightReceiver):
    """Rollout engine running the spec's model in this process (CPU or one GPU)."""

    def __init__(self, cfg: TorchEngineConfig, *, spec: Any, tokenizer: Any, seed: int = 0, **_: Any):
        self.cfg = cfg
        self.device = _device(cfg.device)
        self.tokenizer = tokenizer
        self.model = spec.build_model(tokenizer).to(device=self.device, dtype=_DTYPES[cfg.dtype]).eval()
        self.weight_version = 0
        self.eos_id = getattr(tokenizer, "eos_token_id", None)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = pad if pad is not None else (self.eos_id if self.eos_id is not None else 0)
        self._gen = torch.Generator(device=self.device).manual_seed(seed)
        # set from another thread (the server's abort): generate() returns before its next decode
        # step; unfinished samples answer with finish_reason "abort" and the tokens they have
        self.interrupt = threading.Event()
        # prompt indices of the running generate() to leave out from the next decode step on (the
        # server's scheduler adds those whose clients all left); the fast path reads it
        self.dropped: set[int] = set()
        # the model's own forward (impl: hf) reads whether every row stopped every 16 decode steps on
        # CUDA, so the host queues the next step while the GPU runs this one (rows that stopped
        # decode a few wasted steps; their lengths stay right); every step on CPU, where it is free
        self.check_every = 16 if self.device.type == "cuda" else 1
        # transformers 5.24 renamed past_key_values -> cache (the old name warns and goes in 5.40);
        # older releases only know past_key_values. The output attribute follows the same name.
        sig = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in sig else "past_key_values"
        self._keep_last = {"logits_to_keep": 1} if "logits_to_keep" in sig else {}
        self._fp8 = None  # engine.weights_dtype fp8 / int4 / mxfp8: quantized linear weights (fp8.py, lowp.py)
        if cfg.weights_dtype == "fp8":
            from .fp8 import FP8Weights, convert, scaled_mm_supported

            gemm = cfg.fp8_gemm
            if gemm == "auto":
                gemm = "scaled_mm" if scaled_mm_supported(self.device) else "dequantized"
            elif gemm == "scaled_mm" and not scaled_mm_supported(self.device):
                raise MilesError(f"engine.fp8_gemm=scaled_mm needs FP8 GEMMs (torch._scaled_mm on CPU, or a "
                                 f"CUDA GPU of compute capability >= 8.9); {self.device} has none: use auto")
            self._fp8 = FP8Weights(convert(self.model, gemm))
        elif cfg.weights_dtype in ("int4", "mxfp8"):  # lowp.py: the same divert() as FP8 weights
            from .lowp import convert as convert_lowp

            self._fp8 = convert_lowp(self.model, cfg.weights_dtype, cfg.quant_scope)
        self._targets = dict(self.model.named_parameters(remove_duplicate=False))
        self._targets.update(self.model.named_buffers(remove_duplicate=False))
        # Llama-family models on CUDA or CPU float32 (or engine.impl=fast) take the fast path (batching.py)
        from .batching import select_fast_path

        self._fast = select_fast_path(cfg, self.model, self.device) if self._fp8 is None else None
        self._spec = None  # engine.speculative: drafted steps the model verifies (speculative.py)
        self._mtp = None  # draft mtp: on the model's own forward, its MTP layer drafting (hf_speculative.py)
        self._gate = None  # engine.speculative.min_accept_len: drafts only while they pay
        if cfg.speculative is not None:
            from .speculative import AcceptanceGate

            self._gate = AcceptanceGate.for_config(cfg.speculative, self.device)
        if cfg.speculative is not None and cfg.speculative.draft == "mtp":
            from .hf_speculative import setup_mtp

            self._mtp = setup_mtp(cfg, self.model, spec, self._cache_kw)
        elif cfg.speculative is not None:
            from .speculative import setup

            self._spec = setup(cfg, self.model, self._fast)
            self._targets.update(self.model.named_parameters(remove_duplicate=False))  # the draft head's
            self._targets.update(self.model.named_buffers(remove_duplicate=False))  # its draft vocabulary
        # an MoE spec with routing replay: completions carry the experts each token was routed to
        from .routing import RoutingLog

        self._routing = RoutingLog.for_spec(spec, self.model)
        if self._routing is not None and self._fast is not None:
            raise ValueError("torch engine: routing replay needs the model's own forward; set engine.impl=hf")
        # an architecture whose layers do not mask left padding (e.g. token compression by absolute
        # position) batches only prompts of equal length on the per-call path, which need no
        # padding at all (its own slot layers prefill them right-padded instead)
        from miles.protocols import KnowsArchitecture, OffersEngineAttention, OffersSlotLayers, RecordsGraphReplays

        arch = spec.architecture() if isinstance(spec, KnowsArchitecture) else None
        self._equal_lengths = arch is not None and not arch.padded_batches
        if isinstance(arch, OffersEngineAttention):  # e.g. MLA decoding over its cached latent
            arch.engine_attention(self.model)
        if self._equal_lengths and self._fast is not None:
            raise ValueError("torch engine: this architecture runs the model's own forward; set engine.impl=hf")
        # the model's own forward under the fast path's scheduler (hf_slots.py): continuous batching
        # and, on CUDA, graphs, for every architecture whose cache layers live in preallocated rows.
        # Speculative decoding keeps the per-call path below, as does CPU in half precision (the
        # growing cache: HF's own op order, which the trainer matches).
        exact = self.device.type == "cuda" or _DTYPES[cfg.dtype] == torch.float32
        own = isinstance(arch, OffersSlotLayers)  # e.g. DeepSeek-V4 holding its compressed attention's rows
        if self._fast is None and cfg.speculative is None and (own or not self._equal_lengths) and exact:
            from .hf_slots import slot_generator

            recorder = None if self._routing is None else self._routing.recorder
            self._fast = slot_generator(cfg, self.model, self._cache_kw, recorder, arch)
        # otherwise, the model's own forward on CUDA decodes over a static cache, its step replayed
        # from a CUDA graph (hf_graphs.py), routing records copied out of the graph after each
        # replay; MTP drafts run eagerly over the growing cache
        self._static = (cfg.cuda_graphs and self.device.type == "cuda" and self._fast is None
                        and (self._routing is None or isinstance(self._routing.recorder, RecordsGraphReplays))
                        and static_layers(self.model))
        self._p2p: Any = None
        # the model's own forward path's load (the fast paths keep their own: FastGenerator.load):
        # rows of the chunk generating, rows of the call waiting, tokens of the chunks done
        self._hf_running = self._hf_queued = self._hf_tokens = 0

    def p2p_state(self) -> Any:
        """What the ``p2p`` transport keeps on this engine between its calls (``p2p.P2PState``)."""
        if self._p2p is None:
            from .p2p import P2PState

            self._p2p = P2PState()
        return self._p2p

    def engine_stats(self) -> list[dict[str, Any]]:
        """This engine's load (``miles.protocols.EngineStats``): sequences decoding and waiting for a
        cache row, the share of the fast path's KV cache (rows x length, allocated once) their
        positions hold, tokens generated so far, and the speculative acceptance of the last call.
        Plain numbers the generating thread keeps: no lock, no device sync."""
        running, queued, tokens = self._hf_running, self._hf_queued, self._hf_tokens
        used = cap = 0
        for g in (self._fast, self._spec):
            if g is not None:
                r, q, u, c = g.load()
                running, queued, used, cap = running + r, queued + q, used + u, max(cap, c)  # one shared cache
                tokens += g.generated_tokens
        out: dict[str, Any] = {"name": f"torch ({self.device})", "running": running, "queued": queued,
                               "generated_tokens": tokens}
        if cap:
            out["kv_cache_usage"] = min(used / cap, 1.0)
        for g in (self._spec, self._mtp):
            if g is not None and g.accept_rate is not None:
                out["spec_accept_rate"] = g.accept_rate
        return [out]

    def step_metrics(self) -> dict[str, float]:
        """Speculative decoding's acceptance since the last call (``miles.protocols.EngineStepMetrics``)."""
        g = self._spec if self._spec is not None else self._mtp
        return g.drain() if g is not None else {}

    # -- weights ---------------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        if self._fp8 is not None:
            named_tensors = self._fp8.divert(named_tensors)
        for name, tensor in named_tensors:
            dst = self._targets.get(name)
            if dst is None:
                raise ValueError(f"torch engine: the model has no parameter or buffer named {name!r}")
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"torch engine: {name!r} has shape {tuple(dst.shape)}, "
                                 f"got {tuple(tensor.shape)}")
            dst.copy_(tensor)  # casts dtype/device; tied names share storage, so both are fine
        self.weight_version = version

    # -- generation ------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 n: int = 1) -> list[list[Completion]]:
        if any(len(p) == 0 for p in prompts):
            raise ValueError("torch engine: empty prompt (need at least one token, e.g. BOS)")
        gen = self._gen
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
        stop = set(params.stop_token_ids) | ({self.eos_id} if self.eos_id is not None else set())
        if self._fast is not None:
            drafts = self._spec is not None and len(prompts) * n <= self._spec.max_batch and self._gate.allows()
            out = (self._spec if drafts else self._fast).generate(prompts, params, n, gen, sorted(stop),
                                                                  self.weight_version, self.interrupt, self.dropped)
            if drafts:
                self._gate.record(self._spec.accept_rate)
            return out
        stop_t = torch.tensor(sorted(stop), dtype=torch.long, device=self.device)
        out: list[list[Completion]] = [[] for _ in prompts]
        mtp = self._mtp is not None and len(prompts) * n <= self._mtp.max_batch and self._gate.allows()
        self._hf_queued = len(prompts) * n
        try:
            for idx, reps in self._chunks([len(p) for p in prompts], n):
                chunk = [prompts[i] for i in idx]
                self._hf_running = len(chunk) * reps
                self._hf_queued -= self._hf_running
                if self._routing is None:
                    comps = (self._generate_mtp if mtp else self._generate_chunk)(chunk, reps, params, gen, stop_t)
                elif mtp:  # the verify blocks' rejected positions stay out of the record
                    comps = self._routing.run_verified(self._generate_mtp, chunk, reps, params, gen, stop_t)
                else:
                    comps = self._routing.run(self._generate_chunk, chunk, reps, params, gen, stop_t)
                self._hf_tokens += sum(len(c.token_ids) for c in comps)
                for j, i in enumerate(idx):
                    out[i].extend(comps[j * reps:(j + 1) * reps])
        finally:
            self._hf_running = self._hf_queued = 0
        if mtp:
            self._gate.record(self._mtp.accept_rate)
        return out

    def _chunks(self, lengths: Sequence[int], n: int) -> Iterator[tuple[list[int], int]]:
        """(prompt indices, samples per prompt) so that each chunk holds <= max_batch_size rows;
        where padding is not exact, each chunk's prompts have one length (in order of first
        appearance), so every row of a forward is unpadded and they decode in lock step."""
        mbs = self.cfg.max_batch_size
        if n > mbs:
            for i in range(len(lengths)):
                for s in range(0, n, mbs):
                    yield [i], min(mbs, n - s)
            return
        groups: dict[int, list[int]] = {}
        for i, length in enumerate(lengths):
            groups.setdefault(length if self._equal_lengths else 0, []).append(i)
        per = mbs // n
        for idx in groups.values():
            for s in range(0, len(idx), per):
                yield idx[s:s + per], n

    def _forward(self, ids, mask, pos, cache=None, **kw):
        return self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                          **({self._cache_kw: cache} if cache is not None else {}), **kw)

    def _generate_chunk(self, prompts, n: int, params: SamplingParams, gen: torch.Generator,
                        stop: torch.Tensor) -> list[Completion]:
        """``n`` completions per prompt (adjacent): one prefill per prompt, then 1-token decodes."""
        steps = params.max_new_tokens
        if steps <= 0 or self.interrupt.is_set():
            reason = "abort" if steps > 0 else "length"
            return [Completion([], [], reason, self.weight_version) for _ in range(len(prompts) * n)]
        ids, mask = _left_pad(prompts, self.pad_id, self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        # prompts of one length pad nothing: without a mask transformers' mask builders skip the
        # host read of whether every mask entry is 1, once per forward (as generate drops an all-ones mask)
        padded = len({len(p) for p in prompts}) > 1
        rows, width = ids.shape[0] * n, ids.shape[1]
        static = self._static and steps >= MIN_STEPS
        out = self._forward(ids, mask if padded else None, pos,
                            static_cache(self.model, width + steps) if static else None, **self._keep_last)
        cache = _repeat_cache(getattr(out, self._cache_kw), n, ids.shape[0], self.device)
        logits = out.logits[:, -1].repeat_interleave(n, dim=0)
        full_mask = None
        if padded:  # the mask only ever grows by ones, so preallocate it and hand the model a growing view
            full_mask = mask.new_ones((rows, width + steps))
            full_mask[:, :width] = mask.repeat_interleave(n, dim=0)
        pos = pos[:, -1:].repeat_interleave(n, dim=0)
        graph = None
        if static:  # a static cache spans every position: the whole mask, from one fixed buffer
            graph = GraphStep(lambda tok, pos: self._forward(tok, full_mask, pos, cache).logits[:, -1],
                              None if self._routing is None else self._routing.recorder)
        tokens = torch.empty((rows, steps), dtype=torch.long, device=self.device)
        logps = torch.empty((rows, steps), dtype=torch.float32, device=self.device)
        lengths = torch.zeros(rows, dtype=torch.long, device=self.device)
        done = torch.zeros(rows, dtype=torch.bool, device=self.device)
        aborted = False
        for t in range(steps):
            tok, lp = _sample(logits, params, gen)
            tokens[:, t], logps[:, t] = tok, lp
            lengths += ~done
            done |= torch.isin(tok, stop)
            if t + 1 == steps or ((t + 1) % self.check_every == 0 and bool(done.all())):
                break
            if self.interrupt.is_set():
                aborted = True
                break
            pos = pos + 1
            if graph is not None:
                logits = graph(tok[:, None], pos)
                continue
            out = self._forward(tok[:, None], None if full_mask is None else full_mask[:, :width + t + 1], pos, cache)
            logits = out.logits[:, -1]
        return self._completions(tokens[:, :t + 1], logps[:, :t + 1], lengths, done, aborted)

    def _generate_mtp(self, prompts, n: int, params: SamplingParams, gen: torch.Generator,
                      stop: torch.Tensor, kept: list | None = None) -> list[Completion]:
        """``_generate_chunk`` with the MTP layer's drafts verified by the model (hf_speculative.py);
        ``kept``: ``MTPGenerator.generate``'s."""
        if params.max_new_tokens <= 0 or self.interrupt.is_set():
            return self._generate_chunk(prompts, n, params, gen, stop)
        from .spec_meta import EXTRAS_KEY

        rows, counts = self._mtp.generate(prompts, n, params, gen, stop, self.pad_id, self.interrupt, kept)
        comps = self._completions(*rows)
        for c, spec in zip(comps, counts):
            c.extras[EXTRAS_KEY] = spec
        return comps

    def _completions(self, tokens, logps, lengths, done, aborted: bool) -> list[Completion]:
        tokens, logps = tokens.cpu().tolist(), logps.cpu().tolist()
        lengths, done = lengths.cpu().tolist(), done.cpu().tolist()
        v, unfinished = self.weight_version, "abort" if aborted else "length"
        return [Completion(tok[:k], lp[:k], "stop" if d else unfinished, v)
                for tok, lp, k, d in zip(tokens, logps, lengths, done)]

    # -- scoring ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def score(self, batch: Any, logprob_fn: Any) -> torch.Tensor:
        """``[B, R]`` log-probs of a training batch's response tokens under this engine's weights,
        by ``logprob_fn(model, batch)`` (true on-policy: the trainer's own routine, on the
        identically shaped batch, so both sides compute the same numbers bit for bit)."""
        return logprob_fn(self.model, batch.to(self.device)).float().cpu()

    @torch.inference_mode()
    def logprobs(self, prompts: Sequence[Sequence[int]],
                 responses: Sequence[Sequence[int]]) -> list[list[float]]:
        """Log-prob (temperature 1) of each response token given its prompt, one forward per
        ``max_batch_size`` pairs of any lengths."""
        mbs = self.cfg.max_batch_size
        return [lp for s in range(0, len(prompts), mbs) for lp in self._score(prompts[s:s + mbs], responses[s:s + mbs])]

    def _score(self, prompts, responses) -> list[list[float]]:
        """Each ``prompt + response`` right-padded from position 0: exact for every causal model (a
        row's padding comes after all its tokens), also those that do not mask left padding."""
        seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
        width = max(len(q) for q in seqs)
        ids = torch.tensor([q + [self.pad_id] * (width - len(q)) for q in seqs], device=self.device)
        logits = self.model(input_ids=ids, use_cache=False).logits[:, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1).cpu().tolist()
        return [row[len(p) - 1:len(p) - 1 + len(r)] for row, p, r in zip(lp, prompts, responses)]
