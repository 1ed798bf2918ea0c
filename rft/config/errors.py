"""The one error every config check raises."""

from __future__ import annotations

from typing import Any


def config_error(key: str, value: Any, fix: str) -> None:
    """Raise the ValueError every config check uses: the key, its value, and how to fix it."""
    raise ValueError(f"{key}={value!r} is invalid: {fix}")
