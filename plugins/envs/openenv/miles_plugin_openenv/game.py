"""``sum_guess``: a tiny multi-step game written as an OpenEnv ``Environment``.

``reset(seed)`` deals two digits and shows ``"a+b="``; each ``step`` takes a guess of the sum.
A right guess ends the episode with reward 1; a wrong one gets the hint ``"^"`` (higher) or
``"v"`` (lower), or ``"?"`` when the guess is not a number, and the next guess follows, up to
``max_turns`` guesses (then reward 0). A policy that adds right away scores 1; one that follows
the hints can still get there, so multi-step play is rewarded too.

The reset observation also carries ``reference``: a sloppy teacher's answer for supervised warm
starts (the policy is shown only ``prompt``). The teacher adds right, except that on a carry
problem (sum >= 10) it forgets the carry unless a seeded coin with ``teacher_carry_accuracy``
says otherwise, so a model trained on it plateaus below what the reward asks for.
"""
from __future__ import annotations

import random
from typing import Any, Optional
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

MAX_TURNS = 3
TEACHER_CARRY_ACCURACY = 0.4


class GuessAction(Action):
    message: str = Field(..., description="the guessed sum, as text")


class GuessObservation(Observation):
    prompt: str = Field("", description="the problem, 'a+b=' (after reset)")
    hint: str = Field("", description="'^' guess higher, 'v' guess lower, '?' not a number")
    reference: str = Field("", description="a sloppy teacher's answer (after reset), for warm starts")


class SumGuessEnvironment(Environment):
    """Each WebSocket session gets its own instance, so episodes never share state."""

    SUPPORTS_CONCURRENT_SESSIONS: bool = True
    TEACHER_CARRY_ACCURACY: float = TEACHER_CARRY_ACCURACY

    def __init__(self, max_turns: int = MAX_TURNS, teacher_carry_accuracy: float | None = None):
        super().__init__()
        self.max_turns = max_turns
        self.teacher_carry_accuracy = (self.TEACHER_CARRY_ACCURACY if teacher_carry_accuracy is None
                                       else teacher_carry_accuracy)
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._answer = 0

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None,
              **kwargs: Any) -> GuessObservation:
        rng = random.Random(seed)
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        self._answer = a + b
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        forgets = a + b >= 10 and rng.random() >= self.teacher_carry_accuracy
        reference = str((a + b) % 10 if forgets else a + b)
        return GuessObservation(prompt=f"{a}+{b}=", reference=reference, done=False, reward=0.0)

    def step(self, action: GuessAction, timeout_s: Optional[float] = None,
             **kwargs: Any) -> GuessObservation:  # type: ignore[override]
        self._state.step_count += 1
        text = action.message.strip()
        guess = int(text) if text.isdigit() else None
        if guess == self._answer:
            return GuessObservation(done=True, reward=1.0)
        hint = "?" if guess is None else ("^" if guess < self._answer else "v")
        return GuessObservation(hint=hint, done=self._state.step_count >= self.max_turns, reward=0.0)

    @property
    def state(self) -> State:
        return self._state
