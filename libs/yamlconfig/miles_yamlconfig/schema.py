"""Raw config sections checked against pydantic schemas; every problem is a string that starts
with the dotted key it is about (``trainer.lr: ...``), collected rather than raised, so a caller
reports all of them at once."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError


def validate_settings(model: type[BaseModel] | None, prefix: str, raw: dict, problems: list[str]) -> Any:
    """``raw`` validated by ``model`` (``None``: a component without settings), or ``None`` with
    the problems, each named ``prefix.<key>``, appended to ``problems``."""
    if model is None:
        if raw:
            problems.append(f"{prefix}: takes no settings; unknown keys: {', '.join(raw)}")
        return None
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        problems.extend(pydantic_problems(prefix, e, model))
        return None


def section_mapping(data: dict[str, Any], section: str, problems: list[str]) -> dict[str, Any]:
    """A copy of ``data[section]`` (absent: empty); a section that is not a mapping is a problem."""
    raw = data.get(section) or {}
    if not isinstance(raw, dict):
        problems.append(f"{section}: must be a mapping of keys to values (got {raw!r})")
        return {}
    return dict(raw)


def pydantic_problems(prefix: str, err: ValidationError, model: type[BaseModel] | None) -> list[str]:
    """One line per error of ``err``: its dotted key, then pydantic's message and the value given;
    an unknown key lists the keys allowed at that level."""
    out = []
    for e in err.errors():
        loc = ".".join(str(x) for x in (prefix, *e["loc"]) if x != "")
        if e["type"] == "extra_forbidden":
            allowed = ", ".join(sorted(_fields_at(model, e["loc"][:-1])))
            out.append(f"{loc}: unknown key; allowed keys: {allowed}")
        else:
            got = e.get("input")
            got = "" if isinstance(got, dict) else f" (got {got!r})"
            out.append(f"{loc}: {e['msg']}{got}")
    return out


def _fields_at(model: Any, loc: tuple) -> list[str]:
    """The field names of the (nested) schema at ``loc``, through optional/union annotations."""
    for part in loc:
        info = getattr(model, "model_fields", {}).get(part)
        ann = getattr(info, "annotation", None)
        model = next((a for a in getattr(ann, "__args__", (ann,)) if hasattr(a, "model_fields")), None)
    return list(getattr(model, "model_fields", {}) or ["name"])
