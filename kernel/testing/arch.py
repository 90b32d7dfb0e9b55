"""Parity checks for an architecture plugin (``miles_register_architectures``), each over a tiny
inline Hugging Face config (``model_type`` plus sizes) at random weights, with transformers' own
forward of the same tokens as the reference (fp32, CPU):

- ``engine_matches_transformers``: the torch engine (``impl: hf``) samples; the log-probs it returns
  equal a transformers forward of the prompt and completion.
- ``routing_replay_matches``: the ``moe`` spec records each token's experts in the engine;
  replaying them in the trainer's ``action_logprobs`` reproduces the engine's log-probs, random
  experts change them, and gradients reach the routers.
- ``megatron_round_trip``: Hugging Face weights -> megatron-core shards (TP x EP) -> Hugging Face
  weights, bit for bit (the architecture ``BuildsMegatron``).
- ``megatron_matches_transformers``: the megatron trainer on CPU loads the weights, gives them
  back bit for bit, and its log-probs equal transformers'.

``plugins``: launch-time plugins to load (paths to ``.py`` files or module names, as ``miles train
--plugin`` takes them), so a plugin's tests run before it is installed. Each check raises
``AssertionError`` with the measured difference and returns it. Components come from the plugin
manager by name (the kernel imports no plugin): the hf, moe specs, the torch engine and, for the
megatron checks, miles-plugin-megatron.
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Any, Iterator, Sequence

from ..plugins import MilesPluginManager, make_plugin_manager
from ..types import Batch, Sample, SamplingParams, Task

# left-padded prompts of different lengths (char_tokenizer ids), so padding and caching are exercised
PROMPTS = ((2, 5, 6, 7, 8, 9, 10, 11, 12, 13), (2, 11), (2, 12, 13, 14, 15))


def model_spec(config: dict[str, Any], *, plugins: Sequence[str] = (), replay: bool = False,
               pm: MilesPluginManager | None = None) -> Any:
    """The hf model spec over inline ``config`` (``replay``: wrapped in the ``moe`` spec, routing
    replay on), with the architecture a loaded plugin registers for its ``model_type``."""
    pm = pm or make_plugin_manager(extra=list(plugins))
    model_type = config.get("model_type")
    if model_type not in pm.registry("architectures"):
        raise AssertionError(f"no plugin registers architecture {model_type!r} (registered: "
                             f"{sorted(pm.registry('architectures'))}); pass plugins=[path to its module]")
    specs = pm.registry("model_specs")
    if not replay:
        return pm.create("model_specs", "hf", specs["hf"].config(config=config), pm=pm)
    settings = specs["moe"].config(base={"name": "hf", "config": config}, routing_replay=True)
    return pm.create("model_specs", "moe", settings, pm=pm)


def lively_weights(model: Any, seed: int = 1) -> list[tuple[str, Any]]:
    """Random weights whose outputs are far from uniform (``miles_tinypolicy.frontier.lively``): the
    default init's std 0.02 makes every next-token distribution nearly flat and every router
    nearly tied, where a wrong expert or a wrong position would change little."""
    from miles_tinypolicy.frontier import lively

    return lively(model, seed)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Tiny matmuls gain nothing from threads on a shared CPU."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _engine(pm: MilesPluginManager, spec: Any, tok: Any, seed: int) -> Any:
    engine = pm.create("engines", "torch", pm.registry("engines")["torch"].config(impl="hf"), spec=spec,
                       tokenizer=tok, seed=0)
    engine.load_weights(lively_weights(engine.model, seed), version=1)
    return engine


def reference_logprobs(model: Any, prompt: Sequence[int], response: Sequence[int]) -> Any:
    """transformers' log-probs of ``response`` after ``prompt``: one unpadded row, no cache."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(prompt) + list(response)]), use_cache=False).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    return logp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def engine_matches_transformers(config: dict[str, Any], *, plugins: Sequence[str] = (), tol: float = 1e-5,
                                max_new_tokens: int = 8, n: int = 2, seed: int = 1) -> float:
    """The torch engine samples ``n`` completions of each of ``PROMPTS`` (batched, left-padded,
    decoded over the architecture's cache); returns the largest |engine - transformers| log-prob."""
    import torch

    from . import char_tokenizer

    pm = make_plugin_manager(extra=list(plugins))
    tok = char_tokenizer()
    with _one_thread():
        engine = _engine(pm, model_spec(config, pm=pm), tok, seed)
        outs = engine.generate([list(p) for p in PROMPTS], SamplingParams(temperature=1.0,
                                                                           max_new_tokens=max_new_tokens), n=n)
        assert [len(o) for o in outs] == [n] * len(PROMPTS), [len(o) for o in outs]
        worst = 0.0
        for prompt, comps in zip(PROMPTS, outs):
            for comp in comps:
                assert comp.token_ids, "the engine returned an empty completion"
                want = reference_logprobs(engine.model, prompt, comp.token_ids)
                worst = max(worst, (want - torch.tensor(comp.logprobs)).abs().max().item())
    assert worst <= tol, f"{config['model_type']}: engine log-probs differ from transformers' by {worst:.2e}"
    return worst


def routing_replay_matches(config: dict[str, Any], *, plugins: Sequence[str] = (), tol: float = 1e-5,
                           max_new_tokens: int = 6, seed: int = 1) -> tuple[float, float]:
    """R3 through the ``moe`` spec: the engine records experts; a trainer-side copy of the model
    replaying them reproduces the engine's log-probs (returned: the largest difference), random
    experts of the same shape change them (returned: the largest change, > 1e-3), and the
    replayed log-probs' gradient reaches the architecture's routers."""
    import torch

    from ..protocols import RecordsRouting, RoutesExperts
    from . import char_tokenizer

    pm = make_plugin_manager(extra=list(plugins))
    tok = char_tokenizer()
    with _one_thread():
        spec = model_spec(config, pm=pm, replay=True)
        arch = spec.architecture()
        assert isinstance(arch, RoutesExperts), f"the {config['model_type']} architecture does not route experts"
        assert isinstance(spec, RecordsRouting)
        engine = _engine(pm, spec, tok, seed)
        key = spec.routing_recorder(engine.model).extension
        outs = engine.generate([list(p) for p in PROMPTS], SamplingParams(temperature=1.0,
                                                                           max_new_tokens=max_new_tokens), n=2)
        samples = [Sample(Task("x"), prompt_ids=list(p), response_ids=c.token_ids, logprobs=c.logprobs,
                          extensions=dict(c.extras)) for p, cs in zip(PROMPTS, outs) for c in cs]
        routers = arch.routers(engine.model)
        for s in samples:
            rec = s.extensions[key]["routed_experts"]
            want = (len(s.prompt_ids) + len(s.response_ids) - 1, len(routers), routers[0].top_k)
            assert tuple(rec.shape) == want, f"recorded experts {tuple(rec.shape)}, expected {want}"
        batch = Batch.from_samples(samples, pad_id=tok.pad_token_id, advantages=[1.0] * len(samples))
        model = spec.build_model(tok)
        model.load_state_dict(engine.model.state_dict())
        mask = batch.loss_mask.bool()
        replayed = spec.action_logprobs(model, batch)
        same = (replayed.detach() - batch.rollout_logprobs)[mask].abs().max().item()
        assert same <= tol, f"replayed log-probs differ from the engine's by {same:.2e}"
        replayed[mask].sum().backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for r in arch.routers(model)
                   for p in r.parameters()), "no gradient reaches the routers through the replayed forward"
        g = torch.Generator().manual_seed(seed)
        for s in samples:  # distinct random experts per token and layer
            rec = s.extensions[key]["routed_experts"]
            noise = torch.rand(*rec.shape[:2], routers[0].num_experts, generator=g)
            s.extensions = {**s.extensions, key: {"routed_experts": noise.argsort(-1)[..., :rec.shape[2]].int()}}
        other = Batch.from_samples(samples, pad_id=tok.pad_token_id, advantages=[1.0] * len(samples))
        with torch.no_grad():
            changed = (spec.action_logprobs(model, other) - replayed.detach())[mask].abs().max().item()
    assert changed > 1e-3, f"random experts left the log-probs unchanged ({changed:.2e}): replay is not applied"
    return same, changed


def _megatron(name: str) -> Any:
    """A module of miles-plugin-megatron, by name (the kernel never imports a plugin by itself)."""
    try:
        return importlib.import_module(f"miles_plugin_megatron.{name}")
    except ImportError as e:
        raise AssertionError(f"the megatron checks need miles-plugin-megatron and megatron-core "
                             f"(pip install miles-plugin-megatron): {e}") from e


def megatron_round_trip(config: dict[str, Any], *, plugins: Sequence[str] = (), tp: int = 1, ep: int = 1,
                        seed: int = 1) -> int:
    """Hugging Face weights -> megatron-core's layout split over ``tp`` tensor- and ``ep``
    expert-parallel ranks -> Hugging Face weights, bit for bit. Returns the tensors compared."""
    import torch

    from . import char_tokenizer

    A, C = _megatron("arch"), _megatron("convert")
    with _one_thread():
        spec = model_spec(config, plugins=plugins)
        model = spec.build_model(char_tokenizer())
        model.load_state_dict(dict(lively_weights(model, seed)), strict=False)
        hf = model.state_dict()
        arch = A.arch_of(model.config, spec.architecture())
        try:  # a description that does not fit the weights fails inside the converter: say which
            full = C.hf_to_full(hf, arch, tp)
            shards = {(t, e): C.shard(full, arch, tp=tp, tp_rank=t, ep=ep, ep_rank=e)
                      for t in range(tp) for e in range(ep)}
            back = C.full_to_hf(C.unshard(shards, arch, tp, ep), arch)
        except (KeyError, RuntimeError, ValueError) as e:
            raise AssertionError(f"{config['model_type']}: the weights do not convert as megatron_arch "
                                 f"describes them ({type(e).__name__}: {e})") from e
    assert set(back) == set(hf), (f"names lost: {sorted(set(hf) - set(back))[:5]}, "
                                  f"names added: {sorted(set(back) - set(hf))[:5]}")
    differ = [k for k, v in hf.items() if not torch.equal(back[k], v)]
    assert not differ, f"tensors changed by the TP={tp} EP={ep} round trip: {differ[:5]}"
    return len(hf)


def megatron_matches_transformers(config: dict[str, Any], *, plugins: Sequence[str] = (), tol: float = 1e-5,
                                  seed: int = 1, rows: int = 5) -> float:
    """The megatron trainer (one rank, fp32, on CPU through ``miles_plugin_megatron.cpu``) built
    from the spec, loaded with random Hugging Face weights: ``named_weights()`` gives them back bit
    for bit, and its log-probs of a padded batch of random tokens equal transformers' (returned:
    the largest difference)."""
    import torch

    from . import char_tokenizer

    pm = make_plugin_manager(extra=list(plugins))
    if "megatron" not in pm.registry("trainers"):
        raise AssertionError("the megatron checks need miles-plugin-megatron (no trainer 'megatron' registered)")
    tok = char_tokenizer()
    with _one_thread(), _megatron("cpu").on_cpu():
        spec = model_spec(config, pm=pm)
        trainer = pm.create("trainers", "megatron", pm.registry("trainers")["megatron"].config(
            device="cpu", precision="fp32"), spec=spec, tokenizer=tok, seed=0)
        model = spec.build_model(tok)
        model.load_state_dict(dict(lively_weights(model, seed)), strict=False)
        trainer.load_weights(model.state_dict().items())
        back, hf = dict(trainer.named_weights()), model.state_dict()
        assert set(back) == set(hf), f"names differ: {sorted(set(back) ^ set(hf))[:5]}"
        differ = [k for k, v in hf.items() if not torch.equal(back[k], v)]
        assert not differ, f"the trainer gives back other weights than it loaded: {differ[:5]}"
        batch = _random_batch(len(tok), tok.pad_token_id, rows, seed)
        got = trainer.logprobs(batch)
    with torch.no_grad():
        logits = model.eval()(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                              position_ids=batch.position_ids).logits[:, batch.prompt_len - 1:-1].float()
    want = logits.log_softmax(-1).gather(-1, batch.input_ids[:, batch.prompt_len:, None])[..., 0]
    worst = (got - want)[batch.loss_mask.bool()].abs().max().item()
    assert worst <= tol, f"{config['model_type']}: megatron log-probs differ from transformers' by {worst:.2e}"
    return worst


def _random_batch(vocab: int, pad_id: int, rows: int, seed: int) -> Batch:
    """Prompts (3 to 5 tokens, left-padded) and responses (2 to 5, right-padded) of random ids."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = [i for i in range(vocab) if i != pad_id]

    def pick(k: int) -> list[int]:
        return [ids[j] for j in torch.randint(0, len(ids), (k,), generator=g).tolist()]

    samples = [Sample(task=Task(prompt="x"), prompt_ids=pick(3 + i % 3), response_ids=pick(5 - i % 4),
                      logprobs=[0.0] * (5 - i % 4)) for i in range(rows)]
    return Batch.from_samples(samples, pad_id=pad_id, advantages=[1.0] * rows)
