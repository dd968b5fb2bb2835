"""Every default of fitting, tuning, evaluating and the demo, as frozen dataclasses (data).

One home: the library's functions and the ``sgl-kvmap`` command line (its click options'
defaults and ``--help``) read these fields, and write none down themselves. (A hand-off
repair's draft length is ``transfer.Repair``'s own default.)

- ``CalibrationConfig``: how calibration text is read and the closed-form map fitted
  (``calibrate.fit_mapper``).
- ``TuneConfig``: downstream tuning (``tune.tune_mapper``, ``sgl-kvmap tune``).
- ``EvalConfig``: how a map is scored on held-out text (``evaluate.evaluate``, ``sgl-kvmap
  eval``) and timed against re-prefill.
- ``PackRecipe``: how a pack is made, a calibration and an optional tuning; its defaults are
  what ``sgl-kvmap fit`` publishes (``build.build_pack``); ``key`` names it stably (the
  registry keeps the packs built here by it), and ``recipe_summary`` puts the recipe a pack
  records in a few words.
- ``DemoConfig``: the budget of ``sgl-kvmap demo`` (``demo.run_demo``): a recipe and an
  evaluation.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from ..core.errors import KVMapError
from ..core.manifest import MAX_COUNT
from ..core.mapper import KVMapper
from ..models.transfer import Repair

AUTO_K = ("auto", "auto-layer")
CHECKPOINT_EVERY = 64  # windows a fitting process captures between two saves of its statistics


@dataclass(frozen=True)
class CalibrationConfig:
    """How calibration text is read and used.

    tokens: total calibration tokens (train + held-out). window: tokens per forward (each
    window starts at position 0). skip_first: leading tokens of each window left out of the
    statistics (attention sinks). stride: keep every stride-th token. heldout_every: every
    n-th window is held out for choosing k, drawn from every n-th calibration file (files are
    never split between training and held-out). attention_power: weight each token by
    (attention the target pays it, relative to uniform) ** power; 0 = unweighted.
    ridge: lambda on the un-normalised centred Gram,
    or, with ridge_relative, a multiple of its mean diagonal. top_k: an int, "auto" (one k
    for all layers) or "auto-layer" (k per target layer); both autos take the smallest k
    whose held-out R^2 is within k_tolerance of the best. sink_tokens: leading tokens
    the target computes itself at transfer time (recorded in the pack). rank: fit a
    reduced-rank map instead (every target layer reads all source layers through one shared
    projection to ``rank`` dimensions; top_k is then unused): an int, or "auto" (the smallest
    of 128, 256, 512, ... whose held-out R^2 is within k_tolerance of the best, unless the
    k-layer map chosen by top_k beats it by more than k_tolerance: then that one).
    """

    tokens: int = 16384
    window: int = 512
    skip_first: int = 1
    stride: int = 1
    heldout_every: int = 8
    ridge: float = 0.01
    ridge_relative: bool = False
    top_k: int | str = "auto"
    k_tolerance: float = 0.01
    sink_tokens: int = 4
    per_file_tokens: int = 2048
    attention_power: float = 0.0
    rank: int | str | None = None

    def __post_init__(self) -> None:
        if self.rank not in (None, "auto") and not (isinstance(self.rank, int) and self.rank >= 1):
            raise KVMapError(f"rank must be 'auto' or a positive int, got {self.rank!r}")
        if self.top_k not in AUTO_K and not (isinstance(self.top_k, int) and self.top_k >= 1):
            raise KVMapError(f"top_k must be one of {AUTO_K} or a positive int, got {self.top_k!r}")
        if self.tokens < 2 * self.window:
            raise KVMapError(
                f"need at least two windows of calibration ({2 * self.window} tokens), "
                f"got {self.tokens}"
            )
        if not 0 <= self.skip_first < self.window or self.stride < 1 or self.heldout_every < 2:
            raise KVMapError("invalid skip_first / stride / heldout_every")
        if self.attention_power < 0:
            raise KVMapError(f"attention_power must be >= 0, got {self.attention_power}")
        # the limits a pack's reader applies (core.manifest), checked before any work
        if not 0 <= self.sink_tokens <= MAX_COUNT:
            raise KVMapError(f"sink_tokens must be 0 to {MAX_COUNT}, got {self.sink_tokens}")
        for name in ("top_k", "rank"):
            value = getattr(self, name)
            if isinstance(value, int) and value > MAX_COUNT:
                raise KVMapError(f"{name} must be at most {MAX_COUNT}, got {value}")
        if not (math.isfinite(self.ridge) and self.ridge >= 0):
            raise KVMapError(f"ridge must be a finite number >= 0, got {self.ridge}")


OBJECTIVES = ("nll", "kl")
# the relative rate each map family takes when TuneConfig.lr is None: the rates that tuned the
# real pair's maps smoothly. A reduced-rank map's shared projection moves every target layer
# at once, and 1e-4 threw it off where a lower rate tuned it (see docs/LOG.md).
FAMILY_RATES = {"k-layer": 1e-4, "reduced-rank": 3e-5}


@dataclass(frozen=True)
class TuneConfig:
    """How to tune. Each step reads one window of ``prompt_len + continuation`` calibration
    tokens (training files only): the prompt is translated, the loss is the target's mean
    cross-entropy on the ``continuation`` tokens after it (``objective="nll"``) or the mean
    KL divergence of its next-token distribution there from the one it has on its own cache of
    the prompt (``"kl"``). Held-out windows always score the NLL on the true tokens.
    Adam with a relative learning rate: each tensor's step size is ``lr`` x its RMS before
    tuning (a reduced-rank map's per-layer weights are much smaller than a k-layer map's, and
    its biases of K much larger: one absolute rate cannot suit them all; see docs/LOG.md).
    ``lr=None``: the mapper family's rate (``FAMILY_RATES``).
    The rate rises linearly over the first ``warmup`` steps (Adam's first steps move every
    weight by about the full rate, whatever its gradient's size; without warmup they threw a
    reduced-rank map off: see docs/LOG.md).
    ``tail``: the hand-off recomputes the prompt's last ``tail`` tokens (``transfer.handoff``'s
    tail) in training and held-out scoring alike, so the map is tuned for that hand-off.
    Every ``eval_every`` steps (and at the end) the map is scored on ``heldout_windows``
    windows from the held-out files (every ``heldout_every``-th file, as the fit splits them).
    ``residual_hidden`` > 0: a reduced-rank map without a residual gets one of that width
    (``residual.initial_residual``: zero output, so step 0 is the fitted map), trained with
    the rest; its output matrices step as far in output as the linear weights of their layer.
    """

    steps: int = 60
    lr: float | None = None
    prompt_len: int = 1024
    continuation: int = 128
    eval_every: int = 15
    heldout_windows: int = 6
    heldout_every: int = CalibrationConfig.heldout_every
    per_file_tokens: int = 4096
    objective: str = "nll"
    warmup: int = 20
    tail: int = 0
    residual_hidden: int = 0

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise KVMapError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.steps < 1 or self.eval_every < 1 or self.heldout_windows < 1:
            raise KVMapError(f"need steps, eval_every and heldout_windows >= 1, got {self}")
        if self.warmup < 0 or self.residual_hidden < 0:
            raise KVMapError(f"need warmup and residual_hidden >= 0, got {self}")
        if not 0 <= self.tail < self.prompt_len - 1:
            raise KVMapError(f"need 0 <= tail < prompt_len - 1, got {self.tail}")
        if (self.lr is not None and self.lr <= 0) or self.prompt_len < 2 or self.continuation < 1:
            raise KVMapError(f"need lr > 0, prompt_len >= 2 and continuation >= 1, got {self}")

    def for_mapper(self, mapper: KVMapper) -> TuneConfig:
        """This config with ``lr`` set to ``mapper``'s family rate if it is None."""
        if self.lr is not None:
            return self
        return replace(self, lr=FAMILY_RATES[family(mapper)])


def family(mapper: KVMapper) -> str:
    """The map's family: "reduced-rank" (a shared projection) or "k-layer" (k source layers)."""
    return "k-layer" if mapper.projections is None else "reduced-rank"


@dataclass(frozen=True)
class EvalConfig:
    """How a map is scored: ``windows`` held-out windows of ``prefix_len + continuation``
    tokens; the target predicts the continuation after the prefix, handed off with ``tail``
    prompt tokens recomputed besides the last one (and, with ``repair``, the repair's anchors),
    and as the engines serve it (``served_page_size``, ``served_tail_pages``:
    ``evaluate.served_split``).
    ``speed_tokens`` > 0: the hand-off is also timed against the target's re-prefill of a prompt
    of that many tokens (0: not timed).
    """

    prefix_len: int = 1024
    continuation: int = 64
    tail: int = 32
    windows: int = 8
    repair: Repair | None = None
    speed_tokens: int = 0
    # the hand-off as sgl-kvmap's engines serve it at sglang-args' defaults (--page-size,
    # --tail-pages): a first page the target computes, whole pages translated, the last pages
    # computed; the figure their quality floor reads (sglang.settings)
    served_page_size: int = 16
    served_tail_pages: int = 3

    def __post_init__(self) -> None:
        if self.prefix_len < 2 or self.continuation < 1 or self.windows < 1:
            raise KVMapError(f"need prefix_len >= 2, continuation >= 1 and windows >= 1: {self}")
        if not 0 <= self.tail < self.prefix_len - 1:
            raise KVMapError(f"need 0 <= tail < prefix_len - 1, got tail {self.tail}")
        if self.speed_tokens < 0 or self.speed_tokens == 1:
            raise KVMapError(f"speed_tokens is 0 (not timed) or a prompt of >= 2 tokens: {self}")
        if self.served_page_size < 1 or self.served_tail_pages < 0:
            raise KVMapError(f"need served_page_size >= 1 and served_tail_pages >= 0: {self}")


@dataclass(frozen=True)
class PackRecipe:
    """How a pack is made: a map fitted as ``calibration`` says, then tuned as ``tuning`` says
    (None: the closed-form fit as it is). The defaults are what ``sgl-kvmap fit`` publishes:
    the calibration budget that won on the pair, a reduced-rank map (it beats k-layer maps at
    that budget), tuned 120 steps on the code corpus, the best measured on the pair
    (docs/LOG.md)."""

    calibration: CalibrationConfig = CalibrationConfig(tokens=131072, rank="auto")
    tuning: TuneConfig | None = TuneConfig(steps=120)

    def __post_init__(self) -> None:
        if not isinstance(self.calibration, CalibrationConfig):
            raise KVMapError(f"calibration must be a CalibrationConfig, got {self.calibration!r}")
        if self.tuning is not None and not isinstance(self.tuning, TuneConfig):
            raise KVMapError(f"tuning must be a TuneConfig or None, got {self.tuning!r}")

    def key(self) -> str:
        """This recipe's stable identity: a readable name, then the first 12 hex digits of the
        sha256 of the recipe's canonical JSON (every field, defaults included, so recipes that
        differ in any field get different keys), e.g. ``128k-rank-auto-tuned-120-0123456789ab``.
        """
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return f"{self._name()}-{hashlib.sha256(canonical.encode()).hexdigest()[:12]}"

    def _name(self) -> str:
        """The readable part of ``key``: calibration tokens, map family, tuning steps."""
        tokens, rank = self.calibration.tokens, self.calibration.rank
        budget = f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)
        layers = f"top-k-{self.calibration.top_k}" if rank is None else f"rank-{rank}"
        tuned = "untuned" if self.tuning is None else f"tuned-{self.tuning.steps}"
        return f"{budget}-{layers}-{tuned}"


def recipe_summary(record: dict[str, Any]) -> str:
    """The recipe a pack records (its kvmap.json's ``calibration``: what ``fit_mapper`` and
    ``tune_mapper`` write) in a few words, e.g. ``131,072 calibration tokens, rank auto, tuned
    120 steps``; "not recorded" when it holds none."""
    if not isinstance(record, dict) or not isinstance(record.get("tokens"), int):
        return "not recorded"
    rank, tuning = record.get("rank"), record.get("tuning")
    shape = f"top-k {record.get('top_k', '?')}" if rank is None else f"rank {rank}"
    tuned = f"tuned {tuning.get('steps', '?')} steps" if isinstance(tuning, dict) else "not tuned"
    return f"{record['tokens']:,} calibration tokens, {shape}, {tuned}"


@dataclass(frozen=True)
class DemoConfig:
    """The demo's budget: both directions made as ``recipe`` says (the fits share one capture
    pass), then evaluated and timed as ``evaluation`` says (``speed_tokens``: the prompt the
    hand-off is timed at). By default a reduced-rank map at the calibration's default budget
    (16k tokens: it wins there too, docs/LOG.md), not tuned, and the repaired hand-off of 240
    anchors by a 2-token draft, the best measured quality at the lowest cost (docs/LOG.md)."""

    recipe: PackRecipe = PackRecipe(CalibrationConfig(rank="auto"), tuning=None)
    evaluation: EvalConfig = EvalConfig(repair=Repair(anchors=240), speed_tokens=2048)

    def __post_init__(self) -> None:
        if not isinstance(self.recipe, PackRecipe) or not isinstance(self.evaluation, EvalConfig):
            raise KVMapError(f"need a PackRecipe and an EvalConfig, got {self!r}")
        if not self.evaluation.speed_tokens:
            raise KVMapError("the demo times the hand-off: need evaluation.speed_tokens >= 2")
