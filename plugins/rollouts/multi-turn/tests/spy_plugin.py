"""A launch-time plugin for the ``miles serve`` tests: what the trainer sees in every loss call,
written as JSON lines to ``$MILES_TEST_SPY`` (``None`` keeps the algorithm's own loss), and a
reward for calling a tool."""
import json
import os

from miles import hookimpl

_pending: list[dict] = []


def _runs(mask):
    """(start, end) of every maximal run of loss-mask 0."""
    out, start = [], None
    for i, m in enumerate(list(mask) + [1]):
        if m == 0 and start is None:
            start = i
        elif m != 0 and start is not None:
            out.append((start, i))
            start = None
    return out


@hookimpl
def miles_reward(sample):
    """Reward a turn that called a tool, so groups differ and every step moves the weights (the
    exact-product reward is 0 for a barely trained model)."""
    ext = sample.extensions.get("multi_turn")
    return None if ext is None else float(ext["tool_calls"] > 0)


@hookimpl
def miles_loss(batch, logprobs):
    from miles_plugin_tool_use.env import tool_tokenizer

    tok = tool_tokenizer()
    lp = logprobs.detach()
    for row, s in enumerate(batch.samples):
        if not s.logprobs:  # a warm-start demonstration: no engine made it
            continue
        r = len(s.response_ids)
        trained = batch.loss_mask[row, :r].bool()
        diff = (lp[row, :r] - batch.rollout_logprobs[row, :r])[trained].abs()
        tools = [(tok.decode(s.response_ids[a:b]), s.logprobs[a:b]) for a, b in _runs(s.loss_mask)]
        _pending.append({"versions": list(s.weight_versions), "diff": float(diff.max()) if len(diff) else 0.0,
                         "trained": int(trained.sum()), "turns": s.extensions["multi_turn"]["turns"],
                         "status": s.status.value, "rollout_lps": len(s.logprobs) == r == len(s.loss_mask),
                         "tool_frames": [text for text, _ in tools],
                         "tool_lps_zero": all(x == 0.0 for _, lps in tools for x in lps)})
    return None


@hookimpl
def miles_on_step_end(step, metrics):
    """The loss calls of this step: the trainer held version ``weight_version - 1`` during them."""
    if step == 0 or "weight_version" not in metrics:
        _pending.clear()
        return
    with open(os.environ["MILES_TEST_SPY"], "a") as f:
        for row in _pending:
            f.write(json.dumps({**row, "step": step, "trainer_version": metrics["weight_version"] - 1}) + "\n")
    _pending.clear()
