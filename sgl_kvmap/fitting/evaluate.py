"""Fidelity of a mapper on held-out text, always beside the baselines.

For each window of ``prefix_len + continuation`` tokens the target predicts the continuation
(teacher-forced) under six conditions: its own prefix cache (reference), the translated cache
(tail 0), the translated cache with ``tail`` more prompt tokens recomputed by the target, the
hand-off as sgl-kvmap's engines serve it (``served``: the target's own first page, whole pages
translated with layer 0 mapped, the last pages computed: ``served_split``), the SOURCE model
alone, and no prefix at all; with a ``Repair``, also the translated cache with the tail and the
repair's anchors recomputed. Per layer it also reports R^2 of the translated K/V
against the target's true K/V (content space, sinks excluded) and the cosine between the
target's attention outputs over translated vs true KV (true queries, causal).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..core.cache import KVCache
from ..core.errors import KVMapError
from ..core.mapper import KVMapper
from ..core.rope import unrope
from ..core.spec import check_models, tables_for_spec
from ..models.capture import LoadedModel, run
from ..models.transfer import Repair, handoff_split, pick_anchors, translate_prefix
from .config import EvalConfig

INTERVAL_LEVEL = 0.9  # of the ratios' bootstrap intervals over windows
BOOTSTRAP_DRAWS = 4000


@dataclass
class Quality:
    """Top-1 next-token accuracy and mean NLL (nats) over the continuation tokens."""

    accuracy: float
    nll: float


@dataclass
class EvalReport:
    reference: Quality
    mapped: Quality
    mapped_tail: Quality
    source: Quality
    no_prefix: Quality
    r2_k: list[float]
    r2_v: list[float]
    attention_cosine: list[float]
    windows: int
    prefix_len: int
    continuation: int
    tail: int
    sink_tokens: int
    extra: dict = field(default_factory=dict)
    repaired: Quality | None = None
    repair: str | None = None
    served: Quality | None = None
    served_page_size: int | None = None
    served_tail: int | None = None  # tokens
    by_window: list[dict[str, Quality]] = field(default_factory=list)
    """Per window (in order), each condition's Quality: which texts the map fails on."""

    @property
    def retention(self) -> float | None:
        """Translated-cache accuracy over the target's own (None when the target scores 0)."""
        return _ratio(self.mapped, self.reference)

    @property
    def retention_tail(self) -> float | None:
        return _ratio(self.mapped_tail, self.reference)

    @property
    def retention_repaired(self) -> float | None:
        return None if self.repaired is None else _ratio(self.repaired, self.reference)

    @property
    def retention_served(self) -> float | None:
        return None if self.served is None else _ratio(self.served, self.reference)

    @property
    def gap_closed_served(self) -> float | None:
        return None if self.served is None else _gap(self.served, self.source, self.reference)

    @property
    def gap_closed(self) -> float | None:
        return _gap(self.mapped, self.source, self.reference)

    @property
    def gap_closed_tail(self) -> float | None:
        return _gap(self.mapped_tail, self.source, self.reference)

    @property
    def gap_closed_repaired(self) -> float | None:
        return None if self.repaired is None else _gap(self.repaired, self.source, self.reference)

    def intervals(self, level: float = INTERVAL_LEVEL) -> dict[str, tuple[float, float] | None]:
        """Each ratio's percentile-bootstrap interval over the evaluation windows (resampled
        with replacement, paired across conditions; fixed seed): how far 16 windows pin it.
        None where the ratio is undefined or there are no per-window scores."""
        measured = [c for c in CONDITIONS if getattr(self, c) is not None]
        if not self.by_window or any(set(measured) - set(w) for w in self.by_window):
            return {name: None for name in RATIOS}
        accuracy = {
            c: torch.tensor([w[c].accuracy for w in self.by_window], dtype=torch.float64)
            for c in measured
        }
        return {
            name: bootstrap_interval(accuracy, *RATIO_TERMS[name], level)
            if RATIO_TERMS[name][0] in accuracy
            else None
            for name in RATIOS
        }

    def check_finite(self) -> None:
        """Raise KVMapError naming the conditions whose accuracy or NLL is NaN or infinite (a
        cache that overflowed), rather than print ``nan`` as a score."""
        broken = [
            name
            for name in CONDITIONS
            if (quality := getattr(self, name)) is not None
            and not (math.isfinite(quality.accuracy) and math.isfinite(quality.nll))
        ]
        if broken:
            raise KVMapError(
                f"the evaluation of {', '.join(broken)} is not finite (NaN or inf): its cache "
                "overflowed, so the pack (or a model) is broken"
            )

    def to_dict(self) -> dict:
        out = asdict(self)
        for name in RATIOS:
            out[name] = getattr(self, name)
        out["intervals"] = {"level": INTERVAL_LEVEL, **self.intervals()}
        out["mean_r2_k"], out["mean_r2_v"] = _mean(self.r2_k), _mean(self.r2_v)
        out["mean_attention_cosine"] = _mean(self.attention_cosine)
        return out

    def summary(self) -> dict[str, float]:
        """Flat scalar metrics, as recorded in a pack."""
        d = self.to_dict()
        keys = (*RATIOS, "mean_r2_k", "mean_r2_v", "mean_attention_cosine")
        out = {f"eval_{k}": d[k] for k in keys if d[k] is not None}
        for name in CONDITIONS:
            if d[name] is None:
                continue
            out[f"eval_{name}_accuracy"] = d[name]["accuracy"]
            out[f"eval_{name}_nll"] = d[name]["nll"]
        out.update(
            eval_windows=self.windows,
            eval_prefix_len=self.prefix_len,
            eval_continuation=self.continuation,
            eval_tail=self.tail,
        )
        if self.repair is not None:
            out["eval_repair"] = self.repair
        if self.served is not None:
            out.update(
                eval_served_page_size=self.served_page_size, eval_served_tail=self.served_tail
            )
        return out

    def table(self) -> str:
        """Human-readable table."""
        rows = [
            ("target, own cache (reference)", self.reference, _pct(1.0), ""),
            ("target, translated cache", self.mapped, _pct(self.retention), _pct(self.gap_closed)),
            (
                f"target, translated + {self.tail}-token tail",
                self.mapped_tail,
                _pct(self.retention_tail),
                _pct(self.gap_closed_tail),
            ),
            *(
                [
                    (
                        f"  + {self.repair}",
                        self.repaired,
                        _pct(self.retention_repaired),
                        _pct(self.gap_closed_repaired),
                    )
                ]
                if self.repaired is not None
                else []
            ),
            *(
                [
                    (
                        f"target, as served ({self.served_page_size}-token pages, "
                        f"{self.served_tail}-token tail)",
                        self.served,
                        _pct(self.retention_served),
                        _pct(self.gap_closed_served),
                    )
                ]
                if self.served is not None
                else []
            ),
            ("source model alone", self.source, _pct(_ratio(self.source, self.reference)), ""),
            ("target, no prefix", self.no_prefix, _pct(_ratio(self.no_prefix, self.reference)), ""),
        ]
        lines = [
            f"{self.windows} windows, prefix {self.prefix_len}, continuation {self.continuation}, "
            f"sink tokens {self.sink_tokens}",
            f"{'condition':<44} {'top-1 acc':>9} {'NLL':>7} {'retention':>9} {'gap closed':>10}",
        ]
        lines += [
            f"{name:<44} {q.accuracy:>9.3f} {q.nll:>7.3f} {ret:>9} {gap:>10}"
            for name, q, ret, gap in rows
        ]
        lines.append(
            f"translated KV vs true (mean over layers): R2 K {_mean(self.r2_k):.3f}  "
            f"R2 V {_mean(self.r2_v):.3f}  "
            f"attention-output cosine {_mean(self.attention_cosine):.3f}"
        )
        worst = sorted(range(len(self.attention_cosine)), key=lambda i: self.attention_cosine[i])[
            :3
        ]
        spans = self.intervals()
        lines.append(
            f"{INTERVAL_LEVEL:.0%} bootstrap intervals over the {self.windows} windows: "
            + "; ".join(
                f"{name} [{span[0]:.3f}, {span[1]:.3f}]"
                for name, span in spans.items()
                if span is not None
            )
        )
        lines.append(
            "lowest attention cosine: "
            + ", ".join(f"layer {i} {self.attention_cosine[i]:.3f}" for i in worst)
        )
        return "\n".join(lines)


CONDITIONS = ("reference", "mapped", "mapped_tail", "repaired", "served", "source", "no_prefix")
# ratio -> (condition, baseline): retention is condition / reference, gap closed is
# (condition - source) / (reference - source)
RATIO_TERMS = {
    "retention": ("mapped", None),
    "retention_tail": ("mapped_tail", None),
    "retention_repaired": ("repaired", None),
    "retention_served": ("served", None),
    "gap_closed": ("mapped", "source"),
    "gap_closed_tail": ("mapped_tail", "source"),
    "gap_closed_repaired": ("repaired", "source"),
    "gap_closed_served": ("served", "source"),
}
RATIOS = tuple(RATIO_TERMS)


def bootstrap_interval(
    accuracy: dict[str, torch.Tensor],
    condition: str,
    baseline: str | None,
    level: float = INTERVAL_LEVEL,
    draws: int = BOOTSTRAP_DRAWS,
    seed: int = 0,
) -> tuple[float, float] | None:
    """Percentile-bootstrap interval of (condition - baseline) / (reference - baseline) (retention
    when ``baseline`` is None) over windows resampled with replacement, every condition from the
    same resampled windows. accuracy: condition -> [windows] per-window accuracy (windows of one
    length, so a mean over windows is the pooled accuracy). Draws where the ratio is undefined
    (a zero denominator) are dropped; None when most are."""
    reference = accuracy["reference"]
    picks = _resampled_windows(reference.numel(), draws, seed)
    mean = {name: values[picks].mean(1) for name, values in accuracy.items()}  # [draws] each
    offset = mean[baseline] if baseline is not None else torch.zeros(draws, dtype=reference.dtype)
    spread = mean["reference"] - offset
    defined = spread > 1e-12
    if defined.sum() * 2 <= draws:
        return None
    ratio = (mean[condition] - offset)[defined] / spread[defined]
    return _percentile_interval(ratio, level)


def window_scores(by_window: list[dict], condition: str, metric: str = "accuracy") -> torch.Tensor:
    """[windows] float64: one condition's per-window accuracy or NLL, from a report's JSON form
    (``EvalReport.to_dict()["by_window"]``, as `eval --json` and the benchmarks write it)."""
    return torch.tensor([w[condition][metric] for w in by_window], dtype=torch.float64)


def paired_difference(
    before: torch.Tensor,
    after: torch.Tensor,
    level: float = INTERVAL_LEVEL,
    draws: int = BOOTSTRAP_DRAWS,
    seed: int = 0,
) -> dict[str, float]:
    """How much ``after`` beats ``before`` over the same windows: the mean of the per-window
    differences, its standard error, and its percentile-bootstrap interval (windows resampled
    with replacement, one draw for both, so what both runs share cancels).

    before, after: [windows] per-window scores of two runs on the same windows (windows of
    one length, so a mean over windows is the pooled score)."""
    if before.shape != after.shape or before.ndim != 1 or before.numel() < 2:
        raise ValueError(
            f"need two [windows] score vectors of one length >= 2, got {tuple(before.shape)} "
            f"and {tuple(after.shape)}"
        )
    difference = (after - before).double()
    windows = difference.numel()
    means = difference[_resampled_windows(windows, draws, seed)].mean(1)  # [draws]
    low, high = _percentile_interval(means, level)
    return {
        "mean": difference.mean().item(),
        "se": (difference.std() / windows**0.5).item(),
        "low": low,
        "high": high,
    }


def _resampled_windows(windows: int, draws: int, seed: int) -> torch.Tensor:
    """[draws, windows] window indices drawn with replacement (fixed seed)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(windows, (draws, windows), generator=generator)


def _percentile_interval(samples: torch.Tensor, level: float) -> tuple[float, float]:
    """The central ``level`` percentile interval of [draws] bootstrap samples."""
    tails = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=samples.dtype)
    low, high = torch.quantile(samples, tails).tolist()
    return low, high


@dataclass
class _WindowScores:
    """What one window measured. scores: condition -> (correct [C] bool, nll [C]); sse, sst:
    kind -> [L, heads] float64, the translated K/V's squared error and the true K/V's total sum
    of squares (sinks excluded); cosine: [L], the attention cosine per layer."""

    scores: dict[str, tuple[torch.Tensor, torch.Tensor]]
    sse: dict[str, torch.Tensor]
    sst: dict[str, torch.Tensor]
    cosine: torch.Tensor


@dataclass
class _Accumulator:
    """Running sums over windows."""

    correct: dict = field(default_factory=dict)
    nll: dict = field(default_factory=dict)
    count: int = 0
    sse: dict = field(default_factory=dict)
    sst: dict = field(default_factory=dict)
    cosine: torch.Tensor | None = None
    windows: int = 0
    by_window: list = field(default_factory=list)

    def add(self, window: _WindowScores, tokens: int) -> None:
        """Add one window's scores (``tokens`` continuation tokens per condition)."""
        for name, (correct, nll) in window.scores.items():
            self.correct[name] = self.correct.get(name, 0) + correct.sum().item()
            self.nll[name] = self.nll.get(name, 0.0) + nll.sum().item()
        self.by_window.append(
            {
                name: Quality(correct.float().mean().item(), nll.mean().item())
                for name, (correct, nll) in window.scores.items()
            }
        )
        for kind in window.sse:
            self.sse[kind] = self.sse.get(kind, 0) + window.sse[kind]
            self.sst[kind] = self.sst.get(kind, 0) + window.sst[kind]
        self.cosine = window.cosine if self.cosine is None else self.cosine + window.cosine
        self.count += tokens
        self.windows += 1

    def quality(self, name: str) -> Quality:
        return Quality(self.correct[name] / self.count, self.nll[name] / self.count)


@dataclass
class OwnRun:
    """One model's own pass over one window, reused by every evaluation that needs it.

    cache: the model's KV for the whole window. queries: L x [continuation + 1, heads, d]
    post-RoPE queries of positions prefix_len-1 .. end. scores: (correct [C] bool, nll [C])
    on the continuation with its own prefix, and with no prefix at all.
    """

    cache: KVCache
    queries: list[torch.Tensor]
    own: tuple[torch.Tensor, torch.Tensor]
    no_prefix: tuple[torch.Tensor, torch.Tensor]


class EvalRuns:
    """Memo of ``OwnRun`` per (model, window) for one set of windows: evaluating several mappers,
    tails or both directions of a pair on the same windows runs each model over them once."""

    def __init__(self, windows: list[torch.Tensor], prefix_len: int, continuation: int):
        if prefix_len < 2 or continuation < 1:
            raise ValueError("need prefix_len >= 2 and continuation >= 1")
        self.windows = [w[: prefix_len + continuation] for w in windows]
        if any(w.numel() < prefix_len + continuation for w in self.windows):
            raise ValueError(f"every window needs {prefix_len + continuation} tokens")
        self.prefix_len, self.continuation = prefix_len, continuation
        self._runs: dict[tuple[int, int], OwnRun] = {}

    def get(self, model: LoadedModel, index: int) -> OwnRun:
        key = (id(model.model), index)
        if key not in self._runs:
            self._runs[key] = self._run(model, self.windows[index])
        return self._runs[key]

    def forget(self, index: int) -> None:
        """Drop every model's memoised run of window ``index`` (each holds a full KV cache)."""
        self._runs = {key: run for key, run in self._runs.items() if key[1] != index}

    def __len__(self) -> int:
        """Runs memoised now."""
        return len(self._runs)

    def _run(self, model: LoadedModel, window: torch.Tensor) -> OwnRun:
        keep, labels = self.continuation + 1, window[self.prefix_len :]
        full = run(model.model, window, logits_to_keep=keep, want_queries=True)
        none = run(model.model, window[self.prefix_len - 1 :], logits_to_keep=keep)
        queries = [q[self.prefix_len - 1 :].clone() for q in full.queries]
        return OwnRun(
            full.cache, queries, _scores(full.logits, labels), _scores(none.logits, labels)
        )


def evaluate(
    mapper: KVMapper,
    source: LoadedModel,
    target: LoadedModel,
    windows: list[torch.Tensor],
    prefix_len: int,
    continuation: int,
    tail: int = EvalConfig.tail,
    runs: EvalRuns | None = None,
    repair: Repair | None = None,
    served: tuple[int, int] | None = (EvalConfig.served_page_size, EvalConfig.served_tail_pages),
) -> EvalReport:
    """Fidelity of ``mapper`` on ``windows`` (each ``[>= prefix_len + continuation]`` token ids).

    Pass the same ``runs`` (an EvalRuns over these windows) to several calls to reuse the
    models' own passes (they stay memoised); without it each window's passes are dropped once
    it is scored. ``repair``: also score the hand-off that recomputes the tail and the
    repair's anchors (picked as ``repair.choice`` says: ``transfer.pick_anchors``).
    ``served``: (page size, tail pages) of the hand-off as the engines serve it
    (``served_split``; None: not scored).
    """
    check_models(mapper, source.spec, target.spec)
    shared = runs is not None  # a caller's runs are kept for its next call; our own are not
    if runs is None:
        runs = EvalRuns(windows, prefix_len, continuation)
    if (runs.prefix_len, runs.continuation, len(runs.windows)) != (
        prefix_len,
        continuation,
        len(windows),
    ):
        raise ValueError("runs were made for other windows, prefix length or continuation")
    acc = _Accumulator()
    for i in tqdm(range(len(windows)), desc="evaluating", unit="win"):
        scores = _evaluate_window(
            mapper,
            runs.get(source, i),
            runs.get(target, i),
            source,
            target,
            runs,
            i,
            tail,
            repair,
            served,
        )
        acc.add(scores, runs.continuation)
        if not shared:
            runs.forget(i)  # memory stays flat in the number of windows
    per_head_r2 = {kind: 1 - acc.sse[kind] / acc.sst[kind] for kind in ("k", "v")}
    report = EvalReport(
        reference=acc.quality("reference"),
        mapped=acc.quality("mapped"),
        mapped_tail=acc.quality("mapped_tail"),
        source=acc.quality("source"),
        no_prefix=acc.quality("no_prefix"),
        r2_k=per_head_r2["k"].mean(1).tolist(),
        r2_v=per_head_r2["v"].mean(1).tolist(),
        attention_cosine=(acc.cosine / acc.windows).tolist(),
        windows=acc.windows,
        prefix_len=prefix_len,
        continuation=continuation,
        tail=tail,
        sink_tokens=mapper.sink_tokens,
        repaired=acc.quality("repaired") if repair else None,
        repair=None if repair is None else f"{tail}-token tail + {repair}",
        served=acc.quality("served") if served else None,
        served_page_size=served[0] if served else None,
        served_tail=served[0] * served[1] if served else None,
        by_window=acc.by_window,
    )
    report.check_finite()
    return report


def served_split(prefix_len: int, page_size: int, tail_pages: int) -> int:
    """Prompt tokens an engine of ``page_size``-token pages that recomputes ``tail_pages``
    receives translated (from the start, its own first page among them): the full pages a
    prefetch covers (not the one holding the last token), less the tail; at least the first
    page."""
    return max(1, (prefix_len - 1) // page_size - tail_pages) * page_size


def _evaluate_window(
    mapper, src: OwnRun, truth: OwnRun, source, target, runs: EvalRuns, i, tail, repair, served
) -> _WindowScores:
    window, prefix_len = runs.windows[i], runs.prefix_len
    scores = {"reference": truth.own, "source": src.own, "no_prefix": truth.no_prefix}
    if served is not None:
        page_size, tail_pages = served
        split = min(served_split(prefix_len, page_size, tail_pages), prefix_len - 1)
        as_served = dataclasses.replace(mapper, sink_tokens=page_size)
        translated = translate_prefix(
            as_served, src.cache.slice(0, split), window[:split], target.model,
            exact_first_layer=False,
        )  # fmt: skip
        scores["served"] = continuation_scores(target.model, translated, window, prefix_len)
    conditions = [("mapped", 0, None), ("mapped_tail", tail, None)]
    if repair is not None:
        conditions.append(("repaired", tail, repair))
    for name, t, plan in conditions:
        split = handoff_split(prefix_len, t)
        anchors = None
        if plan is not None:
            prompt = window[:prefix_len]
            anchors = pick_anchors(plan, mapper, src.cache, prompt, t, source.model, target.model)
        translated = translate_prefix(
            mapper, src.cache.slice(0, split), window[:split], target.model, anchors
        )
        scores[name] = continuation_scores(target.model, translated, window, prefix_len)
        if name == "mapped":
            fidelity = _layer_fidelity(translated, truth, target, mapper.sink_tokens)
    return _WindowScores(scores, *fidelity)


def continuation_scores(
    model: torch.nn.Module, cache: KVCache, window: torch.Tensor, prefix_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(correct, nll), each [C], of ``model`` predicting ``window[prefix_len:]`` (``window``:
    [prefix_len + C] token ids) after prefilling the rest of the prompt on top of ``cache``
    (its KV for ``window[:len(cache)]``, len(cache) < prefix_len)."""
    keep = window.numel() - prefix_len + 1
    out = run(model, window[len(cache) :], past=cache, logits_to_keep=keep)
    return _scores(out.logits, window[prefix_len:])


def _scores(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(correct, nll) per continuation token; logits [C+1, vocab], the last row is dropped."""
    logits = logits[:-1]
    return logits.argmax(-1) == labels, F.cross_entropy(logits, labels, reduction="none")


def _layer_fidelity(translated: KVCache, truth: OwnRun, target, sinks: int):
    """(sse, sst, cosine) of a translated cache against the target's own (``_WindowScores``)."""
    spec = target.spec
    true_prefix = truth.cache.slice(sinks, len(translated))
    mapped = translated.slice(sinks)
    tables = tables_for_spec(spec, mapped.positions)
    pairs = {
        "k": [
            (unrope(m, tables, spec.rope_style), unrope(t, tables, spec.rope_style))
            for m, t in zip(mapped.keys, true_prefix.keys)
        ],
        "v": list(zip(mapped.values, true_prefix.values)),
    }
    sse, sst = {}, {}
    for kind, layers in pairs.items():
        # [L, heads] each
        sse[kind] = torch.stack([(m - t).double().square().sum((0, 2)) for m, t in layers])
        sst[kind] = torch.stack(
            [(t.double() - t.double().mean(0)).square().sum((0, 2)) for _, t in layers]
        )
    cosine = torch.tensor(
        [
            _attention_cosine(q, k_true, v_true, k_map, v_map)
            for q, k_true, v_true, k_map, v_map in zip(
                truth.queries,
                truth.cache.keys,
                truth.cache.values,
                translated.keys,
                translated.values,
            )
        ]
    )
    return sse, sst, cosine


def _attention_cosine(q, k_true, v_true, k_map, v_map) -> float:
    """Mean cosine of attention outputs over true vs translated KV.

    q: [n, H, d], queries of the LAST n positions; k/v_true: [T, kv, d];
    k/v_map: [m, kv, d], translated KV that replaces the first m tokens.
    """
    m = k_map.shape[0]
    k_mixed, v_mixed = torch.cat((k_map, k_true[m:])), torch.cat((v_map, v_true[m:]))
    out_true = _causal_attention(q, k_true, v_true)
    out_map = _causal_attention(q, k_mixed, v_mixed)
    return F.cosine_similarity(out_true, out_map, dim=-1).mean().item()


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q: [n, H, d] for the LAST n positions of k, v: [T, kv, d] -> [n, H, d]."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1).float(), v.repeat_interleave(groups, 1).float()
    n, total = q.shape[0], k.shape[0]
    mask = torch.ones(n, total, dtype=torch.bool).tril(total - n)
    return F.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
    ).transpose(0, 1)


def _gap(mapped: Quality, source: Quality, reference: Quality) -> float | None:
    """(mapped - source) / (reference - source); None unless the target beats the source."""
    spread = reference.accuracy - source.accuracy
    return None if spread <= 1e-12 else (mapped.accuracy - source.accuracy) / spread


def _ratio(a: Quality, b: Quality) -> float | None:
    return None if b.accuracy == 0 else a.accuracy / b.accuracy


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"
