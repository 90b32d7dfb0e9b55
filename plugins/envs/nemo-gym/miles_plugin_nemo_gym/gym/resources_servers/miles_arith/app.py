"""``miles_arith``: a NeMo Gym resources server that scores sums.

Each row carries ``expected_answer`` (the digits of ``a+b``); ``/verify`` reads the text of the
policy's last assistant message and rewards 1.0 when, stripped, it equals the answer, else 0.0.
Runs in NeMo Gym's own Python (>= 3.12) virtualenv, started by ``ng_run``.
"""
from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)


class MilesArithConfig(BaseResourcesServerConfig):
    pass


class ArithVerifyRequest(BaseVerifyRequest):
    expected_answer: str


class ArithVerifyResponse(BaseVerifyResponse):
    expected_answer: str
    answer: str


def last_assistant_text(response) -> str:
    """The text of the last assistant message (function calls and tool outputs are skipped)."""
    text = ""
    for item in response.output:
        if getattr(item, "type", None) == "message" and getattr(item, "role", None) == "assistant":
            text = "".join(getattr(part, "text", "") or "" for part in item.content)
    return text


class MilesArithServer(SimpleResourcesServer):
    config: MilesArithConfig

    async def verify(self, body: ArithVerifyRequest) -> ArithVerifyResponse:
        answer = last_assistant_text(body.response).strip()
        reward = 1.0 if answer == body.expected_answer.strip() else 0.0
        return ArithVerifyResponse(**body.model_dump(), answer=answer, reward=reward)


if __name__ == "__main__":
    MilesArithServer.run_webserver()
