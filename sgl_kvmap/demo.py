"""``sgl-kvmap demo``: the main job on the embedded Qwen2.5-Coder 0.5B / 1.5B pair.

Fetch and convert the pair (once), fit both directions on the Python standard library's
sources (one pass, shared captures), evaluate each direction on disjoint text beside its
baselines (translated, + tail, + tail and the repair's anchors), time each hand-off against the
target's re-prefill, save both packs with their measured metrics (and keep them as the packs
built here for the pair with the demo's recipe, unless there are some: ``resolve``, ``bench``
and ``sglang-args`` then find them), write results.json and return one printed table.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path

from .fitting.calibrate import fit_mapper
from .fitting.config import DemoConfig
from .fitting.default_pair import LARGE, SMALL, ensure_model
from .fitting.evaluate import EvalRuns, evaluate
from .fitting.texts import default_eval_files, eval_windows, prompt_of_length
from .fitting.tune import tune_mapper
from .models.capture import load_model
from .models.timing import measure_speed
from .registry.resolve import keep_as_built


def run_demo(out: Path, config: DemoConfig = DemoConfig()) -> str:
    """Run the whole job as ``config`` says and return the summary table (also saved under
    ``out`` with both packs and results.json)."""
    recipe, evaluation = config.recipe, config.evaluation
    small = load_model(str(ensure_model(SMALL)))
    large = load_model(str(ensure_model(LARGE)))
    fits = fit_mapper(small, large, config=recipe.calibration, both_directions=True)
    fit_peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    prefix_len, continuation = evaluation.prefix_len, evaluation.continuation
    eval_ids = eval_windows(
        large.tokenizer, default_eval_files(), prefix_len + continuation, evaluation.windows
    )
    bench_ids = prompt_of_length(large.tokenizer, evaluation.speed_tokens)
    runs = EvalRuns(eval_ids, prefix_len, continuation)  # each model's own passes, shared
    tail, repair = evaluation.tail, evaluation.repair
    results = {}
    for (mapper, fit_report), (source, target), name in zip(
        fits, [(small, large), (large, small)], ("0.5B->1.5B", "1.5B->0.5B")
    ):
        tuning = None
        if recipe.tuning is not None:
            mapper, tuning = tune_mapper(mapper, source, target, None, recipe.tuning)
        report = evaluate(
            mapper, source, target, eval_ids, prefix_len, continuation, tail, runs, repair
        )
        speed = measure_speed(mapper, source, target, bench_ids)
        repaired = measure_speed(
            mapper,
            source,
            target,
            bench_ids,
            tail=tail,
            repair=repair,
            prefill_seconds=speed.prefill_seconds,
        )
        mapper.info["metrics"].update(report.summary())
        mapper.info["metrics"].update({f"speed_{k}": v for k, v in speed.to_dict().items()})
        if repair is not None:
            mapper.info["metrics"].update(
                {f"speed_repaired_{k}": v for k, v in repaired.to_dict().items()}
            )
        mapper.save_pretrained(
            Path(out) / name.replace(">", "").replace("-", "_to_"), overwrite=True
        )
        keep_as_built(mapper, recipe)  # so resolve, bench and sglang-args find it
        results[name] = {
            "fit": {**fit_report.summary(), "process_peak_rss_gib": round(fit_peak_gib, 2)},
            "tuning": tuning and {**tuning.summary(), "curve": tuning.curve},
            "fit_per_k": fit_report.per_k,
            "eval": report.to_dict(),
            "speed": speed.to_dict(),
            "speed_repaired": repaired.to_dict(),
        }
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    return format_table(results) + f"\n\npacks and results.json written to {out}/"


COLUMNS = [  # header, width, value from one direction's fit, eval and speed results
    ("k", 6, lambda f, e, r: f"r{f['rank']}" if f.get("rank") else str(f["k"])),
    ("R2 K/V k=1", 11, lambda f, e, r: _pair(f["heldout_r2_k_k1"], f["heldout_r2_v_k1"])),
    ("R2 K/V", 11, lambda f, e, r: _pair(f["heldout_r2_k"], f["heldout_r2_v"])),
    ("target", 6, lambda f, e, r: _num(e["reference"]["accuracy"])),
    ("mapped", 6, lambda f, e, r: _num(e["mapped"]["accuracy"])),
    ("+tail", 6, lambda f, e, r: _num(e["mapped_tail"]["accuracy"])),
    ("+rep", 6, lambda f, e, r: _num((e["repaired"] or {}).get("accuracy"))),
    ("source", 6, lambda f, e, r: _num(e["source"]["accuracy"])),
    ("no pfx", 6, lambda f, e, r: _num(e["no_prefix"]["accuracy"])),
    ("retain", 6, lambda f, e, r: _num(e["retention"])),
    ("+tail", 6, lambda f, e, r: _num(e["retention_tail"])),
    ("+rep", 6, lambda f, e, r: _num(e["retention_repaired"])),
    ("served", 6, lambda f, e, r: _num(e.get("retention_served"))),
    ("gap", 6, lambda f, e, r: _num(e["gap_closed"])),
    ("+tail", 6, lambda f, e, r: _num(e["gap_closed_tail"])),
    ("+rep", 6, lambda f, e, r: _num(e["gap_closed_repaired"])),
    ("served", 6, lambda f, e, r: _num(e.get("gap_closed_served"))),
    ("attn cos", 8, lambda f, e, r: _num(e["mean_attention_cosine"])),
    ("map s", 6, lambda f, e, r: f"{r['speed']['map_seconds']:.2f}"),
    ("sinks s", 7, lambda f, e, r: f"{r['speed']['sink_seconds']:.2f}"),
    ("handoff s", 9, lambda f, e, r: f"{r['speed']['handoff_seconds']:.2f}"),
    ("prefill s", 9, lambda f, e, r: f"{r['speed']['prefill_seconds']:.2f}"),
    ("x map", 6, lambda f, e, r: f"{r['speed']['map_speedup']:.0f}x"),
    ("x map+sinks", 11, lambda f, e, r: f"{r['speed']['speedup']:.1f}x"),
    ("x end-to-end", 12, lambda f, e, r: f"{r['speed']['end_to_end_speedup']:.1f}x"),
    ("x +rep", 6, lambda f, e, r: f"{r['speed_repaired']['end_to_end_speedup']:.1f}x"),
]


def format_table(results: dict) -> str:
    """One table: per direction, fidelity beside baselines, R^2, attention cosine, speed."""
    lines = [
        "top-1 accuracy on the continuation (teacher-forced); R2 held out on calibration text",
        f"{'direction':<11} " + " ".join(f"{h:>{w}}" for h, w, _ in COLUMNS),
    ]
    for name, r in results.items():
        cells = (f"{get(r['fit'], r['eval'], r):>{w}}" for _, w, get in COLUMNS)
        lines.append(f"{name:<11} " + " ".join(cells))
    e, s = next(iter(results.values()))["eval"], next(iter(results.values()))["speed"]
    lines += [
        f"eval: {e['windows']} windows, prefix {e['prefix_len']}, "
        f"continuation {e['continuation']}, "
        f"tail {e['tail']}, sink tokens {e['sink_tokens']}; speed at {s['tokens']} tokens",
        f"+rep: the tail and the repair ({e['repair'] or 'off'}) recomputed by the target",
        f"served: as engines serve it ({e.get('served_page_size')}-token pages, the first "
        f"computed by the target, a {e.get('served_tail')}-token tail): the figure "
        "`sgl-kvmap sglang-args` checks against its quality floor",
        "speedups = target re-prefill over: the map; map + what the sink tokens add to the",
        "hand-off forward; map + the target's one hand-off forward (sink tokens and the last",
        "prompt token together); x +rep: the same with the tail, the source's draft and the",
        "anchors. gap = (mapped - source) / (target - source), n/a where the source is the",
        "better model: read retention there. k: source layers per target layer (rN: all of",
        "them through a shared rank-N projection).",
    ]
    return "\n".join(lines)


def _pair(a, b) -> str:
    return "n/a" if a is None else f"{a:.2f}/{b:.2f}"


def _num(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"
