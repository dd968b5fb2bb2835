"""Every-Nth-token subsampling of calibration: what it saves and what it costs in fit quality.

    python benchmarks/subsampling.py [--tokens 32768] [--strides 2,4] [--top-k 16]

One capture pass over ``--tokens`` of the default calibration text (both models run once per
window) grows several 0.5B -> 1.5B statistics side by side:

- ``stride 1``: every token of every training window (what ``fit`` does);
- ``stride S``: every S-th token of the same windows (``CalibrationConfig.stride``);
- ``stride 1, first 1/S of the text``: every token of the first 1/S of the training windows,
  the same number of kept tokens as ``stride S`` from S times less text.

Every statistic is scored on the same held-out windows at full stride (the held-out files),
so the rows differ only in their training tokens. Each is fitted with one fixed k (no k search,
so the rows differ only in their data) and reports held-out R^2 for K and V, beside the
seconds each statistic's updates took against the models' forwards. Writes
benchmarks/results/subsampling.md (+ .json). No asserts: benchmarks measure.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import click
from tqdm.auto import tqdm

from sgl_kvmap.core.mapper import content_features
from sgl_kvmap.fitting.calibrate import (
    PairStatistics,
    calibration_token_windows,
    fit_from_statistics,
    text_description,
)
from sgl_kvmap.fitting.config import CalibrationConfig
from sgl_kvmap.fitting.default_pair import LARGE, SMALL, ensure_model
from sgl_kvmap.models.capture import load_model, run

RESULTS = Path(__file__).parent / "results"


@dataclass
class Arm:
    """One statistic grown in the shared pass: every ``stride``-th training token of the
    training windows before ``windows_upto``."""

    name: str
    stride: int
    windows_upto: int
    stats: PairStatistics
    update_seconds: float = 0.0
    kept_tokens: int = 0


@click.command()
@click.option("--tokens", default=32768, show_default=True, help="calibration text, in tokens")
@click.option("--strides", default="2,4", show_default=True, help="subsampling strides to try")
@click.option("--top-k", default=16, show_default=True, help="source layers per target head")
def main(tokens: int, strides: str, top_k: int) -> None:
    config = CalibrationConfig(tokens=tokens, top_k=top_k)
    small, large = load_model(str(ensure_model(SMALL))), load_model(str(ensure_model(LARGE)))
    windows = calibration_token_windows(small.tokenizer, None, config)
    # held-out windows as collect_statistics counts them (at least the last one)
    held = {i for i in range(len(windows)) if (i + 1) % config.heldout_every == 0}
    held = held or {len(windows) - 1}
    training = [i for i in range(len(windows)) if i not in held]

    def arm(name: str, stride: int, share: int) -> Arm:
        upto = training[max(1, len(training) // share) - 1] + 1 if share > 1 else len(windows)
        return Arm(name, stride, upto, PairStatistics(small.spec, large.spec))

    arms = [arm("stride 1", 1, 1)]
    for s in map(int, strides.split(",")):
        arms += [arm(f"stride {s}", s, 1), arm(f"stride 1, first 1/{s} of the text", 1, s)]
    rows = slice(config.skip_first, None)
    forward_seconds = 0.0
    for i in tqdm(range(len(windows)), desc="calibration windows", unit="win"):
        started = time.perf_counter()
        src, tgt = (
            content_features(run(model.model, windows[i]).cache, model.spec, rows)
            for model in (small, large)
        )
        forward_seconds += time.perf_counter() - started
        for a in arms:
            if i not in held and i >= a.windows_upto:
                continue
            step = 1 if i in held else a.stride  # every arm is scored on the same tokens
            started = time.perf_counter()
            a.stats.update(
                {k: f[::step] for k, f in src.items()},
                {k: f[::step] for k, f in tgt.items()},
                i in held,
            )
            a.update_seconds += time.perf_counter() - started
            a.kept_tokens += 0 if i in held else len(src["k"][::step])
    results = []
    for a in arms:
        _, fit = fit_from_statistics(a.stats, config)
        a.stats = None  # free its moments before the next solve
        results.append(
            {
                "arm": a.name,
                "stride": a.stride,
                "text_tokens": sum(len(windows[i]) for i in training if i < a.windows_upto),
                "kept_tokens": a.kept_tokens,
                "heldout_r2_k": fit.heldout["k"],
                "heldout_r2_v": fit.heldout["v"],
                "update_seconds": a.update_seconds,
                "solve_seconds": fit.solve_seconds,
            }
        )
        print(json.dumps(results[-1]), flush=True)
    report = {
        "direction": "0.5B->1.5B",
        "text": text_description(None),
        "tokens": tokens,
        "window": config.window,
        "top_k": top_k,
        "heldout_windows": len(held),
        "heldout_tokens": sum(len(windows[i]) - config.skip_first for i in held),
        "forward_seconds": forward_seconds,
        "arms": results,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "subsampling.json").write_text(json.dumps(report, indent=1) + "\n")
    (RESULTS / "subsampling.md").write_text(_table(report))
    print(_table(report))


def _table(report: dict) -> str:
    lines = [
        "# Every-Nth-token subsampling of calibration",
        "",
        f"0.5B -> 1.5B, k = {report['top_k']}, {report['tokens']:,} tokens of {report['text']}"
        f" in {report['window']}-token windows; held-out R2 on the same {report['heldout_windows']}"
        f" held-out windows ({report['heldout_tokens']:,} tokens) for every row. Both models'"
        f" forwards over all windows: {report['forward_seconds']:.0f} s. Written by"
        " `python benchmarks/subsampling.py`.",
        "",
        "| training tokens | text read | kept | held-out R2 K | held-out R2 V | updates (s) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for a in report["arms"]:
        lines.append(
            f"| {a['arm']} | {a['text_tokens']:,} | {a['kept_tokens']:,} | "
            f"{a['heldout_r2_k']:.3f} | {a['heldout_r2_v']:.3f} | {a['update_seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
