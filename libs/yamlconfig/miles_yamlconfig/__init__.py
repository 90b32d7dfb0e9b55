"""A run's configuration before miles' own schemas resolve it: one YAML file plus ``key.sub=value``
overrides (``files``), and raw sections checked against pydantic schemas, every problem named by
its dotted key (``schema``)."""
from .files import apply_overrides, read_yaml
from .schema import pydantic_problems, section_mapping, validate_settings

__all__ = ["read_yaml", "apply_overrides", "validate_settings", "section_mapping", "pydantic_problems"]
