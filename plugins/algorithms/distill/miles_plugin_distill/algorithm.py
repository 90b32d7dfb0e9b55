"""On-policy distillation: the student samples, the teacher scores every sampled token.

Per token t of a student sample, ``A_t = kl_coef * (logp_teacher(t) - logp_student(t))``: the
negative of the per-token reverse KL estimate ``log pi_s - log pi_t`` at the sampled token.
With the policy-gradient loss ``-A_t * ratio_t`` the expected gradient is that of
``-KL(pi_s || pi_t)`` summed over the student's own visited states (each token credited on its
own, no discounting through later tokens), so the student moves towards what the teacher would
say where the student actually goes. ``reward_coef > 0`` adds the env reward's group-normalised
advantage (RL plus a distillation term). ``logp_student`` is the rollout engine's log-prob
(``Sample.logprobs``), so run rollouts at temperature 1.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from miles import Batch, Group, Sample
from miles_rlmath.advantages import group_advantages
from miles_rlmath.masked import aggregate, masked_mean
from miles_rlmath.ratio import ppo_clip_loss

from .config import DistillConfig


class Distill:
    """Implements ``miles.protocols.Algorithm``; the teacher is loaded on first use."""

    uses_rollout = True
    needs_reference = False
    needs_critic = False

    def __init__(self, cfg: DistillConfig):
        self.cfg = cfg
        self._teacher = None

    @property
    def teacher(self):
        if self._teacher is None:
            from .teacher import Teacher

            self._teacher = Teacher(self.cfg.teacher, self.cfg.teacher_device, self.cfg.teacher_batch_size)
        return self._teacher

    def keep(self, group: Group) -> bool:
        # every sample carries a per-token signal, even in a group whose rewards are all equal
        return True

    def advantages(self, groups: Sequence[Group]) -> list[list[list[float]]]:
        samples = [s for g in groups for s in g.samples]
        teacher = iter(self.teacher.logprobs(samples))
        out = []
        for g in groups:
            rl = (group_advantages(g.rewards, self.cfg.std_normalize) if self.cfg.reward_coef
                  else [0.0] * len(g.samples))
            per_group = []
            for s, a in zip(g.samples, rl):
                t = next(teacher)
                s.extensions["distill"] = {"teacher_logprobs": t}
                per_group.append([self.cfg.kl_coef * (lt - ls) + self.cfg.reward_coef * a
                                  for lt, ls in zip(t, s.logprobs)])
            out.append(per_group)
        return out

    def make_batch(self, samples: list[Sample], pad_id: int, advantages=None) -> Batch:
        """The usual padded batch plus ``teacher_logprobs`` ``[B, R]`` (for the metrics)."""
        batch = Batch.from_samples(samples, pad_id, advantages)
        R = batch.loss_mask.shape[1]
        rows = [(s.extensions.get("distill", {}).get("teacher_logprobs") or [])[:R] for s in samples]
        batch.teacher_logprobs = torch.tensor([r + [0.0] * (R - len(r)) for r in rows])
        return batch

    def loss(self, batch: Batch, logprobs: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        old = batch.old_logprobs if batch.old_logprobs is not None else logprobs.detach()
        per_token, _ = ppo_clip_loss(logprobs, old, batch.advantages, self.cfg.clip_low, self.cfg.clip_high)
        mask = batch.loss_mask
        metrics = {"pg_loss": float(aggregate(batch.as_global(), per_token.detach(), self.cfg.loss_agg))}
        if batch.teacher_logprobs is not None:
            # sample estimate of the per-token reverse KL(student || teacher) on the student's tokens
            metrics["distill_reverse_kl"] = masked_mean(batch.rollout_logprobs - batch.teacher_logprobs, mask)
            metrics["teacher_logprob_mean"] = masked_mean(batch.teacher_logprobs, mask)
        return aggregate(batch, per_token, self.cfg.loss_agg), metrics
