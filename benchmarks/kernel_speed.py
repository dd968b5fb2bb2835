"""translate_pages (Triton and torch bodies) against the target's re-prefill, side by side.

    python benchmarks/kernel_speed.py [--device cuda] [--tokens 512 --tokens 2048 ...]
        [--pair SOURCE TARGET] [--one-way]

A pair's geometry (two configs of benchmarks/configs/: by default the real pair's; `--pair
qwen3-14b qwen3-32b --one-way --tokens 32768 --no-repairs` is the paper's scale), randomly
initialised: what a forward or a map costs does not depend on the weights' values. Mappers
have the shapes `sgl-kvmap fit` writes (reduced-rank 1,024, the default, and k-layer k = 16,
whose target layers each read their own 16 source layers), both directions (one with
--one-way), 4 sink tokens. Pools are
SGLang's MHA token pools, one [slots, kv_heads, head_dim] buffer per layer, the prefix in
scattered slots (page size 1: the worst gather), all in --dtype.

Per prompt length, medians of --repeats (CUDA events on a GPU):
- ``triton`` / ``torch``: translate_pages with that body, pool to pool;
- ``layer0``: the target's own layer-0 KV (the fidelity rows' "layer 0 exact") and ``sinks``: a
  forward of the target over its 4 sink tokens, both part of what a translated prefix costs;
- ``prefill``: the target's forward over the prompt (transformers, SDPA attention);
- ``floor``: the map's matrix products alone, on content features already gathered (what no
  body can go under).
Ratios: prefill over the translate path with each body (translate + layer0 + sinks). Also
the largest difference between the two bodies' outputs, relative to the outputs' largest
magnitude.

What a hand-off repair adds (``transfer.Repair``; one row per direction and length, with the
source model randomly initialised too): the source's draft that picks the anchors, serial
(one forward per drafted token) or parallel (``sweeps``: 1 + s forwards over the whole draft),
and the target's one hand-off forward over the sinks, the anchors, a 32-token tail and the
last prompt token, against the same forward without anchors and without tail (what the first
decoding step costs anyway). Writes benchmarks/results/kernel_speed.json (or --out). No asserts.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from pathlib import Path

import click
import torch

from sgl_kvmap.core.cache import KVCache
from sgl_kvmap.core.fit import KINDS, LayerMap
from sgl_kvmap.core.mapper import KVMapper, content_features
from sgl_kvmap.core.spec import spec_from_config
from sgl_kvmap.kernels import PagedKV, translate_pages
from sgl_kvmap.models.capture import first_layer_kv, forward_scattered, run
from sgl_kvmap.models.transfer import draft_attention, handoff_positions, handoff_split

CONFIGS = Path(__file__).parent / "configs"
RESULTS = Path(__file__).parent / "results"
PAIR = ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
SINK_TOKENS = 4
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # on a CPU: checks the script, not speed
FAMILIES = {"rank-1024": {"rank": 1024}, "k-16": {"k": 16}}
REPAIR_TAIL = 32
REPAIR_ANCHORS = (0, 112, 240)
DRAFTS = ((8, 0), (32, 0), (32, 1), (32, 2), (32, 4))  # (drafted tokens, parallel sweeps)


class _SharedVocab:
    """The pair shares one tokenizer; a spec needs only its fingerprint here."""

    def get_vocab(self) -> dict:
        return {}


def pair_config(name: str):
    from transformers import AutoConfig

    data = json.loads((CONFIGS / f"{name}.json").read_text())
    return AutoConfig.for_model(data.pop("model_type"), **data)


def random_mapper(source, target, rank: int | None = None, k: int | None = None) -> KVMapper:
    """Random weights in a fitted mapper's shapes (float32, as packs store them)."""
    generator = torch.Generator().manual_seed(0)
    every = list(range(source.num_layers))
    if rank is not None:
        selection = [every] * target.num_layers
        width = rank
        features = source.num_layers * source.kv_width
        projections = {
            kind: torch.randn(features, rank, generator=generator) / math.sqrt(features)
            for kind in KINDS
        }
    else:
        selection = [
            sorted(torch.randperm(source.num_layers, generator=generator)[:k].tolist())
            for _ in range(target.num_layers)
        ]
        width, projections = k * source.kv_width, None
    maps = {
        kind: [
            LayerMap(
                torch.randn(width, target.kv_width, generator=generator) / math.sqrt(width),
                torch.zeros(target.kv_width),
            )
            for _ in range(target.num_layers)
        ]
        for kind in KINDS
    }
    return KVMapper(
        source,
        target,
        selection,
        maps,
        ridge=0.0,
        sink_tokens=SINK_TOKENS,
        projections=projections,
    )


def token_pool(spec, slots: int, dtype, device) -> PagedKV:
    shape = (slots, spec.num_kv_heads, spec.head_dim)
    return PagedKV(
        [torch.randn(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)],
        [torch.randn(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)],
    )


def timed(fn, repeats: int, device: str) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after two warm-ups."""
    for _ in range(2):
        fn()
    seconds = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        else:
            start = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


@click.command()
@click.option("--device", default="cuda" if torch.cuda.is_available() else "cpu")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default="bfloat16")
@click.option(
    "--tokens",
    "token_counts",
    multiple=True,
    type=int,
    default=[512, 2048, 8192],
    show_default=True,
)
@click.option("--repeats", default=20, show_default=True)
@click.option(
    "--pair",
    nargs=2,
    default=PAIR,
    show_default=True,
    help="SOURCE TARGET: two config names of benchmarks/configs/.",
)
@click.option("--one-way", is_flag=True, help="Only SOURCE -> TARGET, not the way back too.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=RESULTS)
@click.option(
    "--repairs/--no-repairs",
    default=True,
    show_default=True,
    help="Also time the hand-off repair's draft and forward (see the module doc).",
)
def main(device, dtype, token_counts, repeats, pair, one_way, out, repairs) -> None:
    dtype = getattr(torch, dtype)
    configs = {name: pair_config(name) for name in pair}
    specs = {name: spec_from_config(configs[name], _SharedVocab(), model_id=name) for name in pair}
    rows, repair_rows = [], []
    for source, target in (pair,) if one_way else (pair, pair[::-1]):
        model = target_model(configs[target], dtype, device)
        source_model = target_model(configs[source], dtype, device) if repairs else None
        for tokens in token_counts:
            for row in measure(specs[source], specs[target], model, tokens, repeats):
                rows.append({"direction": f"{source} -> {target}", **row})
                print(_line(rows[-1]))
            if repairs:
                row = measure_repair(source_model, model, tokens, repeats)
                repair_rows.append({"direction": f"{source} -> {target}", **row})
                print(_repair_line(repair_rows[-1]))
        del model, source_model
        if device == "cuda":
            torch.cuda.empty_cache()
    meta = {
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
        "dtype": str(dtype),
        "torch": torch.__version__,
        "repeats": repeats,
        "prefill": "transformers, SDPA attention, logits of the last token",
        "pair": list(pair),
    }
    out.mkdir(parents=True, exist_ok=True)
    path = out / "kernel_speed.json"
    result = {"meta": meta, "rows": rows, "repair_rows": repair_rows}
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


def target_model(config, dtype, device: str):
    """The target, randomly initialised on ``device`` in ``dtype``."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        return AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation="sdpa"
        ).eval()


@torch.inference_mode()
def measure(source, target, model, tokens: int, repeats: int) -> list[dict]:
    """One row per mapper family for a prompt of ``tokens`` tokens (see the module doc)."""
    device, dtype = model.device.type, model.dtype
    ids = torch.randint(0, model.config.vocab_size, (tokens,), device=device)
    common = {
        "tokens": tokens,
        "prefill_seconds": timed(lambda: run(model, ids, logits_to_keep=1), repeats, device),
        "layer0_seconds": timed(lambda: first_layer_kv(model, ids), repeats, device),
        "sinks_seconds": timed(lambda: run(model, ids[:SINK_TOKENS]), repeats, device),
    }
    slots = 2 * tokens
    src_pool, dst_pool = (token_pool(spec, slots, dtype, device) for spec in (source, target))
    src_slots, dst_slots = (torch.randperm(slots, device=device)[:tokens] for _ in range(2))
    positions = torch.arange(tokens, device=device)
    backends = ["triton", "torch"] if device == "cuda" or INTERPRETED else ["torch"]
    rows = []
    gathered = KVCache(
        [k[src_slots] for k in src_pool.keys], [v[src_slots] for v in src_pool.values], positions
    )
    for family, shape in FAMILIES.items():
        mapper = random_mapper(source, target, **shape).to(device)
        floor = timed(products_floor(mapper, gathered), repeats, device)
        row, outputs = {"mapper": family, **common, "floor_seconds": floor}, {}
        for backend in backends:
            translate = lambda m=mapper, b=backend: translate_pages(  # noqa: E731
                m, src_pool, src_slots, dst_pool, dst_slots, positions, backend=b
            )
            seconds = timed(translate, repeats, device)
            outputs[backend] = [k[dst_slots] for k in dst_pool.keys]  # in the pool's dtype
            path = seconds + common["layer0_seconds"] + common["sinks_seconds"]
            row |= {
                f"{backend}_seconds": seconds,
                f"{backend}_translate_speedup": common["prefill_seconds"] / seconds,
                f"{backend}_path_speedup": common["prefill_seconds"] / path,
                f"{backend}_over_floor": seconds / floor,
            }
        if len(outputs) == 2:  # layer by layer: a 32B's keys of 32K tokens are 4 GB in bf16
            pairs = list(zip(outputs["triton"], outputs["torch"]))
            diff = max((a.float() - b.float()).abs().max().item() for a, b in pairs)
            scale = max(b.float().abs().max().item() for _, b in pairs)
            row["triton_vs_torch_max_rel_diff"] = diff / scale
        rows.append(row)
    return rows


def products_floor(mapper: KVMapper, cache: KVCache):
    """The map's matrix products alone (``KVMapper.content_products``), on the content features
    of ``cache`` (keys/values: L x [tokens, kv_heads, head_dim], on the device), computed
    beforehand in the cache's dtype."""
    features = content_features(cache, mapper.source)
    dtype = cache.keys[0].dtype
    features = {kind: f.to(dtype) for kind, f in features.items()}
    return lambda: [mapper.content_products(kind, features[kind]) for kind in features]


@torch.inference_mode()
def measure_repair(source_model, model, tokens: int, repeats: int) -> dict:
    """What a repaired hand-off of a ``tokens``-token prompt costs beyond the map (module doc).

    The target's own cache of the translated tokens stands in for the translated one (the same
    shapes, so the same cost); anchors are spread at random over the translated tokens.
    """
    device = model.device.type
    ids = torch.randint(0, model.config.vocab_size, (tokens,), device=device)
    split = handoff_split(tokens, REPAIR_TAIL)
    source_cache = run(source_model, ids[:split]).cache
    target_cache = run(model, ids[:-1]).cache  # sliced to each hand-off's translated tokens
    draft = {
        f"{count}:{sweeps}": timed(
            lambda c=count, s=sweeps: draft_attention(source_model, source_cache, ids, c, s),
            repeats,
            device,
        )
        for count, sweeps in DRAFTS
    }

    def forward_time(tail: int, anchors: int) -> float:
        split, positions = handoff_split(tokens, tail), random_handoff(tokens, tail, anchors)
        cache = target_cache.slice(0, split)
        return timed(lambda: forward_scattered(model, cache, ids, positions, 1), repeats, device)

    first_step = forward_time(0, 0)
    forward = {anchors: forward_time(REPAIR_TAIL, anchors) for anchors in REPAIR_ANCHORS}
    return {
        "tokens": tokens,
        "tail": REPAIR_TAIL,
        "draft_seconds": draft,
        "handoff_seconds_by_anchors": forward,
        "first_step_seconds": first_step,
    }


def random_handoff(tokens: int, tail: int, anchors: int) -> torch.Tensor:
    """Positions of a hand-off forward of a ``tokens``-token prompt: the sinks, ``anchors``
    translated tokens drawn at random (seeded), the last ``tail`` prompt tokens and the last."""
    split = handoff_split(tokens, tail)
    picked = (
        torch.randperm(split - SINK_TOKENS, generator=torch.Generator().manual_seed(0))[:anchors]
        + SINK_TOKENS
    )
    return handoff_positions(tokens, tail, SINK_TOKENS, picked.sort().values)


def _repair_line(row: dict) -> str:
    ms = lambda seconds: f"{seconds * 1e3:.1f}"  # noqa: E731
    drafts = " ".join(f"{k} {ms(v)}" for k, v in row["draft_seconds"].items())
    forwards = " ".join(f"{k} {ms(v)}" for k, v in row["handoff_seconds_by_anchors"].items())
    return (
        f"{row['direction']:<42} repair {row['tokens']:>6} tok | ms: draft (tokens:sweeps) "
        f"{drafts} | hand-off forward by anchors (tail {row['tail']}) {forwards} | first "
        f"decoding step {ms(row['first_step_seconds'])}"
    )


def _line(row: dict) -> str:
    ms = lambda key: f"{row[key] * 1e3:.3f}" if key in row else "-"  # noqa: E731
    ratio = lambda key: f"{row[key]:.1f}x" if key in row else "-"  # noqa: E731
    return (
        f"{row['direction']:<42} {row['mapper']:<9} {row['tokens']:>6} tok | ms: triton "
        f"{ms('triton_seconds')} torch {ms('torch_seconds')} layer0 {ms('layer0_seconds')} "
        f"sinks {ms('sinks_seconds')} prefill {ms('prefill_seconds')} floor "
        f"{ms('floor_seconds')} | prefill / path: "
        f"triton {ratio('triton_path_speedup')} torch {ratio('torch_path_speedup')}"
    )


if __name__ == "__main__":
    main()
