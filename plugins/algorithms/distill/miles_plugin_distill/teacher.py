"""The teacher: a Hugging Face causal LM that scores the student's samples token by token."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from miles import Batch, MilesError, Sample


class Teacher:
    """Loaded from a local folder on first use; ``logprobs`` is no-grad, in eval mode."""

    def __init__(self, path: str, device: str = "cpu", batch_size: int = 512):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = torch.device("cuda" if device == "auto" and torch.cuda.is_available()
                                   else ("cpu" if device == "auto" else device))
        self.model = AutoModelForCausalLM.from_pretrained(path).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.batch_size = batch_size
        self.path = path
        self.checked = False

    def _check_vocabulary(self, samples: Sequence[Sample]) -> None:
        """The teacher scores the student's token ids, so both must mean the same text by them:
        the teacher's tokenizer must decode a few responses to the text the student produced."""
        vocab = self.model.config.vocab_size
        for s in samples[:8]:
            ids = list(s.prompt_ids) + list(s.response_ids)
            if ids and max(ids) >= vocab:
                raise MilesError(f"teacher {self.path} has {vocab} tokens but the student produced id "
                                 f"{max(ids)}: teacher and student need the same tokenizer")
            text = self.tokenizer.decode(s.response_ids, skip_special_tokens=True)
            if s.response and text.strip() != s.response.strip():
                raise MilesError(f"teacher {self.path} decodes the student's tokens to {text!r}, the "
                                 f"student to {s.response!r}: teacher and student need the same tokenizer")
        self.checked = True

    @torch.no_grad()
    def logprobs(self, samples: Sequence[Sample]) -> list[list[float]]:
        """Per sample, the teacher's log-probability (temperature 1) of each response token."""
        if not self.checked:
            self._check_vocabulary(samples)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        out: list[list[float]] = []
        for i in range(0, len(samples), self.batch_size):
            chunk = list(samples[i:i + self.batch_size])
            b = Batch.from_samples(chunk, pad)
            P = b.prompt_len
            logits = self.model(input_ids=b.input_ids.to(self.device),
                                attention_mask=b.attention_mask.to(self.device),
                                position_ids=b.position_ids.to(self.device), use_cache=False).logits
            logits = logits[:, P - 1:-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, b.input_ids[:, P:, None].to(self.device))
            rows = lp.squeeze(-1).cpu().tolist()
            out += [row[:len(s.response_ids)] for row, s in zip(rows, chunk)]
        return out
