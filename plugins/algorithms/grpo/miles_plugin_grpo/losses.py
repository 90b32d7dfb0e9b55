"""Loss and estimator math shared by the policy-gradient algorithms (public API).

Everything here is a pure function of tensors (``[B, R]`` over response tokens, with a
``loss_mask``), so sibling algorithms, including other distributions such as
``miles-plugin-ppo``, import it from ``miles_plugin_grpo`` rather than re-deriving it.

Sources of the formulas (facts, not code): Miles/slime ``loss_hub`` (advantages, KL estimators,
policy/value losses, TIS), the GSPO paper (Zheng et al. 2025, sequence-level ratio), the
REINFORCE++ paper (Hu 2025) and GAE (Schulman et al. 2016); see each docstring.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from miles import Batch

STD_EPS = 1e-6
WHITEN_EPS = 1e-8
# exp() of a log-ratio beyond this overflows float32 long before it carries information.
LOG_RATIO_CLAMP = 20.0


def group_advantages(rewards: Sequence[float], std_normalize: bool = True) -> list[float]:
    """Advantages of one group: ``r - mean(r)``, divided by ``std + 1e-6`` (unbiased std) when
    ``std_normalize`` and the std is positive.

    A single-sample group has no baseline to compare against, so its advantage is the raw
    reward (REINFORCE without baseline) rather than a vacuous 0.
    """
    r = [float(x) for x in rewards]  # plain floats: groups are tiny, tensors cost more than math
    if len(r) == 1:
        return r
    mean = sum(r) / len(r)
    adv = [x - mean for x in r]
    if std_normalize:
        std = math.sqrt(sum(a * a for a in adv) / (len(r) - 1))
        if std > 0:
            adv = [a / (std + STD_EPS) for a in adv]
    return adv


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || ref) from samples of the policy (Schulman's k1/k2/k3),
    with ``lr = logprobs - ref_logprobs``."""
    lr = logprobs - ref_logprobs
    if kind == "k1":
        return lr
    if kind == "k2":
        return lr.pow(2) / 2
    if kind == "k3":
        # Clamping only the exp argument keeps k3 finite where the two models disagree wildly.
        return torch.exp((-lr).clamp(max=LOG_RATIO_CLAMP)) - 1 + lr
    raise ValueError(f"unknown KL estimator {kind!r}; expected 'k1', 'k2' or 'k3'")


def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  clip_low: float, clip_high: float | None = None,
                  dual_clip_c: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss ``max(-A*ratio, -A*clip(ratio, 1-clip_low, 1+clip_high))``,
    capped at ``-c*A`` where ``A < 0`` when ``dual_clip_c`` is set.

    Returns ``(loss, clipped)``: both shaped like ``logprobs``; ``clipped`` is a bool tensor, True
    where the clipped term was the larger (the token's gradient is cut off). For a
    sequence-level ratio (GSPO) pass ``sequence_log_ratio(...)`` as ``logprobs`` and zeros as
    ``old_logprobs``.
    """
    clip_high = clip_low if clip_high is None else clip_high
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped_term = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped_term)
    if dual_clip_c is not None:
        # Only negative advantages: a huge ratio there makes -A*ratio unbounded above.
        capped = torch.minimum(loss, -dual_clip_c * advantages)
        loss = torch.where(advantages < 0, capped, loss)
    return loss, clipped_term > unclipped


def sequence_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
    """GSPO's length-normalised sequence log-ratio ``mean_t(logp - old_logp)`` over the loss mask,
    broadcast to every token ``[B, R]`` (so ``exp`` of it is the paper's ``s_i(theta)``).

    It keeps the gradient of every token of the sequence: ``d s_i = s_i * mean_t d logp_t``.
    """
    per_seq = ((logprobs - old_logprobs) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_seq.unsqueeze(-1).expand_as(logprobs)


def aggregate(batch: Batch, x: torch.Tensor, loss_agg: str = "token-mean",
              max_response_len: int = 1024) -> torch.Tensor:
    """This micro-batch's share of the step-level aggregate of per-token ``x`` ``[B, R]``.

    Every mode divides by step-global constants only, so summing it over micro-batches gives
    exactly the value (and gradient) of the whole batch.
    """
    if loss_agg == "token-mean":
        return batch.token_mean(x)
    if loss_agg == "seq-mean-token-mean":
        return batch.seq_mean(x)
    if loss_agg == "seq-mean-token-sum-norm":
        return (x * batch.loss_mask).sum() / max_response_len / max(batch.global_samples, 1)
    raise ValueError(f"unknown loss_agg {loss_agg!r}; expected 'token-mean', "
                     f"'seq-mean-token-mean' or 'seq-mean-token-sum-norm'")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    """Plain mean of ``x`` over ``mask`` within one micro-batch, as a python float (for metrics)."""
    x = x.detach().float()
    return float((x * mask).sum() / mask.sum().clamp(min=1))


def masked_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(x - mean) / sqrt(var_unbiased + 1e-8)`` over the masked entries; 0 outside the mask.

    Miles' ``--normalize-advantages`` whitening (``var * n / (n - 1)`` is the unbiased variance);
    with a single masked entry the variance is taken as 0.
    """
    n = mask.sum()
    mean = (x * mask).sum() / n.clamp(min=1)
    var = (((x - mean) * mask) ** 2).sum() / (n - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + WHITEN_EPS) * mask


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` index of each row's last token with mask 1 (0 for a row without any)."""
    R = mask.shape[-1]
    pos = torch.arange(R, device=mask.device).expand_as(mask)
    return torch.where(mask > 0, pos, torch.zeros_like(pos)).max(-1).values


def terminal_rewards(outcome: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, R]`` zeros with each row's ``outcome`` ``[B]`` at its last trainable token."""
    out = torch.zeros_like(mask, dtype=outcome.dtype)
    rows = mask.sum(-1) > 0
    idx = last_token_index(mask)
    out[rows, idx[rows]] = outcome[rows]
    return out


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """``G_t = r_t + gamma * G_{t'}`` where ``t'`` is the next trainable token (REINFORCE++).

    Tokens with mask 0 (tool output) are not decision steps: no reward is read there, no
    discount is applied across them, and their return is 0.
    """
    running = torch.zeros_like(rewards[:, 0])
    out = torch.zeros_like(rewards)
    for t in range(rewards.shape[1] - 1, -1, -1):
        m = mask[:, t] > 0
        running = torch.where(m, rewards[:, t] + gamma * running, running)
        out[:, t] = torch.where(m, running, torch.zeros_like(running))
    return out


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over trainable tokens only (as Miles does).

    ``delta_t = r_t + gamma * V_{t'} - V_t``, ``A_t = delta_t + gamma * lam * A_{t'}`` with ``t'``
    the next trainable token (``V = A = 0`` after the last one: the episode ends there);
    returns ``(advantages, returns)`` with ``returns = A + V``; both 0 where mask is 0.
    """
    next_v = torch.zeros_like(values[:, 0])
    next_a = torch.zeros_like(values[:, 0])
    adv = torch.zeros_like(values)
    for t in range(values.shape[1] - 1, -1, -1):
        m = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        a = delta + gamma * lam * next_a
        next_a = torch.where(m, a, next_a)
        next_v = torch.where(m, values[:, t], next_v)
        adv[:, t] = torch.where(m, a, torch.zeros_like(a))
    return adv, (adv + values) * mask


def value_clip_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                    clip: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped value loss ``max((V - R)^2, (V_old + clip(V - V_old, +-clip) - R)^2)``
    (Miles' ``value_loss_function``, no 0.5 factor). ``clip=None`` gives plain ``(V - R)^2``.

    Returns ``(loss, clipped)``; ``clipped`` is True where the clipped term was the larger.
    """
    plain = (values - returns) ** 2
    if clip is None:
        return plain, torch.zeros_like(plain, dtype=torch.bool)
    v_clip = old_values + (values - old_values).clamp(-clip, clip)
    clipped = (v_clip - returns) ** 2
    return torch.maximum(plain, clipped), clipped > plain


def tis_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling for the rollout/trainer mismatch (Miles' vanilla TIS):
    ``w = min(exp(old_logp - rollout_logp), cap)``, no gradient."""
    lr = (old_logprobs - rollout_logprobs).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(lr).clamp(max=cap)


def mismatch_keep(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, low: float,
                  high: float) -> torch.Tensor:
    """1.0 where ``exp(old_logp - rollout_logp)`` lies in ``[low, high]``, else 0.0 (the
    icepop-style mask: tokens the engine and the trainer disagree on too much are dropped)."""
    lr = (old_logprobs - rollout_logprobs).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(lr)
    return ((ratio >= low) & (ratio <= high)).to(old_logprobs.dtype)


def sampled_entropy(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token entropy estimate from the sampled tokens alone (no logits needed).

    Value: ``rho * (-logp)`` with ``rho = exp(logp - old_logp)`` (detached), an unbiased
    estimate of the policy's entropy at that position since the token was drawn from the old
    policy. Gradient: ``-rho * logp * d logp``, whose expectation is the entropy's gradient
    (``dH = -E[logp * d logp]`` because ``E[d logp] = 0``). Differentiating ``-logp`` itself
    would be useless: its expected gradient is 0.
    """
    rho = torch.exp((logprobs - old_logprobs).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    lp = logprobs.detach()
    return rho * (-lp - lp * (logprobs - lp))
