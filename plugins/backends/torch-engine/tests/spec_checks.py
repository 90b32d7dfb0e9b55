"""Checks shared by the speculative-decoding tests: the exact distribution of every short
continuation, the empirical one of a set of samples, and the total-variation distance two
independent samples of the exact distribution show."""
from __future__ import annotations

import itertools

import numpy as np
import torch

from miles_plugin_torch_engine.engine import _filter


def exact(model, prompt: list[int], steps: int, vocab: int, params) -> dict[tuple, float]:
    """Probability of every ``steps``-token continuation of ``prompt`` under plain sampling's
    distribution (temperature, then top-k / top-p renormalised)."""
    seqs = list(itertools.product(range(vocab), repeat=steps))
    ids = torch.tensor([list(prompt) + list(s) for s in seqs])
    with torch.no_grad():
        logits = model(ids).logits[:, len(prompt) - 1:-1].float()
    logp = torch.log_softmax(logits / params.temperature, -1)
    logp = torch.log_softmax(_filter(logp.reshape(-1, vocab), params.top_k, params.top_p), -1).view_as(logp)
    tok = ids[:, len(prompt):]
    p = logp.gather(-1, tok[..., None]).squeeze(-1).sum(-1).exp()
    return dict(zip(seqs, p.tolist()))


def empirical(comps, keys) -> np.ndarray:
    counts = dict.fromkeys(keys, 0)
    for c in comps:
        counts[tuple(c.token_ids)] += 1
    return np.array([counts[k] for k in keys], dtype=float) / len(comps)


def tv(a: np.ndarray, b: np.ndarray) -> float:
    return 0.5 * float(np.abs(a - b).sum())


def tv_bound(p: np.ndarray, n: int) -> float:
    """The 99.9th percentile of the total-variation distance between two independent samples of
    ``n`` draws from ``p`` (300 simulated pairs)."""
    rng, p = np.random.default_rng(0), p / p.sum()
    noise = [tv(rng.multinomial(n, p) / n, rng.multinomial(n, p) / n) for _ in range(300)]
    return float(np.quantile(noise, 0.999))
