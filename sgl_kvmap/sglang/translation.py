"""One run of stored pages, translated: token-major KV in, token-major KV out (pure; no sglang).

The step KVMapStorage runs between reading a peer's pages and writing its own host pages, kept
apart so ``sglang-args`` can time it on this machine without SGLang. On an engine with a GPU it
runs there (``translate_pages``' Triton body, on a stream of its own, through page-locked host
buffers); otherwise on the CPU, with the products in the dtype this CPU multiplies fast.
"""

from __future__ import annotations

import contextlib
import time

import torch

from ..core.mapper import KVMapper
from ..kernels import PagedKV, fast_matmul_dtype, translate_pages
from .pages import PageFormat
from .records import page_crc32


def translate_tokens(
    mapper: KVMapper, source: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """source: [2, tokens, source layers, source heads, dim] (K, V; keys post-RoPE) on the
    CPU; positions: [tokens]. Returns [2, tokens, target layers, target heads, dim] in
    ``dtype`` on the CPU. Runs on the mapper's device (move it there first, ``KVMapper.to``)."""
    device = mapper.maps["k"][0].weight.device
    spec = mapper.target
    shape = (2, source.shape[1], spec.num_layers, spec.num_kv_heads, spec.head_dim)
    on_gpu = device.type == "cuda"
    stream = torch.cuda.Stream(device) if on_gpu else None
    result = torch.empty(shape, dtype=dtype, pin_memory=on_gpu)
    matmul_dtype = torch.float32 if dtype == torch.float32 else fast_matmul_dtype(device)
    with torch.cuda.stream(stream) if on_gpu else contextlib.nullcontext():
        source = source.to(device, non_blocking=True)
        target = torch.empty(shape, dtype=dtype, device=device)
        slots = torch.arange(source.shape[1], device=device)
        pools = PagedKV.token_major(source), PagedKV.token_major(target)
        translate_pages(
            mapper,
            pools[0],
            slots,
            pools[1],
            slots,
            positions.to(device),
            matmul_dtype=matmul_dtype,
        )
        result.copy_(target, non_blocking=on_gpu)
    if on_gpu:
        stream.synchronize()
    return result


def hand_over_seconds(
    mapper: KVMapper, tokens: int, page_size: int = 64, threads: int = 1
) -> float:
    """Seconds KVMapStorage's own work on ``tokens`` stored tokens takes on this machine, with
    ``threads`` torch threads (SGLang's server processes run one): the peer's bfloat16 pages
    checked (CRC-32) and decoded, translated on the mapper's device (``translate_tokens``),
    and encoded into this engine's pages. File reads and SGLang's own bookkeeping are not in
    it. The best of two runs after a warm-up."""
    source_page = _page_format(mapper.source, page_size)
    target_page = _page_format(mapper.target, page_size)
    generator = torch.Generator().manual_seed(0)
    stored = [
        torch.randn(source_page.numel, generator=generator).to(torch.bfloat16)
        for _ in range(-(-tokens // page_size))
    ]

    def hand_over(pages: list[torch.Tensor]) -> None:
        [page_crc32(page) for page in pages]
        source = torch.cat([source_page.to_tokens(page) for page in pages], dim=1)
        target = translate_tokens(mapper, source, torch.arange(source.shape[1]), torch.bfloat16)
        for start in range(0, target.shape[1], page_size):
            target_page.from_tokens(target[:, start : start + page_size])

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        hand_over(stored[:1])  # warm-up
        runs = []
        for _ in range(2):
            started = time.perf_counter()
            hand_over(stored)
            runs.append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(before)
    return min(runs)


def _page_format(spec, page_size: int) -> PageFormat:
    return PageFormat(
        "page_first", page_size, spec.num_layers, spec.num_kv_heads, spec.head_dim, torch.bfloat16
    )
