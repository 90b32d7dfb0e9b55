"""The env's demonstrations as training samples: ``(task, response_text)`` pairs tokenized as
prompt + response + EOS, multi-turn ``(task, messages)`` transcripts laid out by the run's rollout
component as its own rollouts are (``RendersTranscripts``: tool results masked)."""
from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from miles import MilesError, Sample
from miles.protocols import Demonstrates, RendersTranscripts
from miles_tokens import encode_prompts


def demonstrations(env: Any, who: str, fix: str) -> list:
    """The env's ``(task, answer)`` pairs; an env without any is an error naming ``who`` needs them
    and the ``fix``."""
    if not isinstance(env, Demonstrates):
        raise MilesError(f"{who} needs demonstrations, but env {type(env).__name__} has none; {fix}")
    return list(env.demonstrations())


def demo_samples(demos: Sequence, count: int, rng: random.Random, *, tokenizer: Any, env: Any, rollout: Any,
                 version: int, rollout_name: str | None = None) -> list[Sample]:
    """``count`` demonstrations drawn with replacement, as samples of weight version ``version``
    (``rollout_name``: the run's ``rollout.name``, for the error a transcript it cannot lay out gives)."""
    picked = [rng.choice(demos) for _ in range(count)]
    if not all(isinstance(text, str) for _, text in picked):  # multi-turn transcripts
        if not isinstance(rollout, RendersTranscripts):
            which = f"rollout.name {rollout_name!r}" if rollout_name else f"the rollout {type(rollout).__name__}"
            raise MilesError(f"the env gives multi-turn demonstrations (task, messages), which {which} cannot "
                             f"lay out; pick a rollout that can (e.g. rollout.name: multi-turn)")
        return [rollout.demonstration(task, msgs, tokenizer=tokenizer, env=env, version=version)
                for task, msgs in picked]
    prompts = encode_prompts(tokenizer, [task.prompt for task, _ in picked])
    responses = encode_prompts(tokenizer, [text for _, text in picked])  # plain text, no template
    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return [Sample(task=task, prompt_ids=p, response_ids=r + stop, response=text, weight_version=version)
            for (task, text), p, r in zip(picked, prompts, responses)]
