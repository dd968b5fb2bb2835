"""Side-by-side timing of translating a prefix against the target re-running prefill."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from .capture import LoadedModel, capture_kv
from .mapper import KVMapper
from .transfer import translate_prefix


@dataclass
class SpeedReport:
    """Seconds (median of ``repeats``) for one prefix of ``tokens`` tokens on this machine."""

    tokens: int
    map_seconds: float
    sink_seconds: float
    prefill_seconds: float
    repeats: int

    @property
    def translate_seconds(self) -> float:
        return self.map_seconds + self.sink_seconds

    @property
    def speedup(self) -> float:
        """Target re-prefill time over translate time (map + the target's sink tokens)."""
        return self.prefill_seconds / self.translate_seconds

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "translate_seconds": self.translate_seconds,
            "speedup": self.speedup,
        }


def measure_speed(
    mapper: KVMapper,
    source: LoadedModel,
    target: LoadedModel,
    token_ids: torch.Tensor,
    repeats: int = 3,
) -> SpeedReport:
    """Time translate_prefix (map + sinks) vs target prefill of ``token_ids: [tokens]``."""
    source_cache = capture_kv(source.model, token_ids)
    translate_prefix(mapper, source_cache, token_ids, target.model)  # warm-up
    maps = _timed(lambda: mapper.map(source_cache), repeats)
    sinks = (
        _timed(lambda: capture_kv(target.model, token_ids[: mapper.sink_tokens]), repeats)
        if mapper.sink_tokens
        else 0.0
    )
    prefill = _timed(lambda: capture_kv(target.model, token_ids), max(1, repeats - 1))
    return SpeedReport(token_ids.numel(), maps, sinks, prefill, repeats)


def _timed(fn, repeats: int) -> float:
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)
