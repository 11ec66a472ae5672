"""Parsing of the environment variables the plugin falls back to (Accelerate's convention for plugin fields)."""

from __future__ import annotations

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_bool(value: str | bool, name: str) -> bool:
    """``value`` as a bool, accepting the spellings environment variables use; a clear error for anything else."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"{name} must be a boolean (1/0, true/false, yes/no, on/off), got {value!r}.")
