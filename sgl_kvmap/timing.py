"""Side-by-side timing of a hand-off through a translated cache against the target's re-prefill.

Both paths end in the same state: the target holds a cache for the whole prompt and the
logits of its last token. Re-prefill is one forward over the prompt. The translated path is
the map, the target's forward over its sink tokens, and its forward over the last
``tail + 1`` prompt tokens on top of the translated cache (the hand-off).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from .capture import LoadedModel, capture_kv, run
from .mapper import KVMapper
from .transfer import handoff_split, translate_prefix


@dataclass
class SpeedReport:
    """Seconds (medians of ``repeats``) for one prompt of ``tokens`` tokens on this machine."""

    tokens: int
    tail: int
    map_seconds: float
    sink_seconds: float
    handoff_seconds: float
    prefill_seconds: float
    repeats: int

    @property
    def translate_seconds(self) -> float:
        """Map + the target's sink tokens."""
        return self.map_seconds + self.sink_seconds

    @property
    def total_seconds(self) -> float:
        """Everything the translated path runs: map, sinks, and the hand-off forward."""
        return self.translate_seconds + self.handoff_seconds

    @property
    def speedup(self) -> float:
        """Re-prefill over map + sinks (the cache translation alone)."""
        return self.prefill_seconds / self.translate_seconds

    @property
    def map_speedup(self) -> float:
        return self.prefill_seconds / self.map_seconds

    @property
    def end_to_end_speedup(self) -> float:
        """Re-prefill over the whole translated path, hand-off forward included."""
        return self.prefill_seconds / self.total_seconds

    def to_dict(self) -> dict:
        derived = (
            "translate_seconds",
            "total_seconds",
            "speedup",
            "map_speedup",
            "end_to_end_speedup",
        )
        return {**asdict(self), **{name: getattr(self, name) for name in derived}}


def measure_speed(
    mapper: KVMapper,
    source: LoadedModel,
    target: LoadedModel,
    token_ids: torch.Tensor,
    repeats: int = 3,
    tail: int = 0,
    prefill_seconds: float | None = None,
) -> SpeedReport:
    """Time the translated path vs the target's prefill of ``token_ids: [tokens]``.

    ``prefill_seconds``: a prefill time already measured for this target and prompt (it does
    not depend on the mapper), to skip measuring it again.
    """
    split = handoff_split(token_ids.numel(), tail)
    source_cache = capture_kv(source.model, token_ids[:split])
    translated = translate_prefix(mapper, source_cache, token_ids[:split], target.model)  # warm-up
    sinks = token_ids[: mapper.sink_tokens]
    return SpeedReport(
        tokens=token_ids.numel(),
        tail=tail,
        map_seconds=_timed(lambda: mapper.map(source_cache), repeats),
        sink_seconds=_timed(lambda: capture_kv(target.model, sinks), repeats)
        if sinks.numel()
        else 0.0,
        handoff_seconds=_timed(
            lambda: run(target.model, token_ids[split:], past=translated, logits_to_keep=1), repeats
        ),
        prefill_seconds=_timed(
            lambda: run(target.model, token_ids, logits_to_keep=1), max(1, repeats - 1)
        ),
        repeats=repeats,
    )


def _timed(fn, repeats: int) -> float:
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)
