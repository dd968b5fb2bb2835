"""Head-local against full-layer features (CacheBridge, arXiv:2609.00891), from cached statistics.

    python benchmarks/head_local.py [--tokens 131072] [--k 4 --k 16] [--direction 0.5B->1.5B]
        [--evaluate K]

The method maps each target head from ALL KV heads of its k selected source layers. CacheBridge
restricts a target head to its same-index source head (here: the source heads whose share of
the source's heads matches the target head's share of the target's), for a mapper several times
smaller at, it reports, equal quality. Both are fitted from one set of streamed statistics (a
head-local map's Gram is a sub-block of the full one) with the same selection (the probe's top
k source layers per target layer), ridge and training/held-out split, and scored by held-out
R2 per target layer (mean over heads). With ``--evaluate K`` the head-local map at k = K is
also evaluated downstream beside the full-layer one, on the fidelity loop's 16 windows at tails
0 and 32 (a head-local map is stored as a full-layer map whose off-head blocks are zero).

Statistics come from ``fidelity.py``'s cache (``fidelity.statistics_for``: captured if absent).
Writes benchmarks/results/head_local.md (+ .json). No asserts: benchmarks measure.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import click
import torch
from fidelity import CAL_128K, DIRECTIONS, statistics_for

from sgl_kvmap.core.fit import (
    KINDS,
    Geometry,
    LayerMap,
    Ridge,
    fit_affine,
    maps_heldout_r2,
    probe_scores,
    top_k_selection,
)
from sgl_kvmap.core.spec import spec_from_pretrained
from sgl_kvmap.fitting.calibrate import fit_from_statistics
from sgl_kvmap.fitting.default_pair import LARGE, SMALL, ensure_model
from sgl_kvmap.fitting.evaluate import EvalRuns, evaluate
from sgl_kvmap.fitting.texts import default_eval_files, eval_sources
from sgl_kvmap.models.capture import load_model

RESULTS = Path(__file__).parent / "results"


def source_heads_of(target_head: int, source_heads: int, target_heads: int) -> list[int]:
    """The source KV heads a head-local map gives ``target_head``: those whose position among the
    source's heads falls in the target head's share (one or more; equal counts: the same index).

    >>> source_heads_of(1, 2, 2), source_heads_of(1, 8, 2), source_heads_of(3, 2, 8)
    ([1], [4, 5, 6, 7], [0])
    """
    if source_heads >= target_heads:
        share = source_heads // target_heads
        return list(range(target_head * share, (target_head + 1) * share))
    return [target_head * source_heads // target_heads]


def head_columns(geo: Geometry, layers: list[int], heads: list[int], head_dim: int):
    """Feature columns of ``heads`` (each ``head_dim`` wide) in each of the source ``layers``."""
    cols = geo.source_cols(layers).reshape(len(layers), -1, head_dim)
    return cols[:, heads].reshape(-1)


def fit_head_local(moments, selection, geo, ridge, source_spec, target_spec):
    """Head-local maps of every target layer: Lt x LayerMap with full-layer shapes
    [k * source width, target width], zero outside each target head's own source heads."""
    maps = []
    for layer, sources in enumerate(selection):
        weight = torch.zeros(len(sources) * geo.source_width, geo.target_width, dtype=torch.float64)
        bias = torch.zeros(geo.target_width, dtype=torch.float64)
        for head in range(target_spec.num_kv_heads):
            heads = source_heads_of(head, source_spec.num_kv_heads, target_spec.num_kv_heads)
            x_cols = head_columns(geo, sources, heads, source_spec.head_dim)
            # the same heads' rows within this layer's weight (its selection's columns, in order)
            rows = head_columns(geo, range(len(sources)), heads, source_spec.head_dim)
            out = slice(head * geo.target_head_dim, (head + 1) * geo.target_head_dim)
            w, b = fit_affine(moments, x_cols, geo.target_cols(layer)[out], ridge)
            weight[rows, out] = w
            bias[out] = b
        maps.append(LayerMap(weight, bias))
    return maps


def heldout_scores(train, heldout, selection, geo, ridge, specs, head_local: bool):
    """Held-out R2 (mean over target layers and heads) for K and V, and the maps' parameters."""
    out, parameters = {}, 0
    for kind in KINDS:
        if head_local:
            maps = fit_head_local(train[kind], selection, geo, ridge, *specs)
        else:
            maps = [
                LayerMap(
                    *fit_affine(train[kind], geo.source_cols(s), geo.target_cols(layer), ridge)
                )
                for layer, s in enumerate(selection)
            ]
        out[kind] = maps_heldout_r2(heldout[kind], maps, selection, geo).mean().item()
        parameters += sum(int((m.weight != 0).sum()) + m.bias.numel() for m in maps)
    return out, parameters


@click.command()
@click.option("--tokens", default=CAL_128K.tokens, show_default=True)
@click.option("--k", "ks", multiple=True, type=int, default=(4, 16), show_default=True)
@click.option("--direction", type=click.Choice(DIRECTIONS), default=DIRECTIONS[0])
@click.option("--evaluate", "evaluate_k", type=int, help="Also evaluate both maps at this k.")
def main(tokens, ks, direction, evaluate_k):
    # the R2 comparison needs only the specs (and cached statistics); a downstream one the models
    load = load_model if evaluate_k else _specs_only
    small, large = load(str(ensure_model(SMALL))), load(str(ensure_model(LARGE)))
    config = replace(CAL_128K, tokens=tokens)
    state = statistics_for(small, large, config)
    split = state.forward if direction == DIRECTIONS[0] else state.reverse
    source, target = (small, large) if direction == DIRECTIONS[0] else (large, small)
    geo = Geometry(
        source.spec.num_layers,
        source.spec.kv_width,
        target.spec.num_layers,
        target.spec.kv_width,
        target.spec.head_dim,
    )
    ridge, specs = Ridge(config.ridge), (source.spec, target.spec)
    scores = probe_scores(split.train, geo, ridge)
    rows = []
    for k in ks:
        selection = top_k_selection(scores, k)
        for head_local in (False, True):
            r2, parameters = heldout_scores(
                split.train, split.heldout, selection, geo, ridge, specs, head_local
            )
            rows.append(
                {
                    "k": k,
                    "features": "head-local" if head_local else "full layer",
                    "heldout_r2_k": r2["k"],
                    "heldout_r2_v": r2["v"],
                    "parameters": parameters,
                }
            )
            print(json.dumps(rows[-1]))
    if evaluate_k:
        rows += _downstream(split, source, target, geo, ridge, specs, evaluate_k, config)
    _write(rows, direction, tokens)


def _specs_only(path: str) -> SimpleNamespace:
    """A stand-in for a loaded model where only its spec (and tokenizer) is read."""
    from transformers import AutoTokenizer

    return SimpleNamespace(
        spec=spec_from_pretrained(path), tokenizer=AutoTokenizer.from_pretrained(path)
    )


def _downstream(split, source, target, geo, ridge, specs, k, config):
    """Translated and +32-tail accuracy / NLL of the full-layer and head-local maps at k."""
    full, _ = fit_from_statistics(split, replace(config, top_k=k, rank=None))
    everything = {kind: split.train[kind].merged(split.heldout[kind]) for kind in KINDS}
    local_maps = {
        kind: [
            LayerMap(m.weight.float(), m.bias.float())
            for m in fit_head_local(everything[kind], full.selection, geo, ridge, *specs)
        ]
        for kind in KINDS
    }
    local = replace(full, maps=local_maps)
    windows = [w for _, w in eval_sources(target.tokenizer, default_eval_files(), 1088, 16)]
    runs = EvalRuns(windows, 1024, 64)
    rows = []
    for name, mapper in (("full layer", full), ("head-local", local)):
        report = evaluate(mapper, source, target, windows, 1024, 64, 32, runs)
        for tail, quality in ((0, report.mapped), (32, report.mapped_tail)):
            rows.append(
                {
                    "k": k,
                    "features": name,
                    "tail": tail,
                    "target": report.reference.accuracy,
                    "source": report.source.accuracy,
                    "no_prefix": report.no_prefix.accuracy,
                    "accuracy": quality.accuracy,
                    "nll": quality.nll,
                    "retention": quality.accuracy / report.reference.accuracy,
                }
            )
            print(json.dumps(rows[-1]))
    return rows


def _write(rows, direction, tokens):
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "head_local.json").write_text(json.dumps(rows, indent=1) + "\n")
    fits = [r for r in rows if "heldout_r2_k" in r]
    lines = [
        f"# Head-local vs full-layer features ({direction}, {tokens} calibration tokens)",
        "",
        "Written by `python benchmarks/head_local.py`. Held-out R2 is the mean over target "
        "layers and heads on the held-out calibration windows.",
        "",
        "| k | features | held-out R2 K / V | map parameters (K + V) |",
        "| --- | --- | --- | --- |",
    ]
    lines += [
        f"| {r['k']} | {r['features']} | {r['heldout_r2_k']:.3f} / {r['heldout_r2_v']:.3f} | "
        f"{r['parameters']:,} |"
        for r in fits
    ]
    evaluated = [r for r in rows if "tail" in r]
    if evaluated:
        first = evaluated[0]
        lines += [
            "",
            f"Downstream on 16 held-out windows (1,024 + 64 tokens): target "
            f"{first['target']:.3f}, source alone {first['source']:.3f}, no prefix "
            f"{first['no_prefix']:.3f}.",
            "",
            "| k | features | tail | accuracy | NLL | retention |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        lines += [
            f"| {r['k']} | {r['features']} | {r['tail']} | {r['accuracy']:.3f} | {r['nll']:.3f} | "
            f"{r['retention']:.3f} |"
            for r in evaluated
        ]
    (RESULTS / "head_local.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
