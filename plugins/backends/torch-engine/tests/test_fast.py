"""The fast path (engine.impl=fast: own Llama-family forward, preallocated KV cache, continuous
batching) against the model's own full forward and the generic engine path, on CPU in float32;
one gpu-marked test checks it on CUDA (graphs, bf16) against HF's forward."""
import pytest
import torch
from miles import ConfigError, SamplingParams
from miles.testing import TinySpec, char_tokenizer
from miles_fastpath import cpu_gemm

from miles_plugin_torch_engine.hf_slots import SlotGenerator
from miles_plugin_torch_engine.config import TorchEngineConfig
from miles_plugin_torch_engine.engine import TorchEngine
from miles_plugin_torch_engine.fast import unsupported_reason

# lengths 7, 2, 4, 5, 10, 2: prefill pads, and rows sit at different positions while decoding
PROMPTS = [[2, 5, 6, 7, 8, 9, 10], [2, 11], [2, 12, 13, 14], [2, 15, 16, 17, 18],
           [2, 19, 20, 21, 22, 23, 24, 25, 26, 27], [2, 30]]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls gain nothing from threads on a shared machine
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def lively_weights(model, seed):
    """Random weights with large layer outputs, so greedy decoding does not just repeat a token."""
    g = torch.Generator().manual_seed(seed)
    return [(name, torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5 * (1 if "embed" in name else 3))
            for name, p in model.named_parameters() if p.dim() == 2]


class ArchSpec(TinySpec):
    """TinySpec for another architecture: ``<arch>Config`` / ``<arch><head>`` with extra kwargs."""

    def __init__(self, arch: str, head: str = "ForCausalLM", **extra):
        super().__init__()
        self.arch, self.head, self.extra = arch, head, extra

    def build_model(self, tokenizer):
        import transformers

        torch.manual_seed(self.seed)
        ids = {k: getattr(tokenizer, k) for k in ("pad_token_id", "eos_token_id", "bos_token_id")}
        cfg = getattr(transformers, f"{self.arch}Config")(
            vocab_size=len(tokenizer), max_position_embeddings=128, tie_word_embeddings=False,
            **ids, **self.kw, **self.extra)
        return getattr(transformers, f"{self.arch}{self.head}")(cfg).eval()


def make_engine(tok, spec=None, seed=0, weights_seed=0, device="cpu", **cfg):
    cfg.setdefault("impl", "fast")
    eng = TorchEngine(TorchEngineConfig(device=device, **cfg), spec=spec or TinySpec(), tokenizer=tok, seed=seed)
    eng.load_weights(lively_weights(eng.model, weights_seed), version=1)
    return eng


def full_logprobs(model, prompt, response, temperature=1.0):
    """Reference: one unpadded forward over prompt+response, no cache."""
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response], device=device)).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1:-1] / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(response, device=device)[:, None]).squeeze(-1).cpu()


def greedy_reference(model, prompt, steps, stop):
    """Reference greedy decode that re-runs the whole sequence every step."""
    device, seq = next(model.parameters()).device, list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            nxt = int(model(input_ids=torch.tensor([seq], device=device)).logits[0, -1].argmax())
            seq.append(nxt)
            if nxt in stop:
                break
    return seq[len(prompt):]


def tokens(groups):
    return [[c.token_ids for c in g] for g in groups]


def assert_logprobs_exact(model, prompts, groups, temperature=1.0, atol=1e-5):
    for prompt, group in zip(prompts, groups):
        for c in group:
            assert len(c.logprobs) == len(c.token_ids)
            torch.testing.assert_close(torch.tensor(c.logprobs),
                                       full_logprobs(model, prompt, c.token_ids, temperature), atol=atol, rtol=0)


def test_selection_and_fallback(tok):
    assert make_engine(tok, impl="auto")._fast is not None  # CPU float32: the fast path is the default
    assert make_engine(tok, impl="auto", dtype="bfloat16")._fast is None  # CPU half precision: HF's
    # the model's own forward runs under the same scheduler (hf_slots.py)
    assert isinstance(make_engine(tok, impl="hf")._fast, SlotGenerator)
    assert make_engine(tok)._fast is not None
    gpt2 = ArchSpec("GPT2", head="LMHeadModel")
    gpt2.kw = dict(n_embd=32, n_layer=2, n_head=4)
    assert isinstance(make_engine(tok, spec=gpt2, impl="auto")._fast, SlotGenerator)
    with pytest.raises(ConfigError, match="engine.impl=fast.*GPT2LMHeadModel"):
        make_engine(tok, spec=gpt2)
    model = TinySpec().build_model(tok)
    assert unsupported_reason(model) is None

    class Wrapped(torch.nn.Linear):  # e.g. a LoRA layer: its extra path must not be skipped
        pass

    old = model.model.layers[1].mlp.up_proj
    model.model.layers[1].mlp.up_proj = Wrapped(old.in_features, old.out_features, bias=False)
    assert "layers.1.mlp.up_proj is Wrapped" in unsupported_reason(model)


def test_greedy_matches_reference_and_generic_path(tok):
    fast, generic = make_engine(tok), make_engine(tok, impl="hf")
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    groups = fast.generate(PROMPTS, params, n=2)
    assert tokens(groups) == tokens(generic.generate(PROMPTS, params, n=2))
    for prompt, group in zip(PROMPTS, groups):
        ref = greedy_reference(fast.model, prompt, 8, {tok.eos_token_id})
        assert [c.token_ids for c in group] == [ref, ref]
    assert_logprobs_exact(fast.model, PROMPTS, groups)
    assert fast._fast.stats["prefilled_prompts"] == len(PROMPTS)  # once per group of n samples


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 1.0, 0), (0.7, 0.9, 5)])
def test_sampled_logprobs_match_full_forward(tok, temperature, top_p, top_k):
    eng = make_engine(tok)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=6, seed=1)
    groups = eng.generate(PROMPTS, params, n=3)
    assert [len(g) for g in groups] == [3] * len(PROMPTS)
    assert_logprobs_exact(eng.model, PROMPTS, groups, temperature)
    assert len({tuple(c.token_ids) for g in groups for c in g}) > len(PROMPTS)  # samples differ


def test_stop_tokens_and_continuous_batching(tok):
    """Rows that stop free their slots for waiting groups; results do not depend on the slot count."""
    params = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=[28, 42])
    stop = {28, 42, tok.eos_token_id}
    generic = make_engine(tok, impl="hf").generate(PROMPTS, params, n=2)
    deferred = make_engine(tok, impl="hf")
    deferred.check_every = 3  # as on CUDA: stopped rows decode on until the host looks
    later = deferred.generate(PROMPTS, params, n=2)
    assert tokens(later) == tokens(generic)
    assert [[(c.finish_reason, c.logprobs) for c in g] for g in later] == \
        [[(c.finish_reason, c.logprobs) for c in g] for g in generic]
    for slots in (3, 5, 64):
        eng = make_engine(tok, max_batch_size=slots)
        groups = eng.generate(PROMPTS, params, n=2)
        assert tokens(groups) == tokens(generic)
        assert [[c.finish_reason for c in g] for g in groups] == [[c.finish_reason for c in g] for g in generic]
        for prompt, g in zip(PROMPTS, groups):
            assert g[0].token_ids == greedy_reference(eng.model, prompt, 8, stop)
        assert_logprobs_exact(eng.model, PROMPTS, groups)
        stats = eng._fast.stats
        assert stats["max_rows"] <= slots and stats["prefilled_prompts"] == len(PROMPTS)
        if slots == 5:  # two groups of 2 fit: one joins as soon as an earlier group stops
            assert stats["joined_mid_decode"] > 0
    reasons = [c.finish_reason for g in generic for c in g]
    assert "stop" in reasons and "length" in reasons  # precondition: both kinds of ending occur
    assert generic[0][0].token_ids == [28]  # prompt 0 stops at once ...


def test_stopped_row_frees_its_slot_for_a_waiting_prompt(tok):
    # two slots; the second prompt stops at its first token (28), so the third joins at once and
    # runs beside the first: all three finish in the decode steps of one full-length sequence
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[2]]
    eng = make_engine(tok, max_batch_size=2)
    groups = eng.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=[28]))
    assert [len(g[0].token_ids) for g in groups] == [8, 1, 8]
    assert [g[0].finish_reason for g in groups] == ["length", "stop", "length"]
    assert eng._fast.stats["decode_steps"] == 7 and eng._fast.stats["joined_mid_decode"] == 1
    assert_logprobs_exact(eng.model, prompts, groups)


def test_groups_larger_than_the_batch_and_sampling_reproducible(tok):
    eng = make_engine(tok, max_batch_size=2)
    params = SamplingParams(max_new_tokens=5, seed=3)
    groups = eng.generate(PROMPTS[:3], params, n=5)  # each group of 5 is split into 2 + 2 + 1 rows
    assert [len(g) for g in groups] == [5, 5, 5]
    assert eng._fast.stats["prefilled_prompts"] == 9
    assert_logprobs_exact(eng.model, PROMPTS[:3], groups)
    assert tokens(eng.generate(PROMPTS[:3], params, n=5)) == tokens(groups)
    other = tokens(eng.generate(PROMPTS[:3], SamplingParams(max_new_tokens=5, seed=4), n=5))
    assert other != tokens(groups)
    greedy = tokens(eng.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=6), n=2))
    assert tokens(eng.generate(PROMPTS, SamplingParams(top_k=1, max_new_tokens=6, seed=9), n=2)) == greedy
    assert eng.generate(PROMPTS, SamplingParams(max_new_tokens=0), n=2)[0] == [
        type(groups[0][0])([], [], "length", 1)] * 2


def test_new_weights_and_cache_growth(tok):
    eng = make_engine(tok)
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    before = tokens(eng.generate(PROMPTS, params))
    eng.load_weights(lively_weights(eng.model, seed=1), version=2)  # in place: fused copies refresh
    after = eng.generate(PROMPTS, params)
    assert tokens(after) != before and all(c.weight_version == 2 for g in after for c in g)
    assert tokens(after) == tokens(make_engine(tok, weights_seed=1, impl="hf").generate(PROMPTS, params))
    for name, new in lively_weights(eng.model, seed=2):  # storage swapped, as zero-copy loads do
        eng.model.get_parameter(name).data = new
    swapped = tokens(eng.generate(PROMPTS, params))
    assert swapped == tokens(make_engine(tok, weights_seed=2, impl="hf").generate(PROMPTS, params))
    small = eng._fast.fwd.max_len
    longer = eng.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=30))
    assert eng._fast.fwd.max_len > small  # the cache grew for the longer request
    assert_logprobs_exact(eng.model, PROMPTS, longer)
    with pytest.raises(ConfigError, match="engine.max_seq_len=12"):
        make_engine(tok, max_seq_len=12).generate(PROMPTS, SamplingParams(max_new_tokens=4))


@pytest.mark.parametrize("layers,table", [(2, True), (2, False), (1, True)])
def test_cpu_steps_one_position_and_no_token_table(tok, monkeypatch, layers, table):
    """Prompts of one length keep every row at one position (slice cache writes, no mask); layer
    0's per-token q|k|v table is skipped for large vocabularies; a 1-layer model's last prefill
    layer is also its tabled first one."""
    from miles_plugin_torch_engine import cpu_decode

    if not table:
        monkeypatch.setattr(cpu_decode, "TABLE_ELEMENTS", 0)
    eng = make_engine(tok, spec=TinySpec(hidden=64, layers=layers))
    prompts = [p[:2] for p in PROMPTS]
    groups = eng.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=6), n=2)
    assert (eng._fast.cpu.layers[0].table is not None) == table
    for prompt, g in zip(prompts, groups):
        assert g[0].token_ids == g[1].token_ids == greedy_reference(eng.model, prompt, 6, {tok.eos_token_id})
    assert_logprobs_exact(eng.model, prompts, groups)


def test_cpu_prefill_in_chunks(tok, monkeypatch):
    """Prompts prefilled in chunks (here one prompt each, padded to its own length) give the
    same tokens as one prefill and log-probs as close to the full forward."""
    from miles_plugin_torch_engine import cpu_decode

    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    whole = make_engine(tok).generate(PROMPTS, params, n=2)
    monkeypatch.setattr(cpu_decode, "PREFILL_ELEMENTS", 1)
    eng = make_engine(tok)
    groups = eng.generate(PROMPTS, params, n=2)
    assert tokens(groups) == tokens(whole)
    assert_logprobs_exact(eng.model, PROMPTS, groups)


def test_cpu_dim_major_keys(tok, monkeypatch):
    """Long caches store keys dim-major behind a transposed view (here every cache): the same
    tokens as position-major keys and log-probs as close to the full forward, through both cache
    write paths (rows at one position; rows at different ones), stops that move rows, and workers."""
    from miles_plugin_torch_engine import cpu_decode, fast

    monkeypatch.setattr(cpu_decode, "SLICE_MACS", 0)
    stop = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=[28, 42])
    sampled = SamplingParams(max_new_tokens=6, seed=2)
    cases = [(PROMPTS, stop), ([p[:2] for p in PROMPTS], stop), (PROMPTS, sampled)]

    def run(workers):
        eng = make_engine(tok, max_batch_size=24, cpu_workers=workers)
        return eng, [eng.generate(prompts, params, n=4) for prompts, params in cases]

    position_major = {w: run(w) for w in (1, 2)}
    monkeypatch.setattr(fast, "DIM_MAJOR_KEYS", 0)
    for w, (eng_pm, want) in position_major.items():
        eng, got = run(w)
        assert eng._fast.fwd.k_cache.stride(-1) != 1 and eng_pm._fast.fwd.k_cache.stride(-1) == 1
        assert [tokens(g) for g in got] == [tokens(g) for g in want]
        for (prompts, params), groups in zip(cases, got):
            assert_logprobs_exact(eng.model, prompts, groups, params.temperature or 1.0)


# each layout where this torch build has its library (MKL's packed GEMM on x86 builds, oneDNN's linear)
LAYOUTS = ["in_out"] + ["mkl_packed"] * (torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")) \
    + ["onednn"] * cpu_gemm.onednn_available()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cpu_weight_layouts(tok, monkeypatch, layout):
    """Every way the CPU steps hold weights (oneDNN-packed, ``engine.cpu_gemm`` auto's choice on AMD
    CPUs; MKL-packed, its choice on Intel CPUs; else ``[in, out]`` copies): greedy tokens equal the
    uncached reference and log-probs the full forward's, through prefill (with its last-layer
    shortcut), decode, biases and 2 workers."""
    from miles_plugin_torch_engine import cpu_decode

    monkeypatch.setattr(cpu_decode, "MKL_PACKED", layout == "mkl_packed")
    monkeypatch.setattr(cpu_decode, "PACK_ELEMENTS", 0)  # the tiny test model's layers too
    monkeypatch.setattr(cpu_decode, "SLICE_MACS", 0)
    stop = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=[28, 42])
    for workers in (1, 2):
        eng = make_engine(tok, max_batch_size=24, cpu_workers=workers,
                          cpu_gemm="onednn" if layout == "onednn" else "mkl")
        groups = eng.generate(PROMPTS, stop, n=2)
        assert {w.layout for w in vars(eng._fast.cpu.layers[0]).values() if isinstance(w, cpu_decode._Weight)} \
            == {layout}
        for prompt, g in zip(PROMPTS, groups):
            assert all(c.token_ids == greedy_reference(eng.model, prompt, 8, {28, 42, tok.eos_token_id}) for c in g)
        assert_logprobs_exact(eng.model, PROMPTS, groups)


def test_cpu_gemm_choice(tok, monkeypatch):
    """auto: oneDNN on AMD CPUs only (where torch has it), for layers of ONEDNN_MIN_LAYER weights
    (this tiny model's are smaller); asking for oneDNN where torch has none is a config error
    naming the key."""
    from miles_plugin_torch_engine import cpu_decode

    monkeypatch.setattr(cpu_gemm, "cpu_vendor", lambda: "AuthenticAMD")
    assert make_engine(tok)._fast.cpu.gemm == "mkl"
    monkeypatch.setattr(cpu_gemm, "ONEDNN_MIN_LAYER", 1)
    want = "onednn" if cpu_gemm.onednn_available() else "mkl"
    assert make_engine(tok)._fast.cpu.gemm == want
    monkeypatch.setattr(cpu_gemm, "cpu_vendor", lambda: "GenuineIntel")
    assert make_engine(tok)._fast.cpu.gemm == "mkl"
    monkeypatch.setattr(cpu_gemm, "onednn_available", lambda: False)
    with pytest.raises(ConfigError, match="engine.cpu_gemm=onednn"):
        make_engine(tok, cpu_gemm="onednn")
    assert cpu_decode.layout("mkl", 1 << 30) in ("in_out", "mkl_packed")


def test_cpu_workers(tok, monkeypatch):
    """Decode steps and prefill split among 2 single-threaded worker threads: the same tokens as
    one thread (greedy: the uncached reference), log-probs as close to the full forward, while
    rows stop, leave and join at different positions."""
    from miles_plugin_torch_engine import cpu_decode

    monkeypatch.setattr(cpu_decode, "SLICE_MACS", 0)  # split this tiny model's steps too (8 rows a worker)
    stop = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=[28, 42])
    sampled = SamplingParams(max_new_tokens=6, seed=2)
    one, two = make_engine(tok, max_batch_size=40), make_engine(tok, max_batch_size=40, cpu_workers=2)
    for params in (stop, sampled):
        groups = two.generate(PROMPTS, params, n=8)
        assert two._fast.workers is not None and (params is sampled or two._fast.stats["joined_mid_decode"])
        assert tokens(groups) == tokens(one.generate(PROMPTS, params, n=8))
        assert_logprobs_exact(two.model, PROMPTS, groups, params.temperature or 1.0)
    for prompt, g in zip(PROMPTS, two.generate(PROMPTS, stop, n=8)):
        assert all(c.token_ids == greedy_reference(two.model, prompt, 8, {28, 42, tok.eos_token_id}) for c in g)


@pytest.mark.parametrize("slice_macs,split", [(0, True), (None, False)])
def test_cpu_workers_split_only_big_slices(tok, monkeypatch, slice_macs, split):
    """A decode step goes to the workers only when each one's share of a layer's GEMMs reaches
    ``SLICE_MACS`` multiply-adds: the tiny test model's 40 rows stay on one thread by default."""
    from miles_plugin_torch_engine import cpu_decode

    if slice_macs is not None:
        monkeypatch.setattr(cpu_decode, "SLICE_MACS", slice_macs)
    eng = make_engine(tok, max_batch_size=40, cpu_workers=2)
    cpu, firsts = eng._fast.cpu, []
    real = cpu.decode
    cpu.decode = lambda *a, **kw: firsts.append(kw.get("first", a[5] if len(a) > 5 else 0)) or real(*a, **kw)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    groups = eng.generate(PROMPTS, params, n=8)
    layer = cpu.layers[0]
    weights = sum(w.rows.numel() for w in (layer.wqkv, layer.wo, layer.wgu, layer.wd))
    assert cpu.min_slice_rows == max(8, -(-cpu_decode.SLICE_MACS // weights))
    second_slices = sum(f > 0 for f in firsts)  # a split step decodes its second slice from a row > 0
    assert firsts and ((second_slices >= 5) if split else (second_slices == 0))
    assert tokens(groups) == tokens(make_engine(tok, max_batch_size=40).generate(PROMPTS, params, n=8))


@pytest.mark.parametrize("arch,extra", [("Llama", dict(rope_theta=500000.0)),
                                        ("Qwen3", dict(head_dim=16)),  # q/k norms, wide heads
                                        ("Mistral", dict(sliding_window=None))])
def test_other_llama_family_models(tok, arch, extra):
    eng = make_engine(tok, spec=ArchSpec(arch, **extra))
    groups = eng.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=6), n=2)
    for prompt, g in zip(PROMPTS, groups):
        assert g[0].token_ids == g[1].token_ids == greedy_reference(eng.model, prompt, 6, {tok.eos_token_id})
    assert_logprobs_exact(eng.model, PROMPTS, groups)


@pytest.mark.parametrize("top_k,top_p,allowed", [(0, 1.0, 5), (2, 1.0, 2), (0, 0.7, 3)])
def test_device_sampler_distribution(top_k, top_p, allowed):
    from miles_plugin_torch_engine.sampling import sample

    probs = torch.tensor([0.4, 0.25, 0.15, 0.12, 0.08])
    logits = (probs.log() + 3.0).expand(40000, -1)  # an unnormalised shift must not matter
    tok, lp = sample(logits, SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p),
                     torch.Generator().manual_seed(0))
    torch.testing.assert_close(lp, probs.log()[tok])
    want = torch.zeros(5)
    want[:allowed] = probs[:allowed] / probs[:allowed].sum()
    freq = torch.bincount(tok, minlength=5).float() / len(tok)
    torch.testing.assert_close(freq, want, atol=0.01, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_gpu_fused_sampler(temperature):
    """The Triton sampler on CUDA (one read of the logits): tokens drawn from softmax(logits / T)
    across vocabulary blocks, the log-prob of each under it, greedy = argmax, reproducible."""
    from miles_plugin_torch_engine import triton_ops
    from miles_plugin_torch_engine.sampling import sample

    assert triton_ops.available()
    V, where = 10_000, torch.tensor([3, 4100, 8200, 9000, 9999])  # spread over three blocks
    probs = torch.tensor([0.4, 0.25, 0.15, 0.12, 0.08])
    logits = torch.full((V,), -30.0)
    logits[where] = probs.log() + 3.0
    logits = logits.expand(40000, -1).to("cuda", torch.bfloat16)
    params = SamplingParams(temperature=temperature)
    tok, lp = sample(logits, params, torch.Generator("cuda").manual_seed(0))
    want_lp = torch.log_softmax(logits.float() / (temperature or 1.0), dim=-1).gather(-1, tok[:, None]).squeeze(-1)
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=0)
    if temperature == 0.0:
        assert (tok == logits.float().argmax(-1)).all()
        return
    q = torch.softmax(logits[0].float().cpu() / temperature, -1)[where]
    freq = (tok.cpu()[:, None] == where).float().mean(0)
    torch.testing.assert_close(freq, q / q.sum(), atol=0.01, rtol=0)
    again, _ = sample(logits, params, torch.Generator("cuda").manual_seed(0))
    assert torch.equal(tok, again)


@pytest.mark.gpu
def test_gpu_fast_path_matches_hf_forward(tok):
    """On CUDA: float32 greedy equals the uncached reference (graphs, continuous batching); bf16
    log-probs stay as close to HF's bf16 forward as that forward is to float32."""
    spec = TinySpec(hidden=64, layers=3, heads=4, kv_heads=2)
    eng = make_engine(tok, spec=spec, device="cuda", impl="auto", max_batch_size=5)
    assert eng._fast is not None
    params = SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=[28])
    groups = eng.generate(PROMPTS, params, n=2)
    for prompt, g in zip(PROMPTS, groups):
        ref = greedy_reference(eng.model, prompt, 10, {28, tok.eos_token_id})
        assert [c.token_ids for c in g] == [ref, ref]
    assert_logprobs_exact(eng.model, PROMPTS, groups, atol=1e-4)
    assert eng._fast.runner._graphs and eng._fast.stats["joined_mid_decode"] > 0
    assert eng._fast.fwd.use_triton  # the fused kernels are what ran
    small = eng._fast.fwd.max_len  # a longer request grows the cache (128-position steps on
    # CUDA): the graphs are captured anew, in a new pool
    longer = eng.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=130), n=2)
    assert eng._fast.fwd.max_len > small and eng._fast.runner._graphs
    assert_logprobs_exact(eng.model, PROMPTS, longer, atol=1e-4)

    bf16 = make_engine(tok, spec=spec, device="cuda", dtype="bfloat16")
    groups = bf16.generate(PROMPTS, SamplingParams(max_new_tokens=12, seed=0), n=4)
    fp32 = TinySpec(hidden=64, layers=3, heads=4, kv_heads=2).build_model(tok).cuda()
    fp32.load_state_dict(bf16.model.state_dict())
    fast_err, hf_err = [], []
    for prompt, g in zip(PROMPTS, groups):
        for c in g:
            hf_bf16 = full_logprobs(bf16.model, prompt, c.token_ids)
            fast_err.append((torch.tensor(c.logprobs) - hf_bf16).abs())
            hf_err.append((hf_bf16 - full_logprobs(fp32, prompt, c.token_ids)).abs())
    fast_err, hf_err = torch.cat(fast_err), torch.cat(hf_err)
    print(f"bf16 mean |fast - hf| {fast_err.mean():.4f}, mean |hf bf16 - fp32| {hf_err.mean():.4f}")
    assert fast_err.mean() <= max(2 * hf_err.mean(), 0.02)
