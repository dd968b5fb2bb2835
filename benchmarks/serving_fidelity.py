"""Fidelity of a swap served through SGLang's control flow, next to the library's hand-off.

    python benchmarks/serving_fidelity.py PACK [--windows 16] [--prefix-len 1024]
        [--continuation 64] [--page 64] [--out benchmarks/results/serving_fidelity.json]

On the evaluation windows `sgl-kvmap eval` uses, the session's history (the first
``prefix-len`` tokens) is served by the 0.5B engine, which stores its pages; then the 1.5B
continues the window (teacher-forced: it computes from token ``prefix-len`` on and predicts the
``continuation`` tokens after it). Conditions, all scored on the same tokens:

- reference: the 1.5B over the whole window (its own cache); source: the 0.5B alone;
  no prefix: the 1.5B without the history;
- library hand-off: ``translate_prefix`` (the map, the target's own sink tokens and its own
  layer 0), the history's KV in float32; library map only: ``KVMapper.map`` alone;
- served (a): a fresh 1.5B engine, every history page translated by KVMapStorage (first page
  included); served (b): a 1.5B engine whose tree holds the first page of its own (a shared
  opening), the rest translated; served (a) + tail: ``tail_pages`` 1, the last history page
  computed by the 1.5B itself. Engines are sgl_kvmap/sglang/engine.py (SGLang 0.5.23's own cache
  classes and scheduler calls on CPU, bfloat16 pools).

Retention (accuracy over the reference's) and gap closed ((condition - source) / (reference -
source)) with 90% bootstrap intervals over windows; the served conditions paired with the
library's hand-off window by window.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import click
import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sgl_kvmap import KVMapper, load_model, translate_prefix  # noqa: E402
from sgl_kvmap.fitting.default_pair import LARGE, SMALL, ensure_model  # noqa: E402
from sgl_kvmap.fitting.evaluate import bootstrap_interval, paired_difference  # noqa: E402
from sgl_kvmap.fitting.texts import default_eval_files, eval_windows  # noqa: E402
from sgl_kvmap.models.capture import run  # noqa: E402
from sgl_kvmap.sglang import PeerSettings, StorageSettings  # noqa: E402
from sgl_kvmap.sglang.launch import sglang_extra_config  # noqa: E402

RESULTS = Path(__file__).parent / "results"
SERVED = {
    "served (a)": {"tail_pages": 0},
    "served (b)": {"tail_pages": 0},
    "served (a) + tail": {"tail_pages": 1},
}


@click.command()
@click.argument("pack", type=click.Path(exists=True, file_okay=False))
@click.option("--windows", default=16, show_default=True)
@click.option("--prefix-len", default=1024, show_default=True)
@click.option("--continuation", default=64, show_default=True)
@click.option("--page", default=64, show_default=True)
@click.option(
    "--out", type=click.Path(dir_okay=False), default=str(RESULTS / "serving_fidelity.json")
)
def main(pack, windows, prefix_len, continuation, page, out) -> None:
    from sgl_kvmap.sglang.engine import Engine

    if prefix_len % page:
        raise click.BadParameter("the history must be whole pages", param_hint="--prefix-len")
    names = str(ensure_model(SMALL)), str(ensure_model(LARGE))
    small, large = load_model(names[0]), load_model(names[1])
    mapper = KVMapper.from_pretrained(pack)
    texts = eval_windows(
        large.tokenizer, default_eval_files(), prefix_len + continuation + 1, windows
    )
    scores: dict[str, list[tuple[float, float]]] = {}

    def add(name: str, logits: torch.Tensor, labels: torch.Tensor) -> None:
        correct = (logits.argmax(-1) == labels).double().mean().item()
        scores.setdefault(name, []).append((correct, F.cross_entropy(logits, labels).item()))

    for window in tqdm(texts, desc="windows", unit="win"):
        window = window[: prefix_len + continuation + 1]
        history, scored = window[:prefix_len], window[: prefix_len + continuation]
        labels = window[prefix_len + 1 :]
        keep = continuation
        add("reference", run(large.model, scored, logits_to_keep=keep).logits, labels)
        source_run = run(small.model, scored, logits_to_keep=keep)
        add("source", source_run.logits, labels)
        add("no prefix", run(large.model, scored[prefix_len:], logits_to_keep=keep).logits, labels)
        source_cache = source_run.cache.slice(0, prefix_len)
        rest = scored[prefix_len:]
        handed = translate_prefix(mapper, source_cache, history, large.model)
        add(
            "library hand-off",
            run(large.model, rest, past=handed, logits_to_keep=keep).logits,
            labels,
        )
        mapped = mapper.map(source_cache)
        add(
            "library map only",
            run(large.model, rest, past=mapped, logits_to_keep=keep).logits,
            labels,
        )
        for name, settings in SERVED.items():
            store = tempfile.mkdtemp(prefix="serving-fidelity-")
            peer = PeerSettings(names[0], str(pack))
            on = StorageSettings(  # measures the translation: no quality floor
                translate=True, interface_v1=True, peers=(peer,), quality_floor=None, **settings
            )
            off = StorageSettings(interface_v1=True)
            engines = [
                Engine(
                    model,
                    engine_name,
                    sglang_extra_config(storage, store),
                    page_size=page,
                    slots=2 * len(window),
                    prefetch_threshold=page,
                    prefetch_policy="wait_complete",
                )
                for model, engine_name, storage in ((small, names[0], off), (large, names[1], on))
            ]
            try:
                if name == "served (b)":  # the opening, computed before the 0.5B stored it
                    engines[1].serve(history[: page + 1].tolist())
                engines[0].serve(history.tolist())
                served = engines[1].serve(scored.tolist())
                expected = prefix_len - settings.get("tail_pages", 0) * page
                own_pages = 1 if name == "served (b)" else 0
                assert served.reused == expected, (name, served.reused)
                translated = engines[1].storage.counters["translated_pages_delivered"]
                assert translated == expected // page - own_pages, (name, translated)
                add(name, served.logits[-keep:], labels)
            finally:
                for engine in engines:
                    engine.close()

    result = summary(scores, mapper, windows, prefix_len, continuation, page)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))


def summary(scores, mapper, windows, prefix_len, continuation, page) -> dict:
    accuracy = {
        name: torch.tensor([a for a, _ in s], dtype=torch.float64) for name, s in scores.items()
    }
    nll = {name: torch.tensor([n for _, n in s], dtype=torch.float64) for name, s in scores.items()}
    rows = {}
    for name in scores:
        row = {"accuracy": accuracy[name].mean().item(), "nll": nll[name].mean().item()}
        if name not in ("reference", "source", "no prefix"):
            row["retention"] = row["accuracy"] / accuracy["reference"].mean().item()
            row["retention_interval"] = bootstrap_interval(accuracy, name, None)
            spread = accuracy["reference"].mean() - accuracy["source"].mean()
            row["gap_closed"] = (
                (accuracy[name].mean() - accuracy["source"].mean()) / spread
            ).item()
            row["gap_closed_interval"] = bootstrap_interval(accuracy, name, "source")
        if name.startswith("served"):
            row["vs_library_hand_off"] = paired_difference(
                accuracy["library hand-off"], accuracy[name]
            )
        rows[name] = row
    return {
        "windows": windows,
        "prefix_len": prefix_len,
        "continuation": continuation,
        "page_size": page,
        "sink_tokens": mapper.sink_tokens,
        "pack_k": mapper.source_layers_per_target,
        "pack_rank": mapper.rank,
        "conditions": rows,
        "by_window": {name: s for name, s in scores.items()},
    }


def table(result: dict) -> str:
    lines = [
        "| condition | accuracy | NLL | retention (90% interval) | gap closed (90% interval) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, row in result["conditions"].items():
        cells = [name, f"{row['accuracy']:.3f}", f"{row['nll']:.3f}"]
        for key in ("retention", "gap_closed"):
            cells.append(_with_interval(row.get(key), row.get(f"{key}_interval")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _with_interval(value, interval) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" + (f" ({interval[0]:.3f}-{interval[1]:.3f})" if interval else "")


if __name__ == "__main__":
    main()
