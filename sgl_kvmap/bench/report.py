"""The report of ``sgl-kvmap bench``: the per-request records of every (policy, mode) replay,
summarized in one row each (``summarize``), written as markdown under the run's header
(``summary_markdown``) and drawn in four figures (``write_report``).

The machines are noisy, so the headline compares each mode with the same policy's re-prefill
replay over the same requests: prefill tokens saved and the ratio of median times to first
token, with bootstrap intervals. Plots need matplotlib (the ``bench`` extra), imported lazily;
without it the markdown is written alone and says how to get the figures.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..core.files import staged_file
from .records import (
    BASELINE_TITLES,
    BASELINES,
    MODE_TITLES,
    MODES,
    REFERENCE_MODE,
    STAGES,
    TIERS,
    RequestRecord,
)

HEADER_KEYS = (
    "command",
    "pair",
    "trace",
    "scale",
    "requests",
    "sessions",
    "page_size",
    "date",
    "machine",
)
SUMMARY_FILE = "summary.md"
INSTALL_HINT = "pip install 'sgl-kvmap[bench]'"
DASH = "—"
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
CONFIDENCE = 0.95
MAX_RESAMPLED_VALUES = 4_000_000  # bootstrap draws per chunk, to bound memory
PREFILL_PARTS = (*TIERS, "computed")  # the stack of a prefill bar, bottom up

Replays = dict[tuple[str, str], list[RequestRecord]]


# ---------------------------------------------------------------------------------------------
# summary rows


def summarize(records: list[RequestRecord]) -> list[dict]:
    """One row per (policy, mode) replay, policies in order of appearance, modes in MODES order.

    Every row has the same keys; a value that does not apply (nothing swapped, no re-prefill
    replay of the policy, no quality judged) is None. ``swapped_tokens`` and ``all_tokens``
    hold ``prompt_tokens``, ``ideal_reuse_tokens``, ``reused`` (tokens per tier) and
    ``computed``. ``prefill_saved`` (1 - computed / re-prefill's computed) and ``ttft_ratio``
    (median TTFT / re-prefill's median TTFT) pair swapped requests by index with the same
    policy's re-prefill replay (``paired_requests`` of them); intervals are ``[low, high]``."""
    replays = group_replays(records)
    return [
        summary_row(replay, replays.get((policy, REFERENCE_MODE)))
        for (policy, _), replay in replays.items()
    ]


def group_replays(records: list[RequestRecord]) -> Replays:
    """The records of each (policy, mode) replay, in report order."""
    replays: Replays = {}
    for record in records:
        replays.setdefault((record.policy, record.mode), []).append(record)
    policies = list(dict.fromkeys(record.policy for record in records))
    order = sorted(replays, key=lambda key: (policies.index(key[0]), mode_rank(key[1]), key[1]))
    return {key: replays[key] for key in order}


def mode_rank(mode: str) -> int:
    return MODES.index(mode) if mode in MODES else len(MODES)


def summary_row(replay: list[RequestRecord], reference: list[RequestRecord] | None) -> dict:
    swapped = [record for record in replay if record.swapped]
    pairs = paired_with_reference(swapped, reference)
    return {
        "policy": replay[0].policy,
        "mode": replay[0].mode,
        "requests": len(replay),
        "swapped": len(swapped),
        "swapped_tokens": token_counts(swapped) if swapped else None,
        "all_tokens": token_counts(replay),
        "paired_requests": len(pairs),
        "prefill_saved": prefill_saved(pairs),
        **ttft_stats(swapped),
        **ttft_ratio(pairs),
        **quality_stats(swapped if replay[0].mode != REFERENCE_MODE else []),
        "stages": stage_stats([r for r in swapped if r.reused["translated"]]),
        "continuation": {
            direction: direction_stats([r for r in swapped if r.model == served])
            for direction, served in DIRECTIONS.items()
        },
    }


def direction_stats(swapped: list[RequestRecord]) -> dict:
    """``continuation_stats`` of one direction's swaps: in a translating mode, over the swaps
    that translated something (a swap prefilled whole scores as re-prefill and says nothing of
    translation), with ``swaps`` and ``translated_swaps`` beside them (None in re-prefill)."""
    translating = bool(swapped) and swapped[0].mode != REFERENCE_MODE
    judged = [r for r in swapped if r.reused["translated"]] if translating else swapped
    return {
        **continuation_stats(judged),
        "swaps": len(swapped),
        "translated_swaps": len(judged) if translating else None,
    }


HAND_OVER_FLOOR = ("primed", "forward", "map")  # what a translated swap cannot do without


def stage_stats(translated: list[RequestRecord]) -> dict | None:
    """Where the time of the swaps that translated went: their count, the median seconds of
    each stage they recorded (``records.STAGES``) and of their time to first token, and the
    median over them of the ratio of time to first token to what no hand-over can skip (its
    first page primed, the forward of its computed tokens and the map: ``hand_over_ratio``,
    with its interval; None where the forward was not timed, as on live servers)."""
    timed = [r for r in translated if r.stages]
    if not timed:
        return None
    stages = [stage for stage in STAGES if any(stage in r.stages for r in timed)]
    floors = [sum(r.stages.get(stage, 0.0) for stage in HAND_OVER_FLOOR) for r in timed]
    ratios = None
    if all("forward" in r.stages for r in timed) and all(floors):
        ratios = np.array([r.ttft_s / floor for r, floor in zip(timed, floors)])
    return {
        "swaps": len(timed),
        "ttft_median_s": float(np.median([r.ttft_s for r in timed])),
        "median_s": {
            stage: float(np.median([r.stages.get(stage, 0.0) for r in timed])) for stage in stages
        },
        "hand_over_ratio": None if ratios is None else float(np.median(ratios)),
        "hand_over_ratio_ci": None
        if ratios is None
        else bootstrap_interval(ratios, lambda x: np.median(x, axis=-1)),
    }


def token_counts(records: list[RequestRecord]) -> dict:
    return {
        "prompt_tokens": sum(record.prompt_tokens for record in records),
        "ideal_reuse_tokens": sum(record.ideal_reuse_tokens for record in records),
        "reused": {tier: sum(record.reused[tier] for record in records) for tier in TIERS},
        "computed": sum(record.computed for record in records),
    }


def paired_with_reference(
    swapped: list[RequestRecord], reference: list[RequestRecord] | None
) -> list[tuple[RequestRecord, RequestRecord]]:
    """(this replay's record, re-prefill's record) of each request swapped in both replays."""
    by_request = {record.request: record for record in reference or [] if record.swapped}
    return [
        (record, by_request[record.request]) for record in swapped if record.request in by_request
    ]


def prefill_saved(pairs: list[tuple[RequestRecord, RequestRecord]]) -> float | None:
    reference_computed = sum(reference.computed for _, reference in pairs)
    if not reference_computed:
        return None
    return 1.0 - sum(record.computed for record, _ in pairs) / reference_computed


def ttft_stats(swapped: list[RequestRecord]) -> dict:
    ttft = [record.ttft_s for record in swapped]
    return {
        "ttft_median_s": float(np.median(ttft)) if ttft else None,
        "ttft_mean_s": float(np.mean(ttft)) if ttft else None,
    }


def ttft_ratio(pairs: list[tuple[RequestRecord, RequestRecord]]) -> dict:
    ttft = np.array([[record.ttft_s, reference.ttft_s] for record, reference in pairs])
    if not pairs or np.median(ttft[:, 1]) <= 0:
        return {"ttft_ratio": None, "ttft_ratio_ci": None}
    return {
        "ttft_ratio": float(median_ratio(ttft)),
        "ttft_ratio_ci": bootstrap_interval(ttft, median_ratio),
    }


def median_ratio(ttft: np.ndarray) -> np.ndarray:
    """ttft: [..., requests, 2] (this mode, re-prefill) -> [...] ratio of the medians."""
    return np.median(ttft[..., 0], axis=-1) / np.median(ttft[..., 1], axis=-1)


def quality_stats(swapped: list[RequestRecord]) -> dict:
    judged = [record.quality for record in swapped if record.quality is not None]
    agreement = np.array([quality.agreement for quality in judged])
    nll = float(np.mean([quality.nll for quality in judged])) if judged else None
    reference_nll = float(np.mean([q.reference_nll for q in judged])) if judged else None
    return {
        "judged_requests": len(judged),
        "agreement_mean": float(agreement.mean()) if judged else None,
        "agreement_ci": bootstrap_interval(agreement, mean_over_requests),
        "nll_mean": nll,
        "reference_nll_mean": reference_nll,
        "nll_increase": nll - reference_nll if judged else None,
    }


CONTINUATION_CONDITIONS = ("served", *BASELINES)  # this mode's cache, then the baselines
# a swap's direction -> the model that serves it; staying on the source is the other model
DIRECTIONS = {"up": "large", "down": "small"}
DIRECTION_TITLES = {"up": "small -> large", "down": "large -> small"}


def continuation_stats(swapped: list[RequestRecord]) -> dict:
    """Scores on the true continuation of the swapped requests judged with every baseline:
    mean accuracy and NLL per condition (``CONTINUATION_CONDITIONS``), retention (accuracy over
    the reference's) and gap closed ((accuracy - staying on the source) / (reference - staying)),
    pooled over requests with bootstrap intervals, and the verdict on staying (``verdict``)."""
    judged = [
        record.quality
        for record in swapped
        if record.quality is not None
        and record.quality.continuation is not None
        and set(BASELINES) <= set(record.quality.baselines)
    ]
    scores = {
        metric: np.array(
            [
                [
                    getattr(q.continuation, metric),
                    *(getattr(q.baselines[b], metric) for b in BASELINES),
                ]
                for q in judged
            ]
        ).reshape(len(judged), len(CONTINUATION_CONDITIONS))
        for metric in ("accuracy", "nll")
    }
    accuracy = scores["accuracy"]
    condition = {name: i for i, name in enumerate(CONTINUATION_CONDITIONS)}
    retention_columns = accuracy[:, [condition["served"], condition["reference"]]]
    gap_columns = accuracy[:, [condition["served"], condition["source"], condition["reference"]]]
    gap_ci = bootstrap_interval(gap_columns, gap_closed) if judged else None
    return {
        "continuation_requests": len(judged),
        "continuation_tokens": sum(q.continuation_tokens for q in judged),
        "continuation_accuracy": _means(accuracy) if judged else None,
        "continuation_nll": _means(scores["nll"]) if judged else None,
        "retention": float(retention(retention_columns)) if judged else None,
        "retention_ci": bootstrap_interval(retention_columns, retention) if judged else None,
        "gap_closed": _finite(gap_closed(gap_columns)) if judged else None,
        "gap_closed_ci": gap_ci,
        "verdict": verdict(gap_ci),
    }


# the translating modes whose served figures ``sgl-kvmap bench --record`` writes into a pack,
# by whether their engines recompute a tail (``sglang.settings.served_key``)
RECORDED_MODES = {"tail": True, "translated": False}


def served_record(records: list[RequestRecord], served_model: str) -> dict[str, float | int]:
    """The figures ``sgl-kvmap bench --record`` writes into the pack of the swaps that
    ``served_model`` served: for each translating mode (``RECORDED_MODES``), pooled over the
    swaps of every policy that translated any token, their number (``served_swaps``), the
    retention and gap closed on the true continuation and the low end of the gap-closed
    interval (``served_gap_closed[_tail]_low``: what the engines' quality floor reads), each
    under its ``settings.served_key``. Figures that do not apply (no such swap, no gap
    to close) are left out."""
    out: dict[str, float | int] = {}
    from ..sglang.settings import served_key

    for mode, tail in RECORDED_MODES.items():
        swaps = [
            r
            for r in records
            if r.mode == mode and r.swapped and r.model == served_model and r.reused["translated"]
        ]
        stats = continuation_stats(swaps)
        if not stats["continuation_requests"]:
            continue
        interval = stats["gap_closed_ci"]
        figures = {
            served_key("swaps", tail): stats["continuation_requests"],
            served_key("retention", tail): stats["retention"],
            served_key("gap_closed", tail): stats["gap_closed"],
            served_key("gap_closed_low", tail): interval[0] if interval else None,
        }
        out.update({key: value for key, value in figures.items() if value is not None})
    return out


def _means(scores: np.ndarray) -> dict[str, float]:
    return {name: float(scores[:, i].mean()) for i, name in enumerate(CONTINUATION_CONDITIONS)}


def _finite(value: np.ndarray) -> float | None:
    return float(value) if np.isfinite(value) else None


def retention(accuracy: np.ndarray) -> np.ndarray:
    """accuracy: [..., requests, 2] (served, reference) -> [...] pooled served / reference
    (NaN where the reference scores 0)."""
    served, reference = accuracy[..., 0].mean(-1), accuracy[..., 1].mean(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(reference > 0, served / reference, np.nan)


def gap_closed(accuracy: np.ndarray) -> np.ndarray:
    """accuracy: [..., requests, 3] (served, source, reference) -> [...] pooled
    (served - source) / (reference - source): 1 where the swap does as well as re-prefill, 0
    where it does no better than staying on the source, below 0 where it does worse (NaN where
    the reference does not beat the source)."""
    served, source, reference = (accuracy[..., i].mean(-1) for i in range(3))
    spread = reference - source
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(spread > 1e-12, (served - source) / spread, np.nan)


VERDICTS = {
    "beats": "beats staying",
    "worse": "worse than staying",
    "unresolved": "not resolved",
}


def verdict(gap_ci: list[float] | None) -> str | None:
    """Whether swapping beats staying on the source model, from the gap-closed interval: its
    low end above 0 ("beats"), its high end below 0 ("worse"), else "unresolved"."""
    if gap_ci is None:
        return None
    if gap_ci[0] > 0:
        return "beats"
    return "worse" if gap_ci[1] < 0 else "unresolved"


def mean_over_requests(values: np.ndarray) -> np.ndarray:
    """values: [..., requests] -> [...]."""
    return np.mean(values, axis=-1)


def bootstrap_interval(
    samples: np.ndarray, statistic: Callable[[np.ndarray], np.ndarray]
) -> list[float] | None:
    """The percentile bootstrap interval (CONFIDENCE) of ``statistic`` over resampled requests.

    samples: [requests, ...]; statistic maps [draws, requests, ...] to [draws]. None under two
    requests, or when the statistic is undefined (NaN) on most resamples (the rest are kept).
    The seed is fixed, so a report is reproducible."""
    if len(samples) < 2:
        return None
    estimates = bootstrap_estimates(samples, statistic, np.random.default_rng(BOOTSTRAP_SEED))
    defined = estimates[np.isfinite(estimates)]  # a ratio is undefined on some resamples
    if defined.size * 2 <= estimates.size:
        return None
    tail = (1 - CONFIDENCE) / 2 * 100
    low, high = np.percentile(defined, [tail, 100 - tail])
    return [float(low), float(high)]


def bootstrap_estimates(
    samples: np.ndarray, statistic: Callable[[np.ndarray], np.ndarray], rng: np.random.Generator
) -> np.ndarray:
    chunk = max(1, MAX_RESAMPLED_VALUES // samples.size)
    estimates = []
    for start in range(0, BOOTSTRAP_RESAMPLES, chunk):
        draws = min(chunk, BOOTSTRAP_RESAMPLES - start)
        picks = rng.integers(0, len(samples), size=(draws, len(samples)))
        estimates.append(statistic(samples[picks]))
    return np.concatenate(estimates)


# ---------------------------------------------------------------------------------------------
# markdown


def summary_markdown(records: list[RequestRecord], header: dict) -> str:
    """The report's text: the run's header, then tables of swapped requests, quality and all
    requests, then how the numbers are computed (no figures: ``write_report`` adds them)."""
    rows = summarize(records)
    sections = [
        "# sgl-kvmap bench: prefix reuse across model swaps",
        header_markdown(header),
        "## Swapped requests\n\n" + swapped_table(rows),
        "## Swapped requests against the baselines, on the true continuation\n\n"
        + continuation_section(rows),
        "## Agreement with re-prefill's greedy answer\n\n" + quality_table(rows),
        "## Where a translated swap's time goes\n\n" + stages_table(rows),
        "## All requests\n\n" + all_requests_table(rows),
        "## Method\n\n" + METHOD,
    ]
    return "\n\n".join(sections) + "\n"


def header_markdown(header: dict) -> str:
    missing = [key for key in HEADER_KEYS if key not in header]
    if missing:
        raise ValueError(f"the report header lacks {missing}; it needs all of {HEADER_KEYS}")
    extra = [key for key in header if key not in HEADER_KEYS]
    lines = [f"- **{key}**: {header_value(key, header[key])}" for key in (*HEADER_KEYS, *extra)]
    return "\n".join(lines)


def header_value(key: str, value) -> str:
    if isinstance(value, dict):
        return f"`{json.dumps(value, separators=(', ', ': '))}`"
    return f"`{value}`" if key == "command" else str(value)


def swapped_table(rows: list[dict]) -> str:
    columns = ["policy", "mode", "requests", "swapped", "prompt tokens", "ideal reuse"]
    columns += [*TIERS, "computed", "prefill saved", "TTFT median (ms)", "TTFT mean (ms)"]
    columns += [f"TTFT ratio [{CONFIDENCE:.0%} CI]"]
    return markdown_table(columns, [swapped_cells(row) for row in rows])


def swapped_cells(row: dict) -> list[str]:
    tokens = row["swapped_tokens"] or {}
    reused = tokens.get("reused", {})
    return [
        *row_label(row),
        str(row["requests"]),
        str(row["swapped"]),
        count(tokens.get("prompt_tokens")),
        count(tokens.get("ideal_reuse_tokens")),
        *[count(reused.get(tier)) for tier in TIERS],
        count(tokens.get("computed")),
        percent(row["prefill_saved"]),
        milliseconds(row["ttft_median_s"]),
        milliseconds(row["ttft_mean_s"]),
        ttft_ratio_cell(row),
    ]


def ttft_ratio_cell(row: dict) -> str:
    if row["mode"] == REFERENCE_MODE and row["ttft_ratio"] is not None:
        return "1 (reference)"
    return with_interval(row["ttft_ratio"], row["ttft_ratio_ci"])


def stages_table(rows: list[dict]) -> str:
    """Per translating replay: the median seconds of each stage over the swaps that translated
    (``stage_stats``), and the hand-over ratio."""
    rows = [row for row in rows if row["stages"]]
    if not rows:
        return f"{DASH} (no swap translated)"
    stages = [s for s in STAGES if any(s in row["stages"]["median_s"] for row in rows)]
    columns = ["policy", "mode", "swaps", "TTFT median (ms)", *[f"{s} (ms)" for s in stages]]
    columns += [f"TTFT / (primed + forward + map) [{CONFIDENCE:.0%} CI]"]
    table = markdown_table(columns, [stages_cells(row, stages) for row in rows])
    legend = "\n".join(f"- *{stage}*: {STAGES[stage]}" for stage in stages)
    return f"{table}\n\nOver the swaps that translated, medians of each stage:\n\n{legend}"


def stages_cells(row: dict, stages: list[str]) -> list[str]:
    stats = row["stages"]
    return [
        *row_label(row),
        str(stats["swaps"]),
        milliseconds(stats["ttft_median_s"]),
        *[milliseconds(stats["median_s"].get(stage)) for stage in stages],
        with_interval(stats["hand_over_ratio"], stats["hand_over_ratio_ci"]),
    ]


def continuation_section(rows: list[dict]) -> str:
    """The verdict line, then one row per replay and direction with continuation scores."""
    lines = continuation_lines(rows)
    if not lines:
        return "No swapped request was judged on its true continuation in this run."
    columns = ["policy", "mode", "swap", "swaps translated", "judged requests"]
    columns += [f"accuracy: {name}" for name in ("this mode", *CONDITION_HEADINGS)]
    columns += [f"retention [{CONFIDENCE:.0%} CI]", f"gap closed [{CONFIDENCE:.0%} CI]"]
    columns += ["NLL: this mode", "NLL: re-prefill", "NLL: staying", "verdict"]
    table = markdown_table(columns, [continuation_cells(line) for line in lines])
    return verdict_line(lines, rows) + "\n\n" + table


def continuation_lines(rows: list[dict]) -> list[dict]:
    """Each replay's continuation scores per swap direction that has judged requests, with the
    replay's policy and mode and the ``direction``."""
    return [
        {"policy": row["policy"], "mode": row["mode"], "direction": direction, **stats}
        for row in rows
        for direction, stats in row["continuation"].items()
        if stats["continuation_requests"] or stats.get("translated_swaps") == 0 < stats["swaps"]
    ]


CONDITION_HEADINGS = ("re-prefill", "staying on the source", "no prefix")  # BASELINES' order


def continuation_cells(line: dict) -> list[str]:
    none = dict.fromkeys(CONTINUATION_CONDITIONS)  # nothing judged: every score a dash
    accuracy, nll = line["continuation_accuracy"] or none, line["continuation_nll"] or none
    return [
        *row_label(line),
        DIRECTION_TITLES[line["direction"]],
        translated_share(line),
        str(line["continuation_requests"]),
        *[decimal(accuracy[name]) for name in CONTINUATION_CONDITIONS],
        with_interval(line["retention"], line["retention_ci"]),
        with_interval(line["gap_closed"], line["gap_closed_ci"]),
        decimal(nll["served"]),
        decimal(nll["reference"]),
        decimal(nll["source"]),
        "reference" if line["mode"] == REFERENCE_MODE else verdict_cell(line),
    ]


def translated_share(line: dict) -> str:
    """ "k of n" swaps of the line's direction that translated something (a dash in re-prefill)."""
    if line.get("translated_swaps") is None:
        return DASH
    return f"{line['translated_swaps']} of {line['swaps']}"


def verdict_cell(line: dict) -> str:
    if line.get("translated_swaps") == 0:
        return "nothing translated"
    if line["verdict"] is not None:
        return VERDICTS[line["verdict"]]
    if line["gap_closed_ci"] is None and line["continuation_requests"] >= 2:
        return "no gap: staying does as well or better"
    return DASH


def verdict_line(lines: list[dict], rows: list[dict]) -> str:
    """One line: in how many translating replays (per direction) a swap beats staying on the
    source model, among those where re-prefill beats staying (a gap to close); with how many
    swaps of the translating replays (``rows``, every direction) translated something."""
    directions = [
        stats
        for row in rows
        if row["mode"] != REFERENCE_MODE
        for stats in row["continuation"].values()
    ]
    swaps = sum(stats.get("swaps") or 0 for stats in directions)
    translated = sum(stats.get("translated_swaps") or 0 for stats in directions)
    share = f"{translated} of {swaps} swaps of the translating replays translated something"
    translating = [line for line in lines if line["mode"] != REFERENCE_MODE]
    decided = [line for line in translating if line["verdict"] is not None]
    if not translated:
        return f"**Verdict**: nothing translated ({share})."
    if not decided:
        return (
            "**Verdict**: no translating replay has a gap to close judged on the true "
            f"continuation in this run ({share})."
        )
    counts = {key: sum(line["verdict"] == key for line in decided) for key in VERDICTS}
    return (
        f"**Verdict**, judged on the swaps that translated ({share}): a translated swap beats "
        f"staying on the source model in {counts['beats']} of {len(decided)} translating replays "
        f"and directions with a gap to close (gap closed above 0 over its whole interval), does "
        f"worse in {counts['worse']}, and is not resolved in {counts['unresolved']}."
    )


def quality_table(rows: list[dict]) -> str:
    translating = [row for row in rows if row["mode"] != REFERENCE_MODE]
    if not translating:
        return "No translating replay in this run."
    columns = ["policy", "mode", "judged requests", f"greedy agreement [{CONFIDENCE:.0%} CI]"]
    columns += ["NLL", "reference NLL", "NLL increase"]
    return markdown_table(columns, [quality_cells(row) for row in translating])


def quality_cells(row: dict) -> list[str]:
    return [
        *row_label(row),
        str(row["judged_requests"]),
        with_interval(row["agreement_mean"], row["agreement_ci"]),
        decimal(row["nll_mean"]),
        decimal(row["reference_nll_mean"]),
        decimal(row["nll_increase"], signed=True),
    ]


def all_requests_table(rows: list[dict]) -> str:
    columns = ["policy", "mode", "requests", "prompt tokens", *TIERS, "computed", "reused"]
    return markdown_table(columns, [all_requests_cells(row) for row in rows])


def all_requests_cells(row: dict) -> list[str]:
    tokens = row["all_tokens"]
    reused = sum(tokens["reused"].values())
    return [
        *row_label(row),
        str(row["requests"]),
        count(tokens["prompt_tokens"]),
        *[count(tokens["reused"][tier]) for tier in TIERS],
        count(tokens["computed"]),
        percent(reused / tokens["prompt_tokens"] if tokens["prompt_tokens"] else None),
    ]


def row_label(row: dict) -> list[str]:
    return [row["policy"], MODE_TITLES.get(row["mode"], row["mode"])]


def markdown_table(columns: list[str], rows: list[list[str]]) -> str:
    lines = [columns, ["---"] * len(columns), *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def count(value: int | None) -> str:
    return DASH if value is None else f"{value:,}"


def percent(value: float | None) -> str:
    return DASH if value is None else f"{value:.1%}"


def milliseconds(seconds: float | None) -> str:
    return DASH if seconds is None else f"{seconds * 1000:.1f}"


def decimal(value: float | None, signed: bool = False) -> str:
    return DASH if value is None else f"{value:+.3f}" if signed else f"{value:.3f}"


def with_interval(value: float | None, interval: list[float] | None) -> str:
    if value is None:
        return DASH
    return f"{value:.2f}" + (f" [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else "")


METHOD = f"""\
- A request is *swapped* when a different model serves it than the session's previous turn;
  the token and time columns of the first table count swapped requests only ({DASH}: none).
- *Prefill saved* is 1 - computed / computed of the same policy's
  {MODE_TITLES[REFERENCE_MODE]} replay, and the *TTFT ratio* is the median time to first token
  divided by that replay's median, both over the same requests (swapped in both replays),
  replayed side by side in one run: the machines are noisy, so ratios are the headline.
- Intervals are {CONFIDENCE:.0%} percentile bootstrap intervals over requests
  ({BOOTSTRAP_RESAMPLES} resamples, seed {BOOTSTRAP_SEED}; the TTFT ratio resamples pairs of
  requests); none under two requests.
- On the true continuation (held-out text after each prompt, the same tokens for every
  mode), each swapped request is scored teacher-forced (top-1 accuracy and mean NLL in
  nats/token) under the cache that served it and under the baselines: the target re-prefilled
  ({BASELINE_TITLES["reference"]}: the {MODE_TITLES[REFERENCE_MODE]} replay), staying on the
  source model ({BASELINE_TITLES["source"]}, computing the whole prompt) and no prefix
  ({BASELINE_TITLES["no_prefix"]}: the turn's new tokens only). Retention is the mode's accuracy
  over re-prefill's; gap closed is (mode - staying) / (re-prefill - staying), pooled over the
  requests: above 0 the swap beats staying, 1 is as good as re-prefill. In a translating mode
  these figures and the verdict are over the swaps that translated something (a swap prefilled
  whole scores as re-prefill), with their share beside them ("nothing translated" when none
  did). The verdict reads the gap-closed interval: "beats staying" when all of it is above 0,
  "worse than staying" when all of it is below.
- Agreement compares each translating mode's answer with the {MODE_TITLES[REFERENCE_MODE]}
  answer to the same prompt: greedy agreement is the share of the reference answer the mode's
  greedy decoding reproduces before it first departs from it (their common prefix), NLL the
  mean negative log-likelihood (nats/token) of the reference answer under the mode's cache,
  reference NLL the same under the reference's own cache; the increase is their difference."""


# ---------------------------------------------------------------------------------------------
# report folder


def write_report(records: list[RequestRecord], header: dict, out: Path) -> Path:
    """Write ``out/summary.md`` and the figures (``FIGURES``; none without matplotlib).

    Returns the summary's path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    text = summary_markdown(records, header)
    written = write_figures(records, header, out)
    path = out / SUMMARY_FILE
    with staged_file(path) as staging:
        staging.write_text(text + "\n" + figures_markdown(written))
    return path


def figures_markdown(written: list[str] | None) -> str:
    if written is None:
        return f"## Figures\n\nThe figures need matplotlib: `{INSTALL_HINT}`.\n"
    links = [f"![{FIGURE_TITLES[name]}]({name})" for name in written]
    return "## Figures\n\n" + "\n\n".join(links) + "\n"


def write_figures(records: list[RequestRecord], header: dict, out: Path) -> list[str] | None:
    """Draw each of FIGURES into ``out``; the file names written, or None without matplotlib."""
    if not matplotlib_installed():
        return None
    replays = group_replays(records)
    for name, draw in FIGURES.items():
        figure = draw(replays, header)
        figure.suptitle(f"{FIGURE_TITLES[name]}\n{run_caption(header)}")
        with staged_file(out / name) as staging:
            figure.savefig(staging, format="png", dpi=120)
    return list(FIGURES)


def matplotlib_installed() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def run_caption(header: dict) -> str:
    facts = [header.get(key) for key in ("pair", "trace", "scale")]
    facts.append(f"{header.get('requests')} requests")
    return " · ".join(str(fact) for fact in facts if fact is not None)


# ---------------------------------------------------------------------------------------------
# figures (matplotlib's Figure, no pyplot: the Agg canvas, no global state)

MODE_COLORS = {"reprefill": "tab:gray", "translated": "tab:blue", "tail": "tab:orange"}
PART_COLORS = {
    "device": "tab:green",
    "host": "tab:olive",
    "storage": "tab:cyan",
    "translated": "tab:blue",
    "computed": "tab:red",
}


def new_figure(panels: int, columns: int, panel_size: tuple[float, float]):
    """A constrained-layout figure and its first ``panels`` axes, ``columns`` per row."""
    from matplotlib.figure import Figure

    columns = max(1, min(panels, columns))
    rows = math.ceil(max(panels, 1) / columns)
    figure = Figure(figsize=(panel_size[0] * columns, panel_size[1] * rows), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    for unused in axes[panels:]:
        unused.set_visible(False)
    return figure, list(axes[: max(panels, 1)])


def mode_color(mode: str) -> str | None:
    return MODE_COLORS.get(mode)


def mode_title(mode: str) -> str:
    return MODE_TITLES.get(mode, mode)


def say_nothing(axes, text: str) -> None:
    axes.text(0.5, 0.5, text, ha="center", va="center", transform=axes.transAxes, color="gray")
    axes.set_xticks([])
    axes.set_yticks([])


def swapped_of(replay: list[RequestRecord]) -> list[RequestRecord]:
    return [record for record in replay if record.swapped]


def policies_with_swaps(replays: Replays) -> list[str]:
    policies = [policy for (policy, _), replay in replays.items() if swapped_of(replay)]
    return list(dict.fromkeys(policies))


def ttft_cdf_figure(replays: Replays, header: dict):
    """One panel per policy with swapped requests: the CDF of their TTFT, a line per mode."""
    policies = policies_with_swaps(replays)
    figure, axes = new_figure(len(policies), columns=3, panel_size=(5.0, 3.8))
    if not policies:
        say_nothing(axes[0], "no swapped requests")
    for panel, policy in zip(axes, policies):
        draw_ttft_cdf(panel, policy, replays)
    return figure


def draw_ttft_cdf(axes, policy: str, replays: Replays) -> None:
    for (replay_policy, mode), replay in replays.items():
        ttft_ms = np.sort([record.ttft_s * 1000 for record in swapped_of(replay)])
        if replay_policy != policy or not len(ttft_ms):
            continue
        fraction = np.arange(len(ttft_ms) + 1) / len(ttft_ms)
        label = f"{mode_title(mode)} (median {np.median(ttft_ms):.0f} ms)"
        x = np.concatenate([ttft_ms[:1], ttft_ms])  # the CDF rises from 0 at the fastest
        axes.step(x, fraction, where="post", color=mode_color(mode), label=label)
    axes.set(title=f"policy {policy}", xlabel="time to first token (ms)")
    axes.set(ylabel="fraction of swapped requests", ylim=(0, 1.02))
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small", loc="lower right")


def prefill_tokens_figure(replays: Replays, header: dict):
    """Prefill tokens of each (policy, mode) replay, stacked by tier: all requests above,
    swapped requests below."""
    width = max(8.0, 0.9 * len(replays) + 3.0)
    figure, (everything, swapped) = new_figure(2, columns=1, panel_size=(width, 3.6))
    positions = bar_positions(list(replays))
    draw_prefill_bars(everything, replays, positions, lambda replay: replay)
    draw_prefill_bars(swapped, replays, positions, swapped_of)
    everything.set_title("all requests")
    swapped.set_title("swapped requests")
    everything.legend(
        title="prompt tokens from", fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1)
    )
    return figure


def bar_positions(keys: list[tuple[str, str]]) -> list[float]:
    """x of each (policy, mode) bar, with a gap between policies."""
    positions, x = [], 0.0
    for index, (policy, _) in enumerate(keys):
        x += 1.0 if index == 0 or keys[index - 1][0] == policy else 1.6
        positions.append(x)
    return positions


def draw_prefill_bars(axes, replays: Replays, positions: list[float], pick) -> None:
    from matplotlib.ticker import EngFormatter

    totals = [prefill_parts(pick(replay)) for replay in replays.values()]
    bottom = np.zeros(len(totals))
    for part in PREFILL_PARTS:
        heights = np.array([parts[part] for parts in totals], dtype=float)
        axes.bar(positions, heights, bottom=bottom, color=PART_COLORS[part], label=part, width=0.8)
        bottom += heights
    for x, height in zip(positions, bottom):
        if not height:
            axes.text(x, 0, "no swaps", rotation=90, ha="center", va="bottom", color="gray")
    labels = [f"{mode}\n{policy}" for policy, mode in replays]
    axes.set_xticks(positions, labels, fontsize="small")
    axes.set_ylabel("prompt tokens")
    axes.yaxis.set_major_formatter(EngFormatter())
    axes.grid(axis="y", alpha=0.3)


def prefill_parts(records: list[RequestRecord]) -> dict[str, int]:
    parts = {tier: sum(record.reused[tier] for record in records) for tier in TIERS}
    return {**parts, "computed": sum(record.computed for record in records)}


def ttft_vs_prefix_figure(replays: Replays, header: dict):
    """TTFT of swapped requests against prompt length, a colour per mode (policies pooled),
    with the median of each length bin as a line."""
    figure, (axes,) = new_figure(1, columns=1, panel_size=(7.5, 4.8))
    by_mode = swapped_by_mode(replays)
    if not by_mode:
        say_nothing(axes, "no swapped requests")
    for mode, records in by_mode.items():
        draw_ttft_against_prompt(axes, mode, records)
    axes.set(xlabel="prompt tokens", ylabel="time to first token (ms)")
    axes.set_title("swapped requests, all policies; lines: median per length bin", fontsize="small")
    axes.grid(alpha=0.3)
    if by_mode:
        axes.legend(fontsize="small")
    return figure


def swapped_by_mode(replays: Replays) -> dict[str, list[RequestRecord]]:
    by_mode: dict[str, list[RequestRecord]] = {}
    for (_, mode), replay in replays.items():
        by_mode.setdefault(mode, []).extend(swapped_of(replay))
    return {mode: records for mode, records in by_mode.items() if records}


def draw_ttft_against_prompt(axes, mode: str, records: list[RequestRecord]) -> None:
    prompt = np.array([record.prompt_tokens for record in records], dtype=float)
    ttft_ms = np.array([record.ttft_s * 1000 for record in records])
    color = mode_color(mode)
    axes.scatter(prompt, ttft_ms, s=12, alpha=0.35, color=color, label=mode_title(mode))
    centers, medians = binned_medians(prompt, ttft_ms)
    axes.plot(centers, medians, color=color, linewidth=2)


def binned_medians(x: np.ndarray, y: np.ndarray, bins: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Medians of x and of y in up to ``bins`` bins of equal counts along x."""
    groups = np.array_split(np.argsort(x, kind="stable"), min(bins, len(x)))
    return (
        np.array([np.median(x[group]) for group in groups]),
        np.array([np.median(y[group]) for group in groups]),
    )


def quality_figure(replays: Replays, header: dict):
    """Greedy agreement and NLL increase of each judged swapped request against the tokens it
    recomputed, a colour per translating mode (policies pooled), an X at each mode's mean."""
    figure, (agreement, nll) = new_figure(2, columns=2, panel_size=(5.5, 4.2))
    judged = judged_by_mode(replays)
    for panel in (agreement, nll):
        if not judged:
            say_nothing(panel, "no judged requests")
    for mode, records in judged.items():
        draw_quality(agreement, nll, mode, records)
    agreement.set(ylabel="greedy agreement with re-prefill", ylim=(-0.02, 1.05))
    nll.set(ylabel="NLL increase over re-prefill (nats/token)")
    if judged:
        agreement.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        nll.axhline(0.0, color="black", linewidth=0.8, linestyle="--")
    for panel in (agreement, nll):
        finish_quality_panel(panel, bool(judged))
    return figure


def judged_by_mode(replays: Replays) -> dict[str, list[RequestRecord]]:
    judged: dict[str, list[RequestRecord]] = {}
    for (_, mode), replay in replays.items():
        if mode != REFERENCE_MODE:
            judged.setdefault(mode, []).extend(r for r in swapped_of(replay) if r.quality)
    return {mode: records for mode, records in judged.items() if records}


def draw_quality(agreement, nll, mode: str, records: list[RequestRecord]) -> None:
    computed = [record.computed for record in records]
    style = {"s": 16, "alpha": 0.5, "color": mode_color(mode), "label": mode_title(mode)}
    agreement.scatter(computed, agreement_of(records), **style)
    increase = [record.quality.nll - record.quality.reference_nll for record in records]
    nll.scatter(computed, increase, **style)
    mean = {"marker": "X", "s": 140, "color": mode_color(mode), "edgecolors": "black"}
    agreement.scatter(np.mean(computed), np.mean(agreement_of(records)), **mean)
    nll.scatter(np.mean(computed), np.mean(increase), **mean)


def agreement_of(records: list[RequestRecord]) -> list[float]:
    return [record.quality.agreement for record in records]


def finish_quality_panel(axes, judged: bool) -> None:
    if not judged:
        return
    axes.set_xlabel("tokens recomputed (prefilled by the target); X: mean of the mode")
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")


FIGURES = {
    "ttft_cdf.png": ttft_cdf_figure,
    "prefill_tokens.png": prefill_tokens_figure,
    "ttft_vs_prefix.png": ttft_vs_prefix_figure,
    "quality.png": quality_figure,
}
FIGURE_TITLES = {
    "ttft_cdf.png": "Time to first token on swapped requests",
    "prefill_tokens.png": "Where prompt tokens came from, per replay",
    "ttft_vs_prefix.png": "Time to first token against prompt length, swapped requests",
    "quality.png": "Quality of translated prefixes against tokens recomputed",
}
