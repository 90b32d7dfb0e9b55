"""One generation per sample: prompts encoded, all tasks in one ``engine.generate`` call."""
from __future__ import annotations

from typing import Any

from miles import Sample, SamplingParams, Status, Task
from miles_tokens import decode_batch, encode_prompts


def single_turn(tasks: list[Task], n: int, engine: Any, tokenizer: Any, params: SamplingParams) -> list[list[Sample]]:
    """Generate ``n`` samples for each task in one batched engine call. A completion that ended
    on a stop token is ``completed``, one cut by ``max_new_tokens`` ``truncated``; the engine's
    per-completion extras (e.g. routed experts) go to ``Sample.extensions``."""
    prompts = encode_prompts(tokenizer, [t.prompt for t in tasks])
    outs = engine.generate(prompts, params, n=n)
    texts = iter(decode_batch(tokenizer, [c.token_ids for cs in outs for c in cs]))
    return [[Sample(task=task, prompt_ids=prompt_ids, response_ids=c.token_ids, response=next(texts),
                    logprobs=c.logprobs, weight_version=c.weight_version,
                    weight_versions=c.weight_versions or [c.weight_version],
                    extensions=dict(getattr(c, "extras", None) or {}),
                    status=Status.COMPLETED if c.finish_reason == "stop" else Status.TRUNCATED)
             for c in completions]
            for task, prompt_ids, completions in zip(tasks, prompts, outs)]


class SingleTurn:
    """``rollout.name: single_turn`` (``miles.protocols.Rollout``): one generation per sample,
    all tasks in one engine call."""

    def __init__(self, cfg: Any = None, **_: Any) -> None:
        pass

    def generate(self, tasks: list[Task], n: int, *, engine: Any, env: Any, tokenizer: Any,
                 params: SamplingParams) -> list[list[Sample]]:
        return single_turn(tasks, n, engine, tokenizer, params)
