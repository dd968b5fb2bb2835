"""JSON as files from outside are read here: numbers must be finite."""

from __future__ import annotations

import json
import math
from typing import Any


def loads_finite(text: str | bytes) -> Any:
    """``json.loads``, refusing what Python's reader lets through but no file of ours holds:
    NaN and infinities (``1e400``), and nesting too deep to read. Raises ValueError (also for
    bytes that are not UTF-8)."""
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range")
    return value
