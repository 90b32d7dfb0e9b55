"""Decode steps replayed as CUDA graphs replay them, on CPU, for every frontier family.

A CUDA graph runs the kernels its capture recorded, at the addresses it recorded: the Python code
of the step does not run again. A step that keeps state in Python (a position counter, a window
index), reads device data on the host, or advances a cache in place during the capture's warm-up
therefore decodes wrongly or not at all under graphs, while every eager test passes. Here the
capture is ``make_fx``'s trace of the same step (the aten operations on the same tensors, mutations
included), replayed by calling the traced graph, so those faults show on a CPU too: without the
warm-up's state restore (``RowsForward.saved_state``) gated DeltaNet's log-probs drift by more
than 1. A host read during the capture fails it, as it fails a CUDA capture.
"""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from miles import SamplingParams, make_plugin_manager
from miles.testing import PROMPTS, char_tokenizer, lively_weights, model_spec
from miles.testing.arch import reference_logprobs
from miles.testing.syncs import count_syncs
from miles_tinypolicy.frontier import FAMILIES, frontier_config
from torch.fx.experimental.proxy_tensor import make_fx

from miles_plugin_torch_engine import cuda_graphs
from miles_plugin_torch_engine.config import TorchEngineConfig
from miles_plugin_torch_engine.engine import TorchEngine

ROWS = 5  # cache rows: 3 prompts x 2 samples do not fit, so the third prompt joins mid-decode


class TracedGraph:
    """``cuda_graphs.capture_graph``'s contract on CPU: a warm-up run, the state restore, then a
    capture that must not read device data; ``replay`` runs only what was captured."""

    def __init__(self, run: Callable[[], None], device: Any, pool: Any,
                 after_warmup: Callable[[], None] | None = None):
        run()
        if after_warmup is not None:
            after_warmup()
        with count_syncs() as syncs:
            self.graph = make_fx(run, tracing_mode="real")()
        if syncs.total:
            raise RuntimeError(f"the step reads device data on the host: {syncs.by_site()}")
        if after_warmup is not None:  # tracing ran the step once; a CUDA capture runs nothing
            after_warmup()
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.graph()


@pytest.fixture
def traced(monkeypatch):
    monkeypatch.setattr(cuda_graphs, "capture_graph", TracedGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)


def _engine(family: str, pm) -> TorchEngine:
    engine = TorchEngine(TorchEngineConfig(impl="hf", max_batch_size=ROWS),
                         spec=model_spec(frontier_config(family), pm=pm), tokenizer=char_tokenizer(), seed=0)
    engine.load_weights(lively_weights(engine.model), version=1)
    engine._fast.runner.use_graphs = True  # off by default on CPU
    return engine


def _worst_gap(engine: TorchEngine, prompts, outs) -> float:
    """Largest |log-prob| gap between the samples and a cache-less forward of their tokens."""
    return max(float((reference_logprobs(engine.model, p, c.token_ids) - torch.tensor(c.logprobs)).abs().max())
               for p, comps in zip(prompts, outs) for c in comps)


def _generate(engine: TorchEngine):
    prompts = [list(p) for p in PROMPTS[:3]]
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=3, stop_token_ids=[5, 7, 9, 11])
    return prompts, engine.generate(prompts, params, n=2)


@pytest.fixture(scope="module")
def pm():
    return make_plugin_manager()


@pytest.mark.parametrize("family", FAMILIES)
def test_replayed_decode_steps_equal_transformers(family, pm, traced, single_thread):
    engine = _engine(family, pm)
    prompts, outs = _generate(engine)
    runner = engine._fast.runner
    assert runner.use_graphs, f"{family}: the capture failed and the engine fell back to eager decoding"
    replays = sum(g.replays for g in runner._graphs.values())
    steps = max(len(c.token_ids) for cs in outs for c in cs) - 1
    assert replays >= steps, f"{family}: {replays} replays for {steps} decode steps"
    assert len({len(c.token_ids) for cs in outs for c in cs}) > 1, "every sample ran the same length"
    assert engine._fast.stats["joined_mid_decode"] > 0
    worst = _worst_gap(engine, prompts, outs)
    assert worst < 1e-5, f"{family}: replayed steps' log-probs differ from transformers' by {worst:.2e}"


def test_a_step_that_advances_state_during_the_warm_up_is_caught(pm, traced, monkeypatch, single_thread):
    """Gated DeltaNet's recurrent state advances in place: with the restore dropped, the warm-up
    leaves it a step ahead of every replay that follows, which this harness must show."""
    engine = _engine("qwen3_next", pm)
    monkeypatch.setattr(type(engine._fast.fwd), "saved_state", lambda self: None)
    prompts, outs = _generate(engine)
    assert _worst_gap(engine, prompts, outs) > 1e-2
