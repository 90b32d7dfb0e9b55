"""pass@k (the unbiased estimator of Chen et al. 2021) and majority voting (maj@k) over the
samples of each eval prompt; a sample is correct when its reward is >= 1 (as ``eval_accuracy``)."""
from __future__ import annotations

from collections import Counter
from typing import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of ``k`` of ``n`` samples, ``c`` of them correct, is correct:
    ``1 - C(n-c, k) / C(n, k)``, as a product so large ``n`` does not overflow."""
    if not 0 < k <= n:
        raise ValueError(f"k={k} must be between 1 and the samples per prompt ({n})")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def majority_at_k(answers: Sequence[str | None], correct: Sequence[bool], k: int) -> float:
    """The share of disjoint chunks of ``k`` samples whose most frequent answer (ties: the first
    seen) is a correct one; samples without an answer do not vote."""
    chunks = [range(i, i + k) for i in range(0, len(answers) - k + 1, k)]
    if not chunks:
        raise ValueError(f"k={k} must be between 1 and the samples per prompt ({len(answers)})")
    wins = 0
    for chunk in chunks:
        votes = Counter(answers[i] for i in chunk if answers[i] is not None)
        if votes:
            top = max(votes.values())
            winner = next(answers[i] for i in chunk if answers[i] is not None and votes[answers[i]] == top)
            wins += any(correct[i] for i in chunk if answers[i] == winner)
    return wins / len(chunks)


def summarize(per_prompt: Sequence[tuple[Sequence[str | None], Sequence[bool]]], ks: Sequence[int]) -> dict[str, float]:
    """``pass@k`` and ``maj@k`` for each ``k``, averaged over prompts (``answers``, ``correct``)."""
    out: dict[str, float] = {}
    m = max(len(per_prompt), 1)
    for k in ks:
        out[f"pass@{k}"] = sum(pass_at_k(len(c), sum(c), k) for _, c in per_prompt) / m
    for k in ks:
        out[f"maj@{k}"] = sum(majority_at_k(a, c, k) for a, c in per_prompt) / m
    return out
