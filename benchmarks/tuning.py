"""Tuning recipes side by side: one fitted pack, several (objective, learning rate) recipes.

    python benchmarks/tuning.py PACK [--recipe nll:1e-4] [--recipe kl:1e-4] ... [--steps 30]
        [--eval-every 10] [--heldout-windows 6] [--name NAME]

The models are loaded once; every recipe tunes a fresh copy of the pack's map for the same
steps on the same training windows and is scored on the same held-out calibration windows
(the calibration's held-out files, never a training step's). Beside the curves, the same
windows are scored for the target on its own cache, the source alone and the target with no
prefix, so each held-out NLL reads against what the swap should reach and what it must beat.
This compares recipes cheaply; `benchmarks/fidelity.py` measures a chosen recipe on the
evaluation text. The text is ``tune_mapper``'s default: the code corpus
(``texts.code_corpus_files``); rows measured before it became the default read the stdlib
alone.

Writes benchmarks/results/tuning.json (rows keyed by name and recipe, newest win) and
benchmarks/results/tuning.md. No asserts: benchmarks measure.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import click

from sgl_kvmap.core.mapper import KVMapper
from sgl_kvmap.fitting.config import OBJECTIVES, TuneConfig
from sgl_kvmap.fitting.evaluate import EvalRuns
from sgl_kvmap.fitting.tune import tune_mapper, tuning_windows
from sgl_kvmap.models.capture import load_model

RESULTS = Path(__file__).parent / "results"


def parse_recipe(text: str) -> tuple[str, float]:
    """'kl:1e-4' -> ('kl', 1e-4)."""
    objective, _, lr = text.partition(":")
    if objective not in OBJECTIVES or not lr:
        raise click.BadParameter(f"recipe must be OBJECTIVE:LR with OBJECTIVE in {OBJECTIVES}")
    return objective, float(lr)


def heldout_baselines(source, target, config: TuneConfig) -> dict:
    """Mean NLL and accuracy on the tuning's held-out windows for the target on its own cache,
    the source alone and the target with no prefix (the same windows ``tune_mapper`` scores)."""
    _, heldout = tuning_windows(source.tokenizer, None, config)
    runs = EvalRuns(heldout, config.prompt_len, config.continuation)
    out = {}
    for name, model, attribute in (
        ("target", target, "own"),
        ("source", source, "own"),
        ("no_prefix", target, "no_prefix"),
    ):
        scores = [getattr(runs.get(model, i), attribute) for i in range(len(heldout))]
        out[name] = {
            "nll": sum(nll.mean().item() for _, nll in scores) / len(scores),
            "accuracy": sum(c.float().mean().item() for c, _ in scores) / len(scores),
        }
    return out


@click.command()
@click.argument("pack", type=click.Path(exists=True, file_okay=False))
@click.option("--recipe", "recipes", multiple=True, default=("nll:1e-4", "kl:1e-4"))
@click.option("--steps", default=30, show_default=True)
@click.option("--eval-every", default=10, show_default=True)
@click.option("--heldout-windows", default=TuneConfig.heldout_windows, show_default=True)
@click.option("--name", default=None, help="Row label (default: the pack folder's name).")
def main(pack, recipes, steps, eval_every, heldout_windows, name) -> None:
    mapper = KVMapper.from_pretrained(pack)
    source = load_model(mapper.source.model_id)
    target = load_model(mapper.target.model_id)
    name = name or Path(pack).name
    base = TuneConfig(steps=steps, eval_every=eval_every, heldout_windows=heldout_windows)
    baselines = heldout_baselines(source, target, base)
    print(json.dumps(baselines, indent=1))
    for recipe in recipes:
        objective, lr = parse_recipe(recipe)
        config = TuneConfig(**{**asdict(base), "objective": objective, "lr": lr})
        started = time.perf_counter()
        _, report = tune_mapper(mapper, source, target, None, config)
        row = {
            "name": name,
            "recipe": recipe,
            "direction": f"{mapper.source.model_id} -> {mapper.target.model_id}",
            "config": asdict(config),
            "baselines": baselines,
            "curve": report.curve,
            "best_step": report.best_step,
            "seconds": round(time.perf_counter() - started, 1),
            "measured": time.strftime("%Y-%m-%d %H:%M"),
        }
        _record(row)
        _write_table()
        print(json.dumps(row, indent=1))


def _record(row: dict) -> None:
    path = RESULTS / "tuning.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    rows = [r for r in rows if (r["name"], r["recipe"]) != (row["name"], row["recipe"])]
    path.write_text(json.dumps([*rows, row], indent=1) + "\n")


def _write_table() -> None:
    rows = json.loads((RESULTS / "tuning.json").read_text())
    lines = [
        "# Tuning recipes",
        "",
        "Held-out calibration windows (the calibration's held-out files; prompt translated with "
        "no tail, the target's own layer 0 and sink tokens), mean NLL / top-1 accuracy on the "
        "continuation. Step 0 is the fitted map. Written by `python benchmarks/tuning.py`.",
        "",
        "| pack | recipe | steps | target | source | no prefix | held-out NLL by step "
        "(accuracy at best) | best step | s per step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        b = r["baselines"]
        curve = " -> ".join(f"{p['step']}: {p['heldout_nll']:.3f}" for p in r["curve"])
        best = next(p for p in r["curve"] if p["step"] == r["best_step"])
        lines.append(
            f"| {r['name']} | {r['recipe']} | {r['config']['steps']} "
            f"| {b['target']['nll']:.3f} / {b['target']['accuracy']:.3f} "
            f"| {b['source']['nll']:.3f} / {b['source']['accuracy']:.3f} "
            f"| {b['no_prefix']['nll']:.3f} / {b['no_prefix']['accuracy']:.3f} "
            f"| {curve} ({best['heldout_accuracy']:.3f}) | {r['best_step']} "
            f"| {r['seconds'] / r['config']['steps']:.1f} |"
        )
    (RESULTS / "tuning.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
