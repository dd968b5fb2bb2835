"""The SGLang extension's translation on a GPU, checked and timed without SGLang or weights.

    python benchmarks/serving_gpu_check.py [--tokens 2048 --tokens 8192] [--repeats 10] [--out DIR]

What KVMapStorage does with a peer's pages on an engine that has a GPU, on random weights in
the real pair's shapes (benchmarks/configs; the map families `sgl-kvmap fit` writes, as in
kernel_speed.py), both directions, bfloat16 pages of 64 tokens:

- host pages: the peer's stored pages (page_first) decoded to token-major KV, translated on the
  GPU by ``translation.translate_tokens`` (page-locked buffers, a stream of its own, the Triton
  body) and encoded into each of SGLang's host layouts (page_first, layer_first,
  page_first_direct, page_head), against the torch body of ``translate_pages`` on the same GPU;
  also one TP rank's heads (``KVMapper.for_target_heads``) against the full map's columns;
- device pool: ``translate_pages`` straight between two of SGLang's device pools (one
  ``[slots, heads, dim]`` buffer per layer, pages at scattered slots), Triton against torch.

Times (medians of ``--repeats``, CUDA events): the host-page hand-over end to end and the
device-pool translation, against the floor of the map's own matrix products (``content_products``
for K and V on features already on the GPU). Writes serving_gpu_check.json; exits non-zero if
an output differs from the torch reference by more than bfloat16 rounding. Runs on CPU too
(``TRITON_INTERPRET=1``, a few hundred tokens), to check the script itself.
"""

from __future__ import annotations

import json
import math
import platform
from pathlib import Path

import click
import torch
from kernel_speed import PAIR, _SharedVocab, pair_config, random_mapper, timed
from kernel_speed import products_floor as features_floor

from sgl_kvmap.core.spec import spec_from_config
from sgl_kvmap.kernels import PagedKV, translate_pages
from sgl_kvmap.sglang.pages import PageFormat
from sgl_kvmap.sglang.translation import translate_tokens

RESULTS = Path(__file__).parent / "results"
PAGE = 64
HOST_LAYOUTS = ("page_first", "layer_first", "page_first_direct", "page_head")
FAMILIES = {"rank-1024": {"rank": 1024}, "k-16": {"k": 16}}
TOLERANCE = 3e-2  # of the outputs' largest magnitude: bfloat16 rounding of the two bodies


@click.command()
@click.option(
    "--tokens",
    "token_counts",
    multiple=True,
    type=int,
    default=[2048, 8192],
    show_default=True,
)
@click.option("--repeats", default=10, show_default=True)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=RESULTS)
def main(token_counts, repeats, out) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    specs = {n: spec_from_config(pair_config(n), _SharedVocab(), model_id=n) for n in PAIR}
    rows, worst = [], 0.0
    for source, target in (PAIR, PAIR[::-1]):
        for family, shape in FAMILIES.items():
            cpu_mapper = random_mapper(specs[source], specs[target], **shape)
            mapper = cpu_mapper.to(device)
            for tokens in token_counts:
                row = {"direction": f"{source} -> {target}", "family": family, "tokens": tokens}
                row.update(check(mapper, tokens, repeats, device))
                worst = max(worst, row["largest_relative_difference"])
                rows.append(row)
                print(json.dumps(row))
    meta = {
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "repeats": repeats,
        "page_size": PAGE,
        "tolerance": TOLERANCE,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "serving_gpu_check.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"largest relative difference from the torch body: {worst:.2e} (tolerance {TOLERANCE})")
    if worst > TOLERANCE:
        raise SystemExit("the GPU translation differs from the torch reference")


@torch.inference_mode()
def check(mapper, tokens: int, repeats: int, device: str) -> dict:
    src, tgt = mapper.source, mapper.target
    positions = torch.arange(tokens)
    stored = PageFormat(
        "page_first", PAGE, src.num_layers, src.num_kv_heads, src.head_dim, torch.bfloat16
    )
    pages = [torch.randn(stored.numel).to(torch.bfloat16) for _ in range(tokens // PAGE)]
    source = torch.cat([stored.to_tokens(page) for page in pages], dim=1)  # [2, t, L, H, D]

    def hand_over(layout: str) -> list[torch.Tensor]:
        kv = translate_tokens(mapper, source, positions, torch.bfloat16)
        own = PageFormat(
            layout, PAGE, tgt.num_layers, tgt.num_kv_heads, tgt.head_dim, torch.bfloat16
        )
        return [own.from_tokens(kv[:, i : i + PAGE]) for i in range(0, tokens, PAGE)]

    reference = torch_body(mapper, source, positions, device)  # [2, t, L, H, D] on the CPU
    differences = []
    for layout in HOST_LAYOUTS:
        own = PageFormat(
            layout, PAGE, tgt.num_layers, tgt.num_kv_heads, tgt.head_dim, torch.bfloat16
        )
        got = torch.cat([own.to_tokens(page) for page in hand_over(layout)], dim=1)
        differences.append(relative(got, reference))
    heads = [tgt.num_kv_heads - 1]
    shard = translate_tokens(mapper.for_target_heads(heads), source, positions, torch.bfloat16)
    differences.append(relative(shard, reference[:, :, :, heads]))
    pool_difference, pool_call = device_pools(mapper, source, positions, device)
    differences.append(pool_difference)
    floor = products_floor(mapper, source, positions, device)
    host_seconds = timed(lambda: hand_over("page_first"), repeats, device)
    pool_seconds = timed(pool_call, repeats, device)
    floor_seconds = timed(floor, repeats, device)
    return {
        "largest_relative_difference": max(differences),
        "host_pages_seconds": host_seconds,
        "device_pool_seconds": pool_seconds,
        "products_floor_seconds": floor_seconds,
        "host_pages_over_floor": host_seconds / floor_seconds,
        "device_pool_over_floor": pool_seconds / floor_seconds,
    }


def torch_body(mapper, source, positions, device) -> torch.Tensor:
    """The reference: translate_pages' torch body on the same device, [2, t, L, H, D] on CPU."""
    spec = mapper.target
    shape = (2, source.shape[1], spec.num_layers, spec.num_kv_heads, spec.head_dim)
    target = torch.empty(shape, dtype=torch.bfloat16, device=device)
    slots = torch.arange(source.shape[1], device=device)
    translate_pages(
        mapper,
        PagedKV.token_major(source.to(device)),
        slots,
        PagedKV.token_major(target),
        slots,
        positions.to(device),
        backend="torch",
    )
    return target.cpu()


def device_pools(mapper, source, positions, device):
    """Translate between two device pools at scattered page slots with both bodies; (largest
    relative difference, the Triton call for timing)."""
    tokens = source.shape[1]
    src_pool, src_slots = scattered_pool(mapper.source, tokens, device, seed=1)
    for layer in range(mapper.source.num_layers):
        src_pool.keys[layer][src_slots] = source[0, :, layer].to(device)
        src_pool.values[layer][src_slots] = source[1, :, layer].to(device)
    outputs = {}
    for backend in ("torch", "triton"):
        pool, slots = scattered_pool(mapper.target, tokens, device, seed=2)

        def call(pool=pool, slots=slots, backend=backend) -> None:
            translate_pages(
                mapper, src_pool, src_slots, pool, slots, positions.to(device), backend=backend
            )

        call()
        written = [torch.stack([k[slots], v[slots]]) for k, v in zip(pool.keys, pool.values)]
        outputs[backend] = (torch.stack(written, 2).cpu(), call)
    return relative(outputs["triton"][0], outputs["torch"][0]), outputs["triton"][1]


def scattered_pool(spec, tokens: int, device: str, seed: int) -> tuple[PagedKV, torch.Tensor]:
    """An SGLang-style device pool with room for twice ``tokens``, and the slots of ``tokens``
    tokens as whole pages at random page positions."""
    generator = torch.Generator().manual_seed(seed)
    pages = 2 * math.ceil(tokens / PAGE)
    shape = (pages * PAGE + PAGE, spec.num_kv_heads, spec.head_dim)  # SGLang's padding page
    pool = PagedKV(
        [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(spec.num_layers)],
        [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(spec.num_layers)],
    )
    chosen = torch.randperm(pages, generator=generator)[: tokens // PAGE] + 1
    slots = (chosen[:, None] * PAGE + torch.arange(PAGE)).flatten().to(device)
    return pool, slots


def products_floor(mapper, source, positions, device):
    """The map's matrix products alone, on content features already on the device, in bf16."""
    from sgl_kvmap.core.cache import KVCache

    layers = range(mapper.source.num_layers)
    cache = KVCache(
        [source[0, :, layer].to(device, torch.bfloat16) for layer in layers],
        [source[1, :, layer].to(device, torch.bfloat16) for layer in layers],
        positions.to(device),
    )
    return features_floor(mapper, cache)


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference over the largest magnitude of ``want``."""
    want = want.float()
    return ((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


if __name__ == "__main__":
    main()
