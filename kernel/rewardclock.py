"""Reward timing: every reward call (a ``miles_reward`` plugin, the rollout's or the env's verifier)
is measured against ``rollout.reward_budget``. A call over it is counted (metric
``rewards_over_budget``) and its source named once on the console; the step's reward time is
logged (``reward_seconds``, ``reward_seconds_max``), and a warning says when rewards take most of
a step. The budget is a measure, not a kill: Python cannot stop a call in another's code safely
(a thread cannot be interrupted; a signal would clash with rewards that use SIGALRM themselves), so a
remote judge keeps its own request timeout and miles makes the cost visible.
"""
from __future__ import annotations

import threading
from typing import Callable

DOMINANT = 0.5  # share of a step's time in rewards that earns a warning
MIN_STEP_SECONDS = 1.0  # below this a step is too short for the share to matter


class RewardClock:
    def __init__(self, budget: float, console: Callable[[str], None]) -> None:
        self.budget, self.console = budget, console
        self._lock = threading.Lock()  # async mode's workers score concurrently
        self._warned: set[str] = set()
        self._reset()

    def _reset(self) -> None:
        self.total, self.slowest, self.over = 0.0, 0.0, 0

    def record(self, source: str, seconds: float) -> None:
        """One reward call of ``source`` took ``seconds``."""
        with self._lock:
            self.total += seconds
            self.slowest = max(self.slowest, seconds)
            late = seconds > self.budget
            self.over += late
            first = late and source not in self._warned
            if first:
                self._warned.add(source)
        if first:
            self.console(f"warning: {source} took {seconds:.1f} s for one sample's reward, over "
                         f"rollout.reward_budget ({self.budget:g} s); slow rewards stall every step (metric "
                         f"rewards_over_budget counts them): give a remote judge a request timeout, batch "
                         f"or cache it, or raise rollout.reward_budget")

    def metrics(self) -> dict[str, float]:
        """The reward time since the last call (``reward_seconds``, ``reward_seconds_max``, and
        ``rewards_over_budget`` when any call was over), then the counters start again."""
        with self._lock:
            if self.total == 0.0 and self.over == 0:
                return {}
            out = {"reward_seconds": self.total, "reward_seconds_max": self.slowest}
            if self.over:
                out["rewards_over_budget"] = float(self.over)
            self._reset()
        return out


class StepShare:
    """Warns once a run when rewards take most of a training step's time."""

    def __init__(self, console: Callable[[str], None]) -> None:
        self.console, self.warned = console, False

    def check(self, step: int, metrics: dict[str, float]) -> None:
        rewards, total = metrics.get("reward_seconds", 0.0), metrics.get("step_seconds", 0.0)
        if self.warned or total < MIN_STEP_SECONDS or rewards <= DOMINANT * total:
            return
        self.warned = True
        self.console(f"warning: rewards took {rewards:.1f} s of step {step}'s {total:.1f} s "
                     f"({100 * rewards / total:.0f}%); the reward, not the model, sets the pace: see the "
                     f"metrics reward_seconds and reward_seconds_max")
