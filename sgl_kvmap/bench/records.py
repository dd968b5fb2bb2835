"""What the benchmark measures for one request: ``RequestRecord``, one line of the run's JSONL.

Tiers (where a prompt token's KV came from), in the order a server looks:
``device`` (the engine's radix tree on the accelerator), ``host`` (its HiCache host pool),
``storage`` (pages the engine itself wrote to the shared store), ``translated`` (pages another
model wrote, translated by sgl-kvmap) and ``computed`` (prefilled by the engine).
For every record ``sum(reused.values()) + computed == prompt_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from .workload import common_prefix_length

TIERS = ("device", "host", "storage", "translated")
MODES = ("reprefill", "translated", "tail")  # how a swapped request's prefix is served
MODE_TITLES = {
    "reprefill": "re-prefill (HiCache, no packs)",
    "translated": "translated",
    "tail": "translated + tail",
}
REFERENCE_MODE = "reprefill"  # the target on its own cache: the quality reference
TRANSLATING_MODES = tuple(m for m in MODES if m != REFERENCE_MODE)
STAGES = {  # where a request's time to first token went (RequestRecord.stages), in seconds
    "primed": "its first page served just before it (priming), round trip included",
    "prefetch": "in process: from its arrival until the scheduler saw its storage prefetch done",
    "hit_query": "the store's hit query: own pages, the peer's records, the translation started",
    "read": "reading the peer's pages (a worker, during the prefetch)",
    "map": "translating the peer's pages (a worker, during the prefetch)",
    "wait": "the transfer waiting for the translation",
    "write": "copying translated pages into the host pool",
    "native": "copying the engine's own stored pages into the host pool",
    "load": "in process: admission, allocation and the host -> device load",
    "forward": "in process: the prefill of the computed tokens and the first token",
}


BASELINES = ("reference", "source", "no_prefix")
BASELINE_TITLES = {
    "reference": "the target re-prefilled",
    "source": "staying on the source model",
    "no_prefix": "the target without the history",
}


@dataclass
class Scores:
    """Teacher-forced scores on a request's true continuation (``Turn.continuation``): top-1
    next-token accuracy and mean negative log-likelihood (nats/token)."""

    accuracy: float
    nll: float


@dataclass
class Quality:
    """A swapped request's answer under one mode's cache, beside the baselines a user weighs.

    On the trace's true continuation (``continuation_tokens`` tokens of held-out text after the
    prompt): ``continuation``, this mode's scores, and ``baselines``, the same request's scores
    under each of ``BASELINES``: ``reference`` (the target on its own cache, the re-prefill
    replay), ``source`` (the model the session was on, which the swap left: staying there) and
    ``no_prefix`` (the target on this turn's new tokens alone).

    Against re-prefill's greedy answer: ``agreement`` is the share of its first ``tokens``
    tokens that this mode's greedy answer reproduces before it first departs from it
    (``agreement``); ``nll`` the teacher-forced mean NLL (nats/token) of that answer under this
    mode's cache, ``reference_nll`` the same under re-prefill's own cache."""

    tokens: int
    agreement: float
    nll: float
    reference_nll: float
    continuation_tokens: int = 0
    continuation: Scores | None = None
    baselines: dict[str, Scores] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict) -> Quality:
        scores = data.get("continuation")
        baselines = data.get("baselines") or {}
        return cls(
            **{
                **data,
                "continuation": Scores(**scores) if scores else None,
                "baselines": {name: Scores(**value) for name, value in baselines.items()},
            }
        )


def agreement(answer: Sequence[int], reference: Sequence[int], tokens: int) -> float:
    """The share of ``reference``'s first ``tokens`` tokens that ``answer`` reproduces before it
    first departs from it: the two answers' common prefix over the reference's length (a
    shorter answer departs where it ends; 1.0 for an empty reference)."""
    n = min(tokens, len(reference))
    return common_prefix_length(answer[:n], reference[:n]) / n if n else 1.0


@dataclass
class RequestRecord:
    """One request of one replay (one routing policy, one mode)."""

    policy: str
    mode: str
    request: int  # index in the replayed slice, arrival order
    session: int
    turn: int  # 0 for a session's first request
    model: str  # the engine that served it ("small" or "large")
    swapped: bool  # served by another model than the session's previous turn
    prompt_tokens: int
    ideal_reuse_tokens: int  # what an oracle cache shared by both models could reuse
    reused: dict[str, int]  # tokens per tier (TIERS)
    computed: int  # tokens prefilled by the engine (``primed`` among them)
    fallbacks: dict[str, int] = field(default_factory=dict)  # untranslated pages, by reason
    ttft_s: float = 0.0  # prefetch + load-back + prefill + the first token
    quality: Quality | None = None  # swapped requests (in the reference mode: its own scores)
    primed: int = 0  # first-page tokens computed just before the request (sglang.priming)
    stages: dict[str, float] = field(default_factory=dict)  # seconds by STAGES, where measured

    def __post_init__(self):
        if set(self.reused) != set(TIERS):
            raise ValueError(
                f"reused must count exactly the tiers {TIERS}, got {sorted(self.reused)}"
            )
        if sum(self.reused.values()) + self.computed != self.prompt_tokens:
            raise ValueError(
                f"request {self.request}: tiers {self.reused} + computed {self.computed} "
                f"!= prompt {self.prompt_tokens}"
            )

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> RequestRecord:
        quality = data.get("quality")
        return cls(**{**data, "quality": Quality.from_json(quality) if quality else None})
