"""``miles_model``: a NeMo Gym model server for a policy served by ``miles serve``.

NeMo Gym's ``vllm_model`` server turns Responses API calls into chat completions and, for
training, reads token ids from vLLM-specific fields (``token_id:N`` strings, a ``/tokenize``
route). ``miles serve`` returns the same data in SGLang's shape instead: each choice carries
``token_ids``, ``prompt_token_ids`` and per-token log-probs. This server is ``vllm_model`` with
a client that moves those onto the message as ``prompt_token_ids``, ``generation_token_ids`` and
``generation_log_probs``, the fields NeMo Gym's converter puts on training output items.
"""
from nemo_gym.openai_utils import NeMoGymAsyncOpenAI

from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig


class MilesModelConfig(VLLMModelConfig):
    pass


class MilesServeClient(NeMoGymAsyncOpenAI):
    async def create_chat_completion(self, **kwargs):
        out = await super().create_chat_completion(**kwargs)
        for choice in out.get("choices") or []:
            ids, prompt = choice.get("token_ids"), choice.get("prompt_token_ids")
            content = (choice.get("logprobs") or {}).get("content")
            if not isinstance(ids, list) or not isinstance(prompt, list) or content is None:
                raise RuntimeError(f"{self.base_url} answered without token ids or log-probs "
                                   f"(keys {sorted(choice)}); is it `miles serve`?")
            logprobs = [float(c["logprob"]) for c in content]
            if len(logprobs) != len(ids):
                raise RuntimeError(f"{self.base_url}: {len(ids)} token ids but {len(logprobs)} log-probs")
            choice["message"].update(prompt_token_ids=prompt, generation_token_ids=ids,
                                     generation_log_probs=logprobs)
            choice.pop("logprobs", None)
        return out


class MilesModel(VLLMModel):
    config: MilesModelConfig

    def _post_init(self) -> None:
        super()._post_init()
        self._clients = [MilesServeClient(base_url=url, api_key=self.config.api_key,
                                          default_headers=self.config.default_headers)
                         for url in self.config.base_url]


if __name__ == "__main__":
    MilesModel.run_webserver()
