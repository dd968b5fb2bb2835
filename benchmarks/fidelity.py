"""Fidelity loop on the real pair: run named configurations, one results row per direction.

    python benchmarks/fidelity.py base-16k cal-64k sink-0 [--windows 16] [--tails 0,8,32,128]
        [--repair ANCHORS:DRAFT[:SWEEPS]]

Each configuration fits both directions of the embedded Qwen2.5-Coder 0.5B/1.5B pair and
evaluates them on held-out text (never calibration text, never used to choose settings), beside
the target's own cache, the source alone and no prefix, at every tail length in --tails, and,
with --repair, the hand-off that also recomputes that many anchors picked by a source draft of
that many tokens (``transfer.Repair``, over the main tail; with SWEEPS, a parallel draft).
Calibration statistics are cached per token budget under $KVMAP_CACHE/stats and grown
from the largest smaller budget, so a new budget only captures the windows it adds.

Writes benchmarks/results/fidelity.json (all rows, newest per config and direction win),
benchmarks/results/fidelity.md (the table) and benchmarks/results/fidelity_tail.png (quality
against recomputed tokens). No asserts: benchmarks measure.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, replace
from pathlib import Path

import click

from sgl_kvmap.core.errors import KVMapError
from sgl_kvmap.fitting.calibrate import (
    CalibrationState,
    calibration_token_windows,
    collect_many,
    fit_from_statistics,
    load_state,
    save_state,
    text_description,
)
from sgl_kvmap.fitting.config import CalibrationConfig, TuneConfig
from sgl_kvmap.fitting.default_pair import LARGE, SMALL, cache_root, ensure_model
from sgl_kvmap.fitting.evaluate import EvalRuns, bootstrap_interval, evaluate, window_scores
from sgl_kvmap.fitting.texts import (
    code_corpus_files,
    default_eval_files,
    dependency_files,
    eval_sources,
    prompt_of_length,
    stdlib_docs_files,
    stdlib_files,
)
from sgl_kvmap.fitting.tune import tune_mapper
from sgl_kvmap.models.capture import load_model
from sgl_kvmap.models.timing import measure_speed
from sgl_kvmap.models.transfer import Repair

RESULTS = Path(__file__).parent / "results"
BASE = CalibrationConfig(tokens=16384)
CONFIGS: dict[str, CalibrationConfig] = {
    "base-16k": BASE,
    "cal-8k": replace(BASE, tokens=8192),
    "cal-32k": replace(BASE, tokens=32768),
    "cal-64k": replace(BASE, tokens=65536),
    "cal-128k": replace(BASE, tokens=131072),
    "sink-0": replace(BASE, sink_tokens=0),
    "sink-1": replace(BASE, sink_tokens=1),
    "sink-16": replace(BASE, sink_tokens=16),
    "k-1": replace(BASE, top_k=1),
    "k-4": replace(BASE, top_k=4),
    "k-all": replace(BASE, top_k=10_000),
    "k-layer": replace(BASE, top_k="auto-layer"),
    "ridge-rel-1e-3": replace(BASE, ridge=1e-3, ridge_relative=True),
    "ridge-rel-1e-2": replace(BASE, ridge=1e-2, ridge_relative=True),
    "ridge-rel-1e-1": replace(BASE, ridge=1e-1, ridge_relative=True),
}
CAL_64K = CONFIGS["cal-64k"]
CONFIGS.update(
    {
        "64k-sink-0": replace(CAL_64K, sink_tokens=0),
        "64k-sink-16": replace(CAL_64K, sink_tokens=16),
        "64k-k-layer": replace(CAL_64K, top_k="auto-layer"),
        "64k-ridge-rel-1e-2": replace(CAL_64K, ridge=1e-2, ridge_relative=True),
        "64k-k-4": replace(CAL_64K, top_k=4),
        "64k-all-rel-1e-2": replace(CAL_64K, top_k=10_000, ridge=1e-2, ridge_relative=True),
        "64k-attn-0.5": replace(CAL_64K, attention_power=0.5),
        "64k-attn-1": replace(CAL_64K, attention_power=1.0),
    }
)
CAL_128K = CONFIGS["cal-128k"]
CONFIGS.update({f"128k-rank-{r}": replace(CAL_128K, rank=r) for r in (512, 768, 1024, "auto")})
CONFIGS["16k-rank-auto"] = replace(BASE, rank="auto")
CONFIGS["128k-k-16"] = replace(CAL_128K, top_k=16)
# more distinct files for the same tokens: at most one 512-token window from each file
CONFIGS.update(
    {f"{t}k-per-file-512": replace(BASE, tokens=t * 1024, per_file_tokens=512) for t in (32, 64)}
)
# a second corpus captured apart and merged into a configuration's statistics (sufficient
# statistics add): name -> (configuration, corpus, its tokens)
CORPORA = {
    "docs": "the stdlib's reference pages (pydoc topics)",
    "deps": "the sources of sgl-kvmap's dependencies (torch, transformers, numpy, ...)",
}
MIXED = {
    f"{fitted}+{corpus}-{tokens // 1024}k": (fitted, corpus, tokens)
    for fitted in ("128k-k-16", "128k-rank-auto")
    for corpus in CORPORA
    for tokens in (16384, 32768)
}
CONFIGS.update({name: CONFIGS[fitted] for name, (fitted, _, _) in MIXED.items()})
# downstream tuning (``tune.tune_mapper``) after a fitted configuration, named
# FIT-tune[-code][-kl][-lr-RATE][-tail][-mlp-H]-STEPS: "-code" tunes on the stdlib and the
# sources of sgl-kvmap's other dependencies (``texts.code_corpus_files``) instead of the stdlib
# alone; "-kl" on the KL divergence from the target's own predictions instead of the NLL;
# "-lr-RATE" at a relative rate other than the map family's; "-tail" tunes and scores the
# hand-off that recomputes the 32-token tail, the table's main tail; "-mlp-H" grows a non-linear
# residual of width H on the reduced-rank map (``residual.Residual``) and tunes it with the rest
# name part -> (label, files); explicit, so a row's name keeps meaning the text it was tuned on
TUNING_TEXTS = {
    "": ("stdlib", stdlib_files),
    "-code": ("stdlib + dependency sources", code_corpus_files),
}
TUNED_NAME = re.compile(
    r"(?P<fitted>.+)-tune(?P<text>-code)?(?P<kl>-kl)?(?:-lr-(?P<lr>\d+(?:\.\d+)?e-\d+))?"
    r"(?P<tail>-tail)?(?:-mlp-(?P<mlp>[1-9]\d*))?-(?P<steps>[1-9]\d*)"
)
TUNE_TAIL = 32


def tuned_spec(name: str) -> tuple[str, TuneConfig, str] | None:
    """(fitted configuration, tuning, tuning-text key) of a tuned name; None for a fitted one.

    >>> tuned_spec("128k-rank-auto-tune-code-lr-3e-5-120")[1].lr
    3e-05
    """
    match = TUNED_NAME.fullmatch(name)
    if match is None or match["fitted"] not in CONFIGS:
        return None
    tuning = TuneConfig(
        steps=int(match["steps"]),
        objective="kl" if match["kl"] else "nll",
        lr=float(match["lr"]) if match["lr"] else None,
        tail=TUNE_TAIL if match["tail"] else 0,
        residual_hidden=int(match["mlp"] or 0),
    )
    return match["fitted"], tuning, match["text"] or ""


def config_for(name: str) -> CalibrationConfig:
    """The calibration of a configuration name, fitted or tuned; a clear error otherwise."""
    spec = tuned_spec(name)
    if spec is not None:
        return CONFIGS[spec[0]]
    if name not in CONFIGS:
        raise click.BadParameter(
            f"unknown configuration {name!r}; fitted ones: {', '.join(sorted(CONFIGS))}; "
            "tuned ones: FIT-tune[-code][-kl][-lr-RATE][-tail][-mlp-H]-STEPS"
        )
    return CONFIGS[name]


class ConfigName(click.ParamType):
    """A fitted configuration (a CONFIGS key) or a tuned one (see ``tuned_spec``)."""

    name = "CONFIG"

    def convert(self, value, param, ctx):
        try:
            config_for(value)
        except click.BadParameter as error:
            self.fail(error.message, param, ctx)
        return value


HELDOUT_SPLIT = "every 8th file"
# token weightings: unweighted for both directions, the attention-weighted ones for 0.5B->1.5B
# only (each direction's statistics take GBs)
WEIGHTINGS = {0.0: True, 0.5: False, 1.0: False}  # attention power -> both directions
DIRECTIONS = ("0.5B->1.5B", "1.5B->0.5B")
CONDITIONS = ("reference", "mapped", "mapped_tail", "repaired", "source", "no_prefix")


class RepairType(click.ParamType):
    """A hand-off repair written ANCHORS:DRAFT[:SWEEPS] (``Repair.parse``)."""

    name = "ANCHORS:DRAFT[:SWEEPS]"

    def convert(self, value, param, ctx):
        if isinstance(value, Repair):
            return value
        try:
            return Repair.parse(value)
        except KVMapError as error:
            self.fail(str(error), param, ctx)


@click.command()
@click.argument("names", nargs=-1, required=True, type=ConfigName())
@click.option("--windows", default=16, show_default=True, help="Evaluation windows.")
@click.option("--prefix-len", default=1024, show_default=True)
@click.option("--continuation", default=64, show_default=True)
@click.option("--tails", default="0,8,32,128", show_default=True, help="Recomputed prompt tokens.")
@click.option("--main-tail", default=32, show_default=True, help="Tail reported in the table.")
@click.option("--speed-tokens", default=2048, show_default=True)
@click.option(
    "--direction",
    "directions",
    multiple=True,
    type=click.Choice(DIRECTIONS),
    help="Evaluate only these directions (default: both).",
)
@click.option(
    "--repair",
    type=RepairType(),
    help="Also score (and time) the hand-off repair ANCHORS:DRAFT[:SWEEPS] over the main tail.",
)
@click.option(
    "--save-packs",
    type=click.Path(file_okay=False, path_type=Path),
    help="Save each row's mapper (tuned ones included) as a pack under DIR/CONFIG/DIRECTION.",
)
def main(
    names,
    windows,
    prefix_len,
    continuation,
    tails,
    main_tail,
    speed_tokens,
    directions,
    repair,
    save_packs,
):
    """Run each configuration NAME: a fitted one (CONFIGS) or a tuned one,
    FIT-tune[-code][-kl][-lr-RATE][-tail][-mlp-H]-STEPS."""
    tails = sorted({0, main_tail, *map(int, tails.split(","))})
    small, large = load_model(str(ensure_model(SMALL))), load_model(str(ensure_model(LARGE)))
    sources = eval_sources(
        large.tokenizer, default_eval_files(), prefix_len + continuation, windows
    )
    eval_ids = [window for _, window in sources]
    runs = EvalRuns(eval_ids, prefix_len, continuation)
    prompt = prompt_of_length(large.tokenizer, speed_tokens)
    prefill_seconds: dict[str, float] = {}
    for name in names:
        config, tuned = config_for(name), tuned_spec(name)
        state = statistics_for(small, large, config)
        mixed = MIXED.get(tuned[0] if tuned is not None else name)  # (fit, corpus, tokens)
        if mixed is not None:
            extra = statistics_for(small, large, replace(config, tokens=mixed[2]), mixed[1])
            state, extra = state.merged(extra), None
        wanted = [
            stats if stats is not None and (not directions or d in directions) else None
            for d, stats in zip(DIRECTIONS, (state.forward, state.reverse))
        ]
        fits = [_timed_fit(stats, config) if stats is not None else None for stats in wanted]
        wanted = None  # with state: the statistics (GBs) are not needed for evaluation
        capture_seconds = state.capture_seconds
        state = None
        for direction, fitted, (source, target) in zip(
            DIRECTIONS, fits, ((small, large), (large, small))
        ):
            if fitted is None:
                continue  # not asked for, or this weighting was captured for one direction only
            mapper, fit, solve_seconds = fitted
            tuning = None
            if tuned is not None:
                _, tune_config, text = tuned
                files = TUNING_TEXTS[text][1]()
                mapper, tuning = tune_mapper(mapper, source, target, files, tune_config)
            if save_packs is not None:
                folder = save_packs / name / direction.replace("->", "_to_")
                mapper.save_pretrained(folder, overwrite=True)
            reports = {
                t: evaluate(
                    mapper,
                    source,
                    target,
                    eval_ids,
                    prefix_len,
                    continuation,
                    t,
                    runs,
                    repair if t == main_tail else None,
                )
                for t in tails
            }
            speeds = {
                t: measure_speed(
                    mapper,
                    source,
                    target,
                    prompt,
                    tail=t,
                    prefill_seconds=prefill_seconds.get(direction),
                )
                for t in (0, main_tail)
            }
            if repair is not None:
                speeds["repaired"] = measure_speed(
                    mapper,
                    source,
                    target,
                    prompt,
                    tail=main_tail,
                    prefill_seconds=speeds[0].prefill_seconds,
                    repair=repair,
                )
            prefill_seconds[direction] = speeds[0].prefill_seconds
            row = _row(
                name,
                direction,
                config,
                capture_seconds,
                fit,
                solve_seconds,
                reports,
                speeds,
                main_tail,
            )
            if tuning is not None:
                row["tuning"] = {
                    **tuning.summary(),
                    "curve": tuning.curve,
                    "text": TUNING_TEXTS[text][0],
                }
            if mixed is not None:
                row["calibration"]["extra"] = {"text": CORPORA[mixed[1]], "tokens": mixed[2]}
            row["by_window"] = [
                {"file": f"{path.parent.name}/{path.name}", **{n: asdict(q) for n, q in w.items()}}
                for (path, _), w in zip(sources, reports[main_tail].by_window)
            ]
            _record(row)
            _write_table()
            _plot()
            print(json.dumps({k: v for k, v in row.items() if k != "tail_curve"}, indent=1))


def statistics_for(small, large, config: CalibrationConfig, corpus: str | None = None):
    """Statistics for ``config`` (its budget and token weighting) on the default calibration
    text or on ``corpus`` (a name in CORPORA), from the cache or captured.

    A capture grows the configuration's weighting (one pass of both models) from the largest
    smaller budget cached for it, and caches the result.
    """
    power = config.attention_power
    if power not in WEIGHTINGS:
        raise click.UsageError(f"attention power {power} not in {WEIGHTINGS}")
    path = _stats_path(config, power, config.tokens, corpus)
    if not path.exists():
        budgets = _cached_budgets(config, power, corpus)
        start = max((b for b in budgets if b < config.tokens), default=None)
        state = (
            load_state(_stats_path(config, power, start, corpus), small.spec, large.spec)
            if start
            else CalibrationState.empty(small.spec, large.spec, WEIGHTINGS[power], power)
        )
        windows = calibration_token_windows(small.tokenizer, _corpus_files(corpus), config)
        (state,) = collect_many(small, large, windows, config, [state])
        save_state(state, path)
        state = None  # free it before loading it back
    return load_state(path, small.spec, large.spec)


def _corpus_files(corpus: str | None):
    if corpus is None:
        return None  # the default calibration text
    if corpus == "docs":
        return stdlib_docs_files(cache_root() / "texts")
    if corpus == "deps":
        return dependency_files()
    raise click.UsageError(f"unknown corpus {corpus!r}; known: {sorted(CORPORA)}")


def _cached_budgets(config: CalibrationConfig, power: float, corpus: str | None) -> set[int]:
    pattern = _stats_path(config, power, "*", corpus)
    return {int(p.stem.rsplit("-t", 1)[1]) for p in pattern.parent.glob(pattern.name)}


def _stats_path(config: CalibrationConfig, power: float, tokens, corpus: str | None) -> Path:
    folder = cache_root() / "stats"
    folder.mkdir(parents=True, exist_ok=True)
    key = f"qwen-coder-0.5b-1.5b-w{config.window}-skip{config.skip_first}-s{config.stride}"
    key += f"-files{config.heldout_every}-attn{power}" + (f"-{corpus}" if corpus else "")
    if config.per_file_tokens != CalibrationConfig.per_file_tokens:
        key += f"-pf{config.per_file_tokens}"
    return folder / f"{key}-t{tokens}.safetensors"


def _timed_fit(stats, config: CalibrationConfig):
    """(mapper, fit report, solve seconds) of one direction."""
    started = time.perf_counter()
    mapper, fit = fit_from_statistics(stats, _effective(config, stats))
    return mapper, fit, time.perf_counter() - started


def _effective(config: CalibrationConfig, stats) -> CalibrationConfig:
    """'k-all' asks for every source layer, whatever the direction's layer count."""
    if isinstance(config.top_k, int) and config.top_k > stats.source.num_layers:
        return replace(config, top_k=stats.source.num_layers)
    return config


def _row(
    name, direction, config, capture_seconds, fit, solve_seconds, reports, speeds, main_tail
) -> dict:
    base, tailed = reports[0], reports[main_tail]
    fast, slow = speeds[0], speeds[main_tail]
    return {
        "config": name,
        "direction": direction,
        "calibration": {
            "text": text_description(None),
            "tokens": config.tokens,
            "window": config.window,
            "per_file_tokens": config.per_file_tokens,
            "heldout_split": HELDOUT_SPLIT,
            "attention_power": config.attention_power,
        },
        "k": _k_label(fit, config),
        "layer_ks": fit.layer_ks,
        "ridge": f"{config.ridge}{' x mean diag' if config.ridge_relative else ''}",
        "sink_tokens": config.sink_tokens,
        "heldout_r2_k": fit.heldout["k"],
        "heldout_r2_v": fit.heldout["v"],
        "eval_r2_k": base.to_dict()["mean_r2_k"],
        "eval_r2_v": base.to_dict()["mean_r2_v"],
        "attention_cosine": base.to_dict()["mean_attention_cosine"],
        "attention_cosine_by_layer": base.attention_cosine,
        "r2_by_layer": {"k": base.r2_k, "v": base.r2_v},
        "accuracy": {n: getattr(tailed, n).accuracy for n in CONDITIONS if getattr(tailed, n)},
        "nll": {n: getattr(tailed, n).nll for n in CONDITIONS if getattr(tailed, n)},
        "main_tail": main_tail,
        "repair": tailed.repair,
        "retention": base.retention,
        "retention_tail": tailed.retention_tail,
        "retention_repaired": tailed.retention_repaired,
        "gap_closed": base.gap_closed,
        "gap_closed_tail": tailed.gap_closed_tail,
        "gap_closed_repaired": tailed.gap_closed_repaired,
        "tail_curve": {
            t: {"accuracy": r.mapped_tail.accuracy, "nll": r.mapped_tail.nll}
            for t, r in reports.items()
        },
        "fit_seconds": capture_seconds + solve_seconds,
        "capture_seconds": capture_seconds,
        "translate": {
            "tokens": fast.tokens,
            "map_seconds": fast.map_seconds,
            "sink_seconds": fast.sink_seconds,
            "separate_sink_seconds": fast.separate_sink_seconds,
            "sinks": "fused into the hand-off forward",
            "handoff_seconds": {0: fast.handoff_seconds, main_tail: slow.handoff_seconds},
            "prefill_seconds": fast.prefill_seconds,
            "speedup_map_sinks": fast.speedup,
            "speedup_end_to_end": {0: fast.end_to_end_speedup, main_tail: slow.end_to_end_speedup},
            "repaired": speeds["repaired"].to_dict() if "repaired" in speeds else None,
        },
        "eval": {
            "windows": base.windows,
            "prefix_len": base.prefix_len,
            "continuation": base.continuation,
        },
    }


def _k_label(fit, config: CalibrationConfig) -> str | int:
    if config.rank is not None:
        return f"all, rank {fit.rank}" + (" (auto)" if config.rank == "auto" else "")
    return fit.chosen_k if config.top_k != "auto-layer" else "per layer"


def _record(row: dict) -> None:
    path = RESULTS / "fidelity.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    key = ("config", "direction", "repair")  # one row per repair setting too
    rows = [r for r in rows if [r.get(k) for k in key] != [row[k] for k in key]]
    path.write_text(json.dumps(rows + [json.loads(json.dumps(row))], indent=1) + "\n")


TABLE = [  # header, cell of one row
    ("config", lambda r: r["config"]),
    ("direction", lambda r: r["direction"]),
    ("cal tokens", lambda r: _calibration_tokens(r["calibration"])),
    ("k", lambda r: str(r["k"])),
    ("sinks", lambda r: str(r["sink_tokens"])),
    ("R2 K / V held-out", lambda r: f"{r['heldout_r2_k']:.3f} / {r['heldout_r2_v']:.3f}"),
    ("attn cos", lambda r: f"{r['attention_cosine']:.3f}"),
    ("target", lambda r: f"{r['accuracy']['reference']:.3f}"),
    ("mapped", lambda r: f"{r['accuracy']['mapped']:.3f}"),
    ("+tail T", lambda r: f"{r['accuracy']['mapped_tail']:.3f}"),
    ("source", lambda r: f"{r['accuracy']['source']:.3f}"),
    ("no prefix", lambda r: f"{r['accuracy']['no_prefix']:.3f}"),
    ("retention (0 / T)", lambda r: f"{_f(r['retention'])} / {_f(r['retention_tail'])}"),
    ("gap closed (0 / T)", lambda r: f"{_f(r['gap_closed'])} / {_f(r['gap_closed_tail'])}"),
    ("90% interval of retention / gap closed at T+repair (else T)", lambda r: _intervals(r)),
    ("NLL mapped / +T", lambda r: f"{r['nll']['mapped']:.3f} / {r['nll']['mapped_tail']:.3f}"),
    ("+T + repair", lambda r: _repaired(r)),
    ("fit s", lambda r: f"{r['fit_seconds']:.0f}"),
    ("tuned: steps, held-out NLL, s", lambda r: _tuned(r)),
    (
        "map+sinks s",
        lambda r: (
            f"{r['translate']['map_seconds'] + r['translate']['sink_seconds']:.2f}"
            + ("" if "sinks" in r["translate"] else " *")
        ),
    ),
    ("x map+sinks", lambda r: f"{r['translate']['speedup_map_sinks']:.1f}"),
    ("x end-to-end (0 / T)", lambda r: _end_to_end(r)),
]


def _repaired(r: dict) -> str:
    """Accuracy, retention, gap closed and end-to-end speedup of the repaired hand-off."""
    if not r.get("repair"):
        return "-"
    gap, speed = r["gap_closed_repaired"], r["translate"]["repaired"]
    return (
        f"{r['accuracy']['repaired']:.3f} (ret {_f(r['retention_repaired'])}, gap {_f(gap)}, "
        f"{speed['end_to_end_speedup']:.1f}x; {r['repair']})"
    )


def _intervals(r: dict) -> str:
    """Bootstrap intervals over the row's windows (``evaluate.bootstrap_interval``) of the
    retention and gap closed of its best condition: repaired if run, else the main tail."""
    if not r.get("by_window"):
        return "-"
    condition = "repaired" if r.get("repair") else "mapped_tail"
    accuracy = {
        name: window_scores(r["by_window"], name) for name in ("reference", "source", condition)
    }
    spans = [bootstrap_interval(accuracy, condition, base) for base in (None, "source")]
    return " / ".join("n/a" if s is None else f"{s[0]:.2f}-{s[1]:.2f}" for s in spans)


def _calibration_tokens(calibration: dict) -> str:
    extra = calibration.get("extra")
    return str(calibration["tokens"]) + (f" + {extra['tokens']} docs" if extra else "")


def _tuned(r: dict) -> str:
    if "tuning" not in r:
        return "-"
    t = r["tuning"]
    return (
        f"{t.get('tune_objective', 'nll')} lr {t['tune_lr']:g}, "
        f"{t['tune_best_step']} of {t['tune_steps']}, "
        f"{t['tune_heldout_nll_fitted']:.3f} -> {t['tune_heldout_nll']:.3f}, "
        f"{t['tune_seconds']:.0f}"
        + (", on " + t["text"] if t.get("text", "stdlib") != "stdlib" else "")
    )


def _end_to_end(r: dict) -> str:
    e2e = r["translate"]["speedup_end_to_end"]
    return f"{e2e['0']:.1f} / {e2e[str(r['main_tail'])]:.1f}"


def _write_table() -> None:
    rows = json.loads((RESULTS / "fidelity.json").read_text())
    rows.sort(key=lambda r: (r["direction"], r["config"]))
    lines = ["| " + " | ".join(h for h, _ in TABLE) + " |", "|" + " --- |" * len(TABLE)]
    lines += ["| " + " | ".join(cell(r) for _, cell in TABLE) + " |" for r in rows]
    note = (
        "Accuracy: the target's top-1 next-token accuracy on the continuation (teacher-forced). "
        "T: the row's main tail (prompt tokens recomputed by the target).\n"
        "Speedups: target re-prefill time over map + what the sink tokens cost, and over the "
        "whole translated path (the map and the target's one hand-off forward over the sink "
        "tokens, the tail and the last prompt token). *: sinks timed as a forward of their own "
        "(rows measured before the sinks were fused into the hand-off forward).\n"
        "Written by `python benchmarks/fidelity.py`."
    )
    (RESULTS / "fidelity.md").write_text(
        f"# Fidelity results\n\n{note}\n\n" + "\n".join(lines) + "\n"
    )
    _write_windows_table(rows)


def _write_windows_table(rows: list[dict]) -> None:
    """Per evaluation window, per direction: the baselines' and every recorded row's NLL on the
    translated cache (no tail), to see which texts a map fails on."""
    sections = [
        "# Fidelity by evaluation window",
        "",
        (
            "NLL on each window's continuation: the target on its own cache, the source alone, "
            "then the target on each configuration's translated cache (no tail; accuracy after "
            "the slash). Written by `python benchmarks/fidelity.py` from the rows that recorded "
            "per-window scores."
        ),
    ]
    for direction in DIRECTIONS:
        chosen = [r for r in rows if r["direction"] == direction and r.get("by_window")]
        if not chosen:
            continue
        header = ["file", "target", "source", *(r["config"] for r in chosen)]
        lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
        by_file = [{w["file"]: w for w in r["by_window"]} for r in chosen]
        for window in chosen[0]["by_window"]:  # rows keyed by file: runs may differ in windows
            cells = [window["file"], _nll_acc(window["reference"]), _nll_acc(window["source"])]
            cells += [
                _nll_acc(row[window["file"]]["mapped"]) if window["file"] in row else "-"
                for row in by_file
            ]
            lines.append("| " + " | ".join(cells) + " |")
        sections += ["", f"## {direction}", "", *lines]
    (RESULTS / "fidelity_windows.md").write_text("\n".join(sections) + "\n")


def _nll_acc(quality: dict) -> str:
    return f"{quality['nll']:.2f} / {quality['accuracy']:.3f}"


def _plot() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = json.loads((RESULTS / "fidelity.json").read_text())
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=False)
    for ax, direction in zip(axes, DIRECTIONS):
        chosen = [r for r in rows if r["direction"] == direction]
        for r in chosen:
            tails = sorted(r["tail_curve"], key=int)
            ax.plot(
                [int(t) for t in tails],
                [r["tail_curve"][t]["accuracy"] for t in tails],
                marker="o",
                label=r["config"],
            )
        if chosen:
            for key, style in (("reference", "--"), ("source", ":"), ("no_prefix", "-.")):
                ax.axhline(
                    chosen[0]["accuracy"][key],
                    color="gray",
                    linestyle=style,
                    label=key.replace("_", " "),
                )
        ticks = sorted({int(t) for r in chosen for t in r["tail_curve"]})
        ax.set_xscale("symlog", linthresh=8)
        ax.set(title=direction, xlabel="prompt tokens recomputed by the target (tail)")
        ax.set(ylabel="top-1 accuracy", xticks=ticks, xticklabels=[str(t) for t in ticks])
        ax.set_xlim(left=0)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "fidelity_tail.png", dpi=120)


def _f(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


if __name__ == "__main__":
    main()
