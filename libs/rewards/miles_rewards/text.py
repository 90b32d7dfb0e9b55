"""String rewards: ``exact`` (normalised match), ``choice`` (a multiple-choice letter) and ``regex``
(an answer pulled out by a pattern, with an optional format check)."""
from __future__ import annotations

import re
import string
import unicodedata
from typing import Any, Mapping

from .base import RewardConfigError, RewardResult
from .settings import ChoiceSettings, ExactSettings, RegexSettings

_PUNCT = str.maketrans("", "", string.punctuation)
_SPACES = re.compile(r"\s+")


def normalize(text: Any, case_sensitive: bool = False, ignore_punctuation: bool = True) -> str:
    """``text`` with Unicode compatibility forms folded, whitespace collapsed and, by default,
    case and ASCII punctuation dropped (``" The  Answer." -> "the answer"``)."""
    out = unicodedata.normalize("NFKC", str(text))
    if not case_sensitive:
        out = out.casefold()
    if ignore_punctuation:
        out = out.translate(_PUNCT)
    return _SPACES.sub(" ", out).strip()


def answers(label: Any) -> list[str]:
    """The acceptable answers of a label: a list of them, or one value."""
    if label is None:
        return []
    return [str(x) for x in label] if isinstance(label, (list, tuple)) else [str(label)]


class ExactReward:
    """1 when the response, normalised, equals the label (or one of a list of labels)."""

    name = "exact"
    metric_names = ("exact_empty",)

    def __init__(self, cfg: ExactSettings) -> None:
        self.cfg = cfg

    def norm(self, text: Any) -> str:
        return normalize(text, self.cfg.case_sensitive, self.cfg.ignore_punctuation)

    def __call__(self, response: str, label: Any = None, metadata: Mapping[str, Any] | None = None, *,
                 prompt: Any = None) -> RewardResult:
        got = self.norm(response)
        ok = bool(got) and got in {self.norm(a) for a in answers(label)}
        return RewardResult(float(ok), {"exact_empty": float(not got)}, got or None)


class ChoiceReward:
    """1 when the option letter the response names is the label's. The letter is read from, in
    order: the last ``answer is X`` / ``answer: X``, the last ``\\boxed{X}``, a response that is
    only the letter (``"B"``, ``"(B)"``, ``"B."``), a response that starts with it (``"B) ..."``)."""

    name = "choice"
    metric_names = ("choice_extract_failed",)

    def __init__(self, cfg: ChoiceSettings) -> None:
        self.letters = cfg.letters.upper()
        cls = f"[{re.escape(self.letters)}]"
        # after "answer" and at the start only a capital letter counts ("the answer is a bit")
        self._patterns = [
            re.compile(rf"(?i:answer)(?:\s+(?i:is))?[\s*:：]*\(?({cls})\)?(?![A-Za-z])"),
            re.compile(rf"\\boxed\{{\s*(?:\\text\{{)?\(?({cls})\)?\}}?\s*\}}", re.IGNORECASE),
            re.compile(rf"^\s*\(?({cls})\)?[.:]?\s*$", re.IGNORECASE),
            re.compile(rf"^\s*\(?({cls})[).:](?:\s|$)"),
        ]

    def letter(self, response: str) -> str | None:
        """The letter the response names, upper case, or None."""
        for pat in self._patterns:
            found = pat.findall(response)
            if found:
                return found[-1].upper()
        return None

    def gold(self, label: Any) -> str:
        if isinstance(label, int) and not isinstance(label, bool) and 0 <= label < len(self.letters):
            return self.letters[label]
        text = str(label).strip().strip("()").upper()
        if text not in self.letters or len(text) != 1:
            raise RewardConfigError(f"choice label {label!r} is not one of the letters {self.letters} nor an "
                                    f"index into them; fix the row's label")
        return text

    def __call__(self, response: str, label: Any = None, metadata: Mapping[str, Any] | None = None, *,
                 prompt: Any = None) -> RewardResult:
        got = self.letter(response)
        return RewardResult(float(got is not None and got == self.gold(label)),
                            {"choice_extract_failed": float(got is None)}, got)


class RegexReward:
    """The first group of ``pattern``'s last match (or the whole match) against the label; with no
    label, 1 for a match. ``format_pattern`` must match the whole response; it gives
    ``format_weight`` of the score."""

    name = "regex"
    metric_names = ("regex_no_match", "regex_format_ok")

    def __init__(self, cfg: RegexSettings) -> None:
        self.cfg = cfg
        self.pattern = _compile(cfg.pattern, "pattern", re.DOTALL)
        self.format = _compile(cfg.format_pattern, "format_pattern", re.DOTALL) if cfg.format_pattern else None

    def extract(self, response: str) -> str | None:
        matches = list(self.pattern.finditer(response))
        if not matches:
            return None
        m = matches[-1]
        return next((g for g in m.groups() if g is not None), m.group(0)) if m.groups() else m.group(0)

    def __call__(self, response: str, label: Any = None, metadata: Mapping[str, Any] | None = None, *,
                 prompt: Any = None) -> RewardResult:
        got = self.extract(response)
        if got is None:
            correct = False
        elif label is None:
            correct = True
        else:
            norm = lambda t: normalize(t, self.cfg.case_sensitive, ignore_punctuation=False)  # noqa: E731
            correct = norm(got) in {norm(a) for a in answers(label)}
        metrics = {"regex_no_match": float(got is None)}
        w = self.cfg.format_weight if self.format is not None else 0.0
        score = float(correct)
        if self.format is not None:
            fmt = self.format.fullmatch(response.strip()) is not None
            metrics["regex_format_ok"] = float(fmt)
            score = (1 - w) * score + w * float(fmt)
        answer = None if got is None else normalize(got, self.cfg.case_sensitive, ignore_punctuation=False)
        return RewardResult(score, metrics, answer)


def _compile(pattern: str | None, key: str, flags: int) -> re.Pattern:
    try:
        return re.compile(pattern or "", flags)
    except re.error as e:
        raise RewardConfigError(f"reward 'regex': {key} {pattern!r} is not a valid regular expression ({e})") from None
