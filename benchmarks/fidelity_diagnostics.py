"""Where does a translated cache lose the target's accuracy? Swap parts of it, and recompute.

    python benchmarks/fidelity_diagnostics.py cal-64k [--windows 16] [--direction 0.5B->1.5B]
        [--part swaps --part recompute --part selectors --part draft ...] [--packs DIR]

On the held-out evaluation windows of benchmarks/fidelity.py (same text, same mapper fit from
the same cached statistics), the target continues from its translated cache with one part
replaced by its OWN KV (oracles: what a perfect map of that part would give), or with some
tokens recomputed by the target (real levers, costed in recomputed tokens):

- target K / target V: is the loss in the keys or the values?
- target KV in the N worst layers by attention-output cosine (read from fidelity.py's row
  for this configuration), the first 8 or the last 8 layers: is it a few layers?
- target KV for the N prefix tokens the continuation attends to most (oracle: it uses the
  continuation's own attention): is it a few tokens?
- recompute the last N prompt tokens (the tail) vs recompute N "anchor" tokens plus the last
  16, the anchors chosen either by the attention that the last 16 prompt tokens pay to the rest
  in the target (recomputed first over the translated cache, so they are paid for twice) or in
  the source over its own cache (16 source tokens, about a third of the price on this pair):
  which spends recomputed tokens better?
- selectors (``--part selectors``): 112 anchors + the last 16 recomputed (128 tokens) each time,
  the anchors chosen by different attention: the continuation's in the target or in the source
  (oracles: the future is not known at hand-off), the last 16 prompt tokens' in the target over
  its own cache (oracle: that cache is what the hand-off lacks), and the source's own from its
  last 16, 64 or 256 prompt tokens or from every prompt token (what an engine could record
  while the source prefills): is it the queries or the model that picks badly?
- draft (``--part draft``): the same 128 tokens, anchors chosen by the source's attention while
  it drafts 32 tokens greedily after the prompt (a guess at the continuation's queries).
- repair (``--part repair``): the library's hand-off repair (``transfer.Repair``: anchors picked
  by a source draft, recomputed with the sinks) over a grid of anchors x draft lengths.
- lazy (``--part lazy``): repair during decoding instead: the target reads the continuation in
  chunks, and after each chunk recomputes the prompt tokens that chunk's queries attended to
  most (over the cache as repaired so far), so the tokens it leans on are repaired by its own
  attention; optionally after a hand-off repair.
- parallel (``--part parallel``): the hand-off repair with a parallel draft (``Repair.sweeps``:
  a prompt-lookup guess of 32 tokens refined in 1, 2 or 4 parallel source forwards) against
  serial greedy drafts of the same number of source forwards and the serial 32-token draft.

With ``--packs DIR`` the mapper is read from ``DIR/NAME/<direction>`` (what ``fidelity.py
--save-packs DIR`` wrote) instead of refitted, so NAME may be a tuned configuration too.

Writes benchmarks/results/fidelity_diagnostics.json and .md (a run adds or replaces its parts'
rows in the configuration's table). No asserts: benchmarks measure.
"""

from __future__ import annotations

import json
from pathlib import Path

import click
import torch
from fidelity import (
    CONFIGS,
    DIRECTIONS,
    RESULTS,
    ConfigName,
    _timed_fit,
    statistics_for,
    tuned_spec,
)
from tqdm.auto import tqdm

from sgl_kvmap.core.cache import KVCache
from sgl_kvmap.core.mapper import KVMapper
from sgl_kvmap.core.token_weights import attention_paid
from sgl_kvmap.fitting.default_pair import LARGE, SMALL, ensure_model
from sgl_kvmap.fitting.evaluate import EvalRuns, continuation_scores
from sgl_kvmap.fitting.texts import default_eval_files, eval_windows
from sgl_kvmap.models.capture import load_model, recompute_tokens, run
from sgl_kvmap.models.transfer import (
    Repair,
    draft_anchors,
    draft_attention,
    top_attended,
    translate_prefix,
)

PROBE = 16  # prompt tokens recomputed first; their attention picks the anchors
SELECTOR_ANCHORS = 112  # + the PROBE tail: 128 recomputed tokens for every selector
PARTS = ("swaps", "recompute", "selectors", "draft", "repair", "lazy", "parallel")
DRAFT = 32  # tokens the source drafts after the prompt; their attention picks the anchors
DRAFTS = (1, 8, 32)
REPAIRS = [Repair(a, d) for a in (48, 112, 240) for d in DRAFTS]
# parallel drafts of DRAFT tokens in 1 + s source forwards, beside serial drafts of the same
# forward count (1 + s tokens) and the serial DRAFT-token draft
SWEEPS = (1, 2, 4)
PARALLEL = [
    repair
    for anchors in (112, 240)
    for repair in (
        *(Repair(anchors, DRAFT, s) for s in SWEEPS),
        *(Repair(anchors, 1 + s) for s in SWEEPS),
        Repair(anchors, DRAFT),
    )
]
LAZY = [  # (hand-off repair or None, chunk of continuation tokens, tokens repaired per chunk)
    (None, 8, 16),
    (None, 4, 8),
    (Repair(48, 8), 8, 8),
    (Repair(112, 8), 8, 16),
]
ORACLE = "oracle selection"
WORST_LAYERS = 5
LAYER0 = "exact"  # translated caches carry the target's own layer 0 (transfer.translate_prefix)


@click.command()
@click.argument("name", type=ConfigName())
@click.option("--windows", default=16, show_default=True)
@click.option("--prefix-len", default=1024, show_default=True)
@click.option("--continuation", default=64, show_default=True)
@click.option(
    "--direction",
    "directions",
    multiple=True,
    type=click.Choice(DIRECTIONS),
    default=("0.5B->1.5B",),
    show_default=True,
)
@click.option(
    "--worst-from",
    type=ConfigName(),
    help="fidelity.py row whose per-layer cosine names the worst layers [NAME].",
)
@click.option(
    "--part",
    "parts",
    multiple=True,
    type=click.Choice(PARTS),
    default=PARTS,
    show_default=True,
    help="Which conditions to run.",
)
@click.option(
    "--packs",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="Read NAME's mappers from DIR/NAME/<direction> (fidelity.py --save-packs) "
    "instead of refitting.",
)
def main(name, windows, prefix_len, continuation, directions, worst_from, parts, packs):
    if packs is None and tuned_spec(name) is not None:
        raise click.BadParameter(
            f"{name} is tuned and diagnostics do not tune: pass --packs (fidelity.py "
            "--save-packs wrote them)",
            param_hint="NAME",
        )
    small, large = load_model(str(ensure_model(SMALL))), load_model(str(ensure_model(LARGE)))
    eval_ids = eval_windows(
        large.tokenizer, default_eval_files(), prefix_len + continuation, windows
    )
    runs = EvalRuns(eval_ids, prefix_len, continuation)
    if packs is not None:
        fits = saved_packs(packs, name, directions)
    else:
        fits = refitted(small, large, name, directions)
    for direction, mapper in fits.items():
        source, target = (small, large) if direction == DIRECTIONS[0] else (large, small)
        worst = worst_layers(worst_from or name, direction) if "swaps" in parts else []
        scores: dict[str, list] = {}
        for i in tqdm(range(windows), desc=f"diagnostics {direction}", unit="win"):
            for label, (cache, cost) in conditions(
                mapper,
                runs.get(source, i),
                runs.get(target, i),
                source,
                target,
                runs.windows[i],
                prefix_len,
                worst,
                parts,
            ).items():
                correct, nll = (
                    continuation_scores(target.model, cache, runs.windows[i], prefix_len)
                    if isinstance(cache, KVCache)
                    else cache  # scored already
                )
                scores.setdefault(label, []).append((correct.float(), nll, cost))
            own = runs.get(target, i).own, runs.get(source, i).own, runs.get(target, i).no_prefix
            for label, (correct, nll), cost in zip(
                ("target", "source", "no prefix"), own, ("all (re-prefill)", "-", "-")
            ):
                scores.setdefault(label, []).append((correct.float(), nll, cost))
        _record(name, direction, worst, prefix_len, continuation, windows, scores)
        if "repair" in parts:
            _plot_repairs(name, direction, prefix_len, continuation)
    _write_table()


def saved_packs(packs: Path, name: str, directions) -> dict[str, KVMapper]:
    """direction -> the mapper ``fidelity.py --save-packs`` wrote for NAME."""
    folders = {d: packs / name / d.replace("->", "_to_") for d in directions}
    missing = [str(f) for f in folders.values() if not (f / "kvmap.json").is_file()]
    if missing:
        raise click.BadParameter(f"no pack at {', '.join(missing)}", param_hint="--packs")
    return {d: KVMapper.from_pretrained(folder) for d, folder in folders.items()}


def refitted(small, large, name: str, directions) -> dict[str, KVMapper]:
    """direction -> NAME's mapper fitted from its cached calibration statistics."""
    config = CONFIGS[name]
    state = statistics_for(small, large, config)
    return {
        d: _timed_fit(stats, config)[0]
        for d, stats in zip(DIRECTIONS, (state.forward, state.reverse))
        if d in directions
    }


def conditions(mapper, src, truth, source, target, window, prefix_len, worst, parts) -> dict:
    """label -> (target cache for prompt tokens [0, prefix_len - 1), or the continuation's
    (correct, nll) where the condition scored it itself; recomputed tokens)."""
    split = prefix_len - 1  # the hand-off token (the last prompt token) is always the target's
    ids = window[:split]
    mapped = translate_prefix(mapper, src.cache.slice(0, split), ids, target.model)
    exact = truth.cache.slice(0, split)
    out = {"translated": (mapped, 0)}
    if "swaps" in parts:
        out.update(oracle_swaps(mapped, exact, truth, worst, mapper.sink_tokens, split))
    if "recompute" in parts:
        out.update(recompute_levers(mapped, src, source, target, ids, mapper.sink_tokens))
    if "selectors" in parts:
        out.update(selector_levers(mapped, exact, src, truth, source, target, ids, mapper))
    if "draft" in parts:
        out.update(draft_lever(mapped, src, source, target, window[: split + 1], mapper))
    if "repair" in parts:
        out.update(repair_levers(src, source, target, window[: split + 1], mapper))
    if "lazy" in parts:
        out.update(lazy_levers(src, source, target, window, prefix_len, mapper))
    if "parallel" in parts:
        out.update(repaired_caches(src, source, target, window[: split + 1], mapper, PARALLEL))
    return out


def oracle_swaps(mapped, exact, truth, worst, sinks, split) -> dict:
    """The target's own KV for some layers, K or V only, or the most-attended tokens."""
    layers = range(len(exact.keys))
    continuation_attention = attention_paid(truth.queries, truth.cache.keys)[:split]
    out = {
        "target K": (swap(mapped, exact, k_layers=layers), None),
        "target V": (swap(mapped, exact, v_layers=layers), None),
        f"target KV, {len(worst)} worst layers {worst}": (
            swap(mapped, exact, k_layers=worst, v_layers=worst),
            None,
        ),
        "target KV, first 8 layers": (swap(mapped, exact, range(8), range(8)), None),
        "target KV, last 8 layers": (
            swap(mapped, exact, layers[-8:], layers[-8:]),
            None,
        ),
    }
    for n in (16, 32, 64, split // 10):
        top = top_tokens(continuation_attention, n, sinks, split)
        out[f"target KV, {n} most-attended tokens (oracle)"] = (
            swap(mapped, exact, layers, layers, tokens=top),
            None,
        )
    return out


def recompute_levers(mapped, src, source, target, ids, sinks) -> dict:
    """Recompute the tail, or anchors chosen by the target's or the source's probe + a tail."""
    split = ids.numel()
    out = {}
    for n in (16, 48, 80, 128):
        tail = torch.arange(split - n, split)
        out[f"recompute tail {n}"] = (recompute_tokens(target.model, mapped, ids, tail), n)
    probe = run(target.model, ids[-PROBE:], past=mapped.slice(0, split - PROBE), want_queries=True)
    paid = attention_paid(probe.queries, probe.cache.keys)[: split - PROBE]
    tail = torch.arange(split - PROBE, split)
    source_probe = run(
        source.model, ids[-PROBE:], past=src.cache.slice(0, split - PROBE), want_queries=True
    )
    source_paid = attention_paid(source_probe.queries, source_probe.cache.keys)[: split - PROBE]
    for n in (32, 64, 112):
        anchors = torch.cat((top_tokens(paid, n, sinks, split - PROBE), tail))
        out[f"recompute {n} anchors (target probe) + tail {PROBE}"] = (
            recompute_tokens(target.model, probe.cache, ids, anchors),
            n + 2 * PROBE,
        )
        anchors = torch.cat((top_tokens(source_paid, n, sinks, split - PROBE), tail))
        out[f"recompute {n} anchors (source probe) + tail {PROBE}"] = (
            recompute_tokens(target.model, mapped, ids, anchors),
            f"{n + PROBE} (+{PROBE} source)",
        )
    return out


def selector_levers(mapped, exact, src, truth, source, target, ids, mapper) -> dict:
    """SELECTOR_ANCHORS anchors + the last PROBE tokens recomputed, anchors by each selector."""
    split, end = ids.numel(), ids.numel() - PROBE
    source_prompt = run(source.model, ids, want_queries=True)  # every prompt query of the source
    target_probe = run(target.model, ids[-PROBE:], past=exact.slice(0, end), want_queries=True)
    selectors = {
        "continuation, target (oracle)": (attention_paid(truth.queries, truth.cache.keys), ORACLE),
        "continuation, source (oracle)": (attention_paid(src.queries, src.cache.keys), ORACLE),
        f"last {PROBE}, target over its own cache (oracle)": (
            attention_paid(target_probe.queries, target_probe.cache.keys),
            ORACLE,
        ),
    }
    for n in (PROBE, 64, 256, split):
        label = "every prompt token" if n == split else f"last {n}"
        paid = attention_paid([q[-n:] for q in source_prompt.queries], source_prompt.cache.keys)
        extra = "recorded in the source's prefill" if n == split else f"+{n} source tokens"
        selectors[f"{label}, source"] = (paid, extra)
    tail = torch.arange(end, split)
    out = {}
    for label, (paid, extra) in selectors.items():
        anchors = torch.cat(
            (top_tokens(paid[:split], SELECTOR_ANCHORS, mapper.sink_tokens, end), tail)
        )
        out[f"{SELECTOR_ANCHORS} anchors by {label} + tail {PROBE}"] = (
            recompute_tokens(target.model, mapped, ids, anchors),
            f"{SELECTOR_ANCHORS + PROBE} ({extra})",
        )
    return out


def draft_lever(mapped, src, source, target, prompt, mapper) -> dict:
    """Anchors chosen by the attention the SOURCE pays the prompt while it drafts DRAFT tokens
    greedily after it (over its own exact cache): a guess at the continuation's queries,
    available at hand-off. prompt: the whole prompt, the hand-off token last."""
    split = prompt.numel() - 1
    paid = draft_attention(source.model, src.cache.slice(0, split), prompt, DRAFT)
    end = split - PROBE
    anchors = torch.cat(
        (top_tokens(paid, SELECTOR_ANCHORS, mapper.sink_tokens, end), torch.arange(end, split))
    )
    return {
        f"{SELECTOR_ANCHORS} anchors by {DRAFT} tokens the source drafts, source + tail {PROBE}": (
            recompute_tokens(target.model, mapped, prompt[:split], anchors),
            f"{SELECTOR_ANCHORS + PROBE} (+{DRAFT} source draft tokens)",
        )
    }


def repair_levers(src, source, target, prompt, mapper) -> dict:
    """The library's hand-off repair (sinks + anchors by a source draft) for every REPAIRS
    (each draft length drafted once), and the translated cache with layer 0 mapped as well
    (instead of the target's own, exact from the token ids alone)."""
    split = prompt.numel() - 1
    mapped_first_layer = translate_prefix(
        mapper, src.cache.slice(0, split), prompt[:split], target.model, exact_first_layer=False
    )
    out = {"translated, layer 0 mapped too": (mapped_first_layer, 0)}
    return out | repaired_caches(src, source, target, prompt, mapper, REPAIRS)


def repaired_caches(src, source, target, prompt, mapper, repairs: list[Repair]) -> dict:
    """The hand-off repair's cache for each of ``repairs`` (each draft drafted once)."""
    split, paid, out = prompt.numel() - 1, {}, {}
    for repair in repairs:
        how = repair.draft, repair.sweeps
        if how not in paid:
            paid[how] = draft_attention(source.model, src.cache, prompt, *how)
        anchors = top_attended(paid[how], repair.anchors, mapper.sink_tokens)
        cache = translate_prefix(
            mapper, src.cache.slice(0, split), prompt[:split], target.model, anchors
        )
        out[repair_label(repair)] = (cache, f"{repair.anchors} (+{draft_cost(repair)})")
    return out


def draft_cost(repair: Repair) -> str:
    """What the draft of ``repair`` costs the source: drafted tokens and forwards."""
    if not repair.sweeps:
        return f"{repair.draft} source draft tokens"
    return f"{repair.draft} source draft tokens in {1 + repair.sweeps} source forwards"


def lazy_levers(src, source, target, window, prefix_len, mapper) -> dict:
    """Repair during decoding (LAZY), scored on the continuation as it goes."""
    split = prefix_len - 1
    out = {}
    for repair, chunk, per_chunk in LAZY:
        anchors = None
        if repair is not None:
            anchors = draft_anchors(source.model, src.cache, window[:prefix_len], repair, 0, mapper)
        cache = translate_prefix(
            mapper, src.cache.slice(0, split), window[:split], target.model, anchors
        )
        scores, repaired = lazy_repair(
            target.model, cache, window, prefix_len, chunk, per_chunk, mapper.sink_tokens
        )
        first = repair.anchors if repair else 0
        out[lazy_label(repair, chunk, per_chunk)] = (scores, f"{first} + {repaired} during decode")
    return out


def repair_label(repair: Repair) -> str:
    return f"hand-off repair: {repair}"


def lazy_label(repair: Repair | None, chunk: int, per_chunk: int) -> str:
    label = f"lazy repair: {per_chunk} tokens after every {chunk} continuation tokens"
    return label + (f", after a hand-off repair of {repair}" if repair else "")


def lazy_repair(model, cache: KVCache, window, prefix_len, chunk, per_chunk, sinks):
    """Teacher-forced scores of ``window[prefix_len:]`` read in chunks over ``cache`` (the
    target's KV of ``window[:prefix_len - 1]``); after each chunk, the ``per_chunk`` prompt
    tokens its queries attend to most that were not recomputed yet are recomputed (in a real
    engine they ride in the next decode step's forward). Returns ((correct, nll), recomputed)."""
    split, end = prefix_len - 1, window.numel()
    done = torch.zeros(split, dtype=torch.bool)
    done[:sinks] = True  # the target's own already
    correct, nll, recomputed = [], [], 0
    for start in range(split, end - 1, chunk):
        ids = window[start : min(start + chunk, end - 1)]
        step = run(model, ids, past=cache, logits_to_keep=ids.numel(), want_queries=True)
        labels = window[start + 1 : start + 1 + ids.numel()]
        correct.append(step.logits.argmax(-1) == labels)
        nll.append(torch.nn.functional.cross_entropy(step.logits, labels, reduction="none"))
        if start + chunk >= end - 1:
            break  # nothing left to read: a repair now would serve no scored token
        paid = attention_paid(step.queries, step.cache.keys)[:split].masked_fill(done, -1.0)
        fresh = top_attended(paid, min(per_chunk, int((~done).sum())))
        done[fresh] = True
        recomputed += fresh.numel()
        cache = recompute_tokens(model, step.cache, window, fresh)
    return (torch.cat(correct), torch.cat(nll)), recomputed


def swap(mapped: KVCache, exact: KVCache, k_layers=(), v_layers=(), tokens=None) -> KVCache:
    """``mapped`` with the target's own K (``k_layers``) and V (``v_layers``), at ``tokens`` or
    at every token."""
    rows = slice(None) if tokens is None else tokens

    def patched(ours, theirs, chosen):
        out = list(ours)
        for layer in chosen:
            out[layer] = ours[layer].clone()
            out[layer][rows] = theirs[layer][rows]
        return out

    return KVCache(
        patched(mapped.keys, exact.keys, k_layers),
        patched(mapped.values, exact.values, v_layers),
        mapped.positions,
    )


def top_tokens(attention: torch.Tensor, n: int, sinks: int, end: int) -> torch.Tensor:
    """The n tokens in [sinks, end) with the most attention, ascending."""
    return (attention[sinks:end].topk(n).indices + sinks).sort().values


def worst_layers(name: str, direction: str) -> list[int]:
    """The WORST_LAYERS target layers of lowest attention-output cosine in fidelity.py's row."""
    rows = json.loads((RESULTS / "fidelity.json").read_text())
    row = next((r for r in rows if _key(r) == (name, direction, LAYER0)), None)
    if row is None:
        raise click.UsageError(f"run benchmarks/fidelity.py {name} --direction {direction} first")
    cosine = torch.tensor(row["attention_cosine_by_layer"])
    return sorted(cosine.topk(WORST_LAYERS, largest=False).indices.tolist())


def _record(name, direction, worst, prefix_len, continuation, windows, scores) -> None:
    """Add this run's conditions to the configuration's row (replacing those it measured
    again; a row of other evaluation windows is replaced whole)."""
    path = RESULTS / "fidelity_diagnostics.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    key = (name, direction, LAYER0)
    setup = {"windows": windows, "prefix_len": prefix_len, "continuation": continuation}
    previous = next((r for r in rows if _key(r) == key), None)
    if previous is None or previous["eval"] != setup:
        previous = {"config": name, "direction": direction, "worst_layers": [], "conditions": {}}
    rows = [r for r in rows if _key(r) != key]
    measured = {
        label: {
            "accuracy": torch.cat([c for c, _, _ in s]).mean().item(),
            "nll": torch.cat([n for _, n, _ in s]).mean().item(),
            "recomputed_tokens": s[0][2],
            "accuracy_by_window": [c.mean().item() for c, _, _ in s],
        }
        for label, s in scores.items()
    }
    rows.append(
        {
            **previous,
            "eval": setup,
            "layer0": LAYER0,
            "worst_layers": worst or previous["worst_layers"],
            "conditions": {**previous["conditions"], **measured},
        }
    )
    path.write_text(json.dumps(rows, indent=1) + "\n")


def _plot_repairs(name: str, direction: str, prefix_len: int, continuation: int) -> None:
    """Accuracy against recomputed translated tokens: one line per draft length, the lazy
    points, and the target / source / no-prefix levels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = json.loads((RESULTS / "fidelity_diagnostics.json").read_text())
    row = next(r for r in rows if _key(r) == (name, direction, LAYER0))
    got = row["conditions"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for draft in DRAFTS:
        chosen = [r for r in REPAIRS if r.draft == draft and repair_label(r) in got]
        points = [(0, got["translated"]["accuracy"])] + [
            (r.anchors, got[repair_label(r)]["accuracy"]) for r in chosen
        ]
        ax.plot(*zip(*points), marker="o", label=f"hand-off repair, {draft}-token source draft")
    for repair, chunk, per_chunk in LAZY:
        label = lazy_label(repair, chunk, per_chunk)
        if label in got:
            total = (repair.anchors if repair else 0) + per_chunk * (continuation // chunk - 1)
            ax.scatter([total], [got[label]["accuracy"]], marker="x", label=label, zorder=3)
    for key, style in (("target", "--"), ("source", ":"), ("no prefix", "-.")):
        ax.axhline(got[key]["accuracy"], color="gray", linestyle=style, label=key)
    ax.set(
        title=f"{name}, {direction}, layer 0 {row.get('layer0', 'mapped')}: "
        f"{row['eval']['windows']} windows of {prefix_len} + {continuation} tokens",
        xlabel="translated prompt tokens the target recomputes (besides 4 sinks)",
        ylabel="top-1 accuracy on the continuation",
    )
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(RESULTS / "fidelity_repair.png", dpi=120)


def _key(row: dict) -> tuple[str, str, str]:
    """(config, direction, layer 0): rows measured before layer 0 was the target's own say
    "mapped"."""
    return row["config"], row["direction"], row.get("layer0", "mapped")


def _paired(values: list | None, baseline: list | None) -> str:
    """Mean per-window difference and its standard error ('-' without per-window figures)."""
    if not values or not baseline or len(values) != len(baseline) or len(values) < 2:
        return "-"
    diff = torch.tensor(values) - torch.tensor(baseline)
    return f"{diff.mean().item():+.3f} ({diff.std().item() / len(diff) ** 0.5:.3f})"


def _write_table() -> None:
    rows = json.loads((RESULTS / "fidelity_diagnostics.json").read_text())
    parts = [
        "# Fidelity diagnostics\n",
        "Written by `python benchmarks/fidelity_diagnostics.py`. "
        "Oracle rows use the target's own KV (not available at a real hand-off); "
        "recomputed tokens are counted out of the prompt's tokens.\n",
    ]
    for r in rows:
        e = r["eval"]
        parts.append(
            f"\n## {r['config']}, {r['direction']}, layer 0 {r.get('layer0', 'mapped')} "
            f"({e['windows']} windows of {e['prefix_len']} + {e['continuation']} tokens)\n\n"
            "| condition | recomputed tokens | accuracy | NLL | accuracy - source (paired SE) |\n"
            "| --- | --- | --- | --- | --- |"
        )
        source = r["conditions"].get("source", {}).get("accuracy_by_window")
        for label, c in r["conditions"].items():
            cost = "oracle" if c["recomputed_tokens"] is None else c["recomputed_tokens"]
            versus = _paired(c.get("accuracy_by_window"), source)
            parts.append(f"| {label} | {cost} | {c['accuracy']:.3f} | {c['nll']:.3f} | {versus} |")
    Path(RESULTS / "fidelity_diagnostics.md").write_text("\n".join(parts) + "\n")


if __name__ == "__main__":
    main()
