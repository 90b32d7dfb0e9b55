"""A launch-time plugin for the GPU GRPO test: reward 1 when the first response token id is even.
A random-weight model never solves arithmetic (reward always 0, no gradient); this reward gives
every group a spread, so the run has a policy gradient to follow and a reward it can raise."""
from miles import hookimpl


@hookimpl
def miles_reward(sample):
    return float(bool(sample.response_ids) and sample.response_ids[0] % 2 == 0)
