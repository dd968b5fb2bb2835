"""Side-by-side timing of a hand-off through a translated cache against the target's re-prefill.

Both paths end in the same state: the target holds a cache for the whole prompt and the
logits of its last token. Re-prefill is one forward over the prompt. The translated path is
the map and ONE target forward (``transfer.handoff``) over the sink tokens, the ``tail`` and
the last prompt token (and, with a ``Repair``, the anchors, after the source's draft picks
them). What the sinks cost is measured as what they add to that forward (the same forward
without them, side by side), and, for comparison, as a forward of their own.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from ..core.mapper import KVMapper
from .capture import LoadedModel, capture_kv, forward_scattered, run
from .transfer import (
    Repair,
    draft_anchors,
    handoff,
    handoff_positions,
    handoff_split,
    mapped_prefix,
)


@dataclass
class SpeedReport:
    """Seconds (medians of ``repeats``) for one prompt of ``tokens`` tokens on this machine.

    map_seconds: the map and the target's own layer 0 (``transfer.mapped_prefix``).
    handoff_seconds: the target's one forward over sinks + anchors + tail + last prompt token.
    sink_seconds: what the sinks add to it (that forward minus the same one without sinks,
    floored at 0). separate_sink_seconds: a forward over the sinks alone (the unfused way).
    draft_seconds: the source's draft that picks the anchors (0 without repair); anchors: how
    many translated tokens the hand-off forward recomputes besides the sinks.
    """

    tokens: int
    tail: int
    map_seconds: float
    sink_seconds: float
    handoff_seconds: float
    prefill_seconds: float
    repeats: int
    separate_sink_seconds: float = 0.0
    draft_seconds: float = 0.0
    anchors: int = 0

    @property
    def translate_seconds(self) -> float:
        """Map + what the target's sink tokens cost."""
        return self.map_seconds + self.sink_seconds

    @property
    def total_seconds(self) -> float:
        """Everything the translated path runs: the map, the draft and the hand-off forward."""
        return self.map_seconds + self.draft_seconds + self.handoff_seconds

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

    def line(self) -> str:
        """One human-readable line: re-prefill against the translated path."""
        return (
            f"cost at {self.tokens} tokens on this machine: re-prefill {self.prefill_seconds:.3f} s"
            f"; map + sinks {self.translate_seconds:.3f} s ({self.speedup:.1f}x); translated path "
            f"(draft, {self.anchors} anchors, {self.tail}-token tail) {self.total_seconds:.3f} s "
            f"({self.end_to_end_speedup:.1f}x)"
        )


def measure_speed(
    mapper: KVMapper,
    source: LoadedModel,
    target: LoadedModel,
    token_ids: torch.Tensor,
    repeats: int = 3,
    tail: int = 0,
    prefill_seconds: float | None = None,
    repair: Repair | None = None,
) -> SpeedReport:
    """Time the translated path vs the target's prefill of ``token_ids: [tokens]``.

    ``prefill_seconds``: a prefill time already measured for this target and prompt (it does
    not depend on the mapper), to skip measuring it again.
    """
    prompt_len = token_ids.numel()
    split = handoff_split(prompt_len, tail)
    source_cache = capture_kv(source.model, token_ids[:split])
    handoff(mapper, source_cache, token_ids, target.model, tail, repair, source.model)  # warm-up
    translate = lambda: mapped_prefix(mapper, source_cache, token_ids[:split], target.model)  # noqa: E731
    mapped = translate()
    anchors, draft_seconds = None, 0.0
    if repair is not None and repair.anchors:
        pick = lambda: draft_anchors(source.model, source_cache, token_ids, repair, tail, mapper)  # noqa: E731
        anchors, draft_seconds = pick(), median_seconds(pick, repeats)
    fused = handoff_positions(prompt_len, tail, mapper.sink_tokens, anchors)
    rest = handoff_positions(prompt_len, tail, 0, anchors)
    handoff_seconds = median_seconds(
        lambda: forward_scattered(target.model, mapped, token_ids, fused, 1), repeats
    )
    without_sinks = median_seconds(
        lambda: forward_scattered(target.model, mapped, token_ids, rest, 1), repeats
    )
    sinks = token_ids[: min(mapper.sink_tokens, split)]
    return SpeedReport(
        tokens=prompt_len,
        tail=tail,
        map_seconds=median_seconds(translate, repeats),
        sink_seconds=max(0.0, handoff_seconds - without_sinks) if sinks.numel() else 0.0,
        handoff_seconds=handoff_seconds,
        prefill_seconds=prefill_seconds
        or median_seconds(
            lambda: run(target.model, token_ids, logits_to_keep=1), max(1, repeats - 1)
        ),
        repeats=repeats,
        separate_sink_seconds=median_seconds(lambda: capture_kv(target.model, sinks), repeats)
        if sinks.numel()
        else 0.0,
        draft_seconds=draft_seconds,
        anchors=0 if anchors is None else anchors.numel(),
    )


def median_seconds(fn, repeats: int) -> float:
    """The median wall time of ``repeats`` calls of ``fn``."""
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)
