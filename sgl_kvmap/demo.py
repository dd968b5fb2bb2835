"""``sgl-kvmap demo``: the main job on the embedded Qwen2.5-Coder 0.5B / 1.5B pair.

Fetch and convert the pair (once), fit both directions on the Python standard library's
sources (one pass, shared captures), evaluate each direction on disjoint text beside its
baselines, time translation against the target's re-prefill, save both packs with their
measured metrics, write results.json and return one printed table.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path

import torch

from .calibrate import CalibrationConfig, fit_mapper
from .capture import load_model
from .default_pair import LARGE, SMALL, ensure_model
from .evaluate import evaluate
from .texts import calibration_windows, default_eval_files, eval_windows, stdlib_files
from .timing import measure_speed


def run_demo(out: Path, tokens: int, windows: int, prefix_len: int, continuation: int, tail: int, bench_tokens: int) -> str:
    """Run the whole job and return the summary table (also saved under ``out``)."""
    small = load_model(str(ensure_model(SMALL)))
    large = load_model(str(ensure_model(LARGE)))
    fits = fit_mapper(small, large, config=CalibrationConfig(tokens=tokens), both_directions=True)
    fit_peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    eval_ids = eval_windows(large.tokenizer, default_eval_files(), prefix_len + continuation, windows)
    bench_ids = _bench_prompt(large.tokenizer, bench_tokens)
    results = {}
    for (mapper, fit_report), (source, target), name in zip(fits, [(small, large), (large, small)], ("0.5B->1.5B", "1.5B->0.5B")):
        report = evaluate(mapper, source, target, eval_ids, prefix_len, continuation, tail)
        speed = measure_speed(mapper, source, target, bench_ids)
        mapper.info["metrics"].update(report.summary())
        mapper.info["metrics"].update({f"speed_{k}": v for k, v in speed.to_dict().items()})
        mapper.save_pretrained(Path(out) / name.replace(">", "").replace("-", "_to_"))
        results[name] = {"fit": {**fit_report.summary(), "process_peak_rss_gib": round(fit_peak_gib, 2)}, "fit_per_k": fit_report.per_k, "eval": report.to_dict(), "speed": speed.to_dict()}
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    return format_table(results) + f"\n\npacks and results.json written to {out}/"


def format_table(results: dict) -> str:
    """One table: per direction, fidelity beside baselines, R^2, attention cosine, speed."""
    header = (
        f"{'direction':<11} {'k':>3} {'R2 K/V k=1':>11} {'R2 K/V':>11} {'target':>6} {'mapped':>6} {'+tail':>6} "
        f"{'source':>6} {'no pfx':>6} {'retain':>6} {'+tail':>6} {'gap':>6} {'+tail':>6} {'attn cos':>8} {'map s':>6} {'prefill s':>9} {'speedup':>7}"
    )
    lines = ["top-1 next-token accuracy on the continuation (teacher-forced); R2 held out on calibration text", header]
    for name, r in results.items():
        f, e, s = r["fit"], r["eval"], r["speed"]
        lines.append(
            f"{name:<11} {f['k']:>3} {_pair(f['heldout_r2_k_k1'], f['heldout_r2_v_k1']):>11} {_pair(f['heldout_r2_k'], f['heldout_r2_v']):>11} "
            f"{e['reference']['accuracy']:>6.3f} {e['mapped']['accuracy']:>6.3f} {e['mapped_tail']['accuracy']:>6.3f} "
            f"{e['source']['accuracy']:>6.3f} {e['no_prefix']['accuracy']:>6.3f} {e['retention']:>6.3f} {e['retention_tail']:>6.3f} "
            f"{_num(e['gap_closed']):>6} {_num(e['gap_closed_tail']):>6} {e['mean_attention_cosine']:>8.3f} "
            f"{s['translate_seconds']:>6.2f} {s['prefill_seconds']:>9.2f} {s['speedup']:>6.1f}x"
        )
    any_eval = next(iter(results.values()))["eval"]
    lines.append(
        f"eval: {any_eval['windows']} windows, prefix {any_eval['prefix_len']}, continuation {any_eval['continuation']}, "
        f"tail {any_eval['tail']}, sink tokens {any_eval['sink_tokens']}; speed at {next(iter(results.values()))['speed']['tokens']} tokens "
        "(map s = map + target's sink tokens). Gap closed = (mapped - source) / (target - source); "
        "meaningless where the source is the better model."
    )
    return "\n".join(lines)


def _bench_prompt(tokenizer, tokens: int) -> torch.Tensor:
    """A prompt of exactly ``tokens`` tokens of real text (stdlib sources)."""
    return next(calibration_windows(tokenizer, stdlib_files(), tokens, tokens, per_file=tokens))


def _pair(a, b) -> str:
    return "n/a" if a is None else f"{a:.2f}/{b:.2f}"


def _num(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"
