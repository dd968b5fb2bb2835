"""One run of stored pages, translated: token-major KV in, this engine's pages out (pure; no
sglang).

The step KVMapStorage's translation workers run between reading a peer's pages and writing this
engine's host pages, kept apart so ``sglang-args`` can time it on this machine without SGLang.
On an engine with a GPU it runs there (``translate_pages``' Triton body, on a CUDA stream of the
worker's own, through page-locked host buffers the worker keeps); otherwise on the CPU, with the
products in the dtype this CPU multiplies fast.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ..core.mapper import KVMapper
from ..kernels import PagedKV, fast_matmul_dtype, translate_pages
from ..models.first_layer import ExactFirstLayer
from .pages import PageFormat
from .records import page_crc32

_worker = threading.local()  # each translating thread's CUDA stream and staging buffers


def translate_tokens(
    mapper: KVMapper,
    source: torch.Tensor,
    positions: torch.Tensor,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """source: [2, tokens, source layers, source heads, dim] (K, V; keys post-RoPE) on the
    CPU; positions: [tokens]. Returns [2, tokens, target layers, target heads, dim] in
    ``dtype`` on the CPU (written into ``out`` when given; page-locked when it is allocated
    here for a GPU). Runs on the mapper's device (move it there first, ``KVMapper.to``)."""
    device = mapper.maps["k"][0].weight.device
    spec = mapper.target
    shape = (2, source.shape[1], spec.num_layers, spec.num_kv_heads, spec.head_dim)
    on_gpu = device.type == "cuda"
    result = out if out is not None else torch.empty(shape, dtype=dtype, pin_memory=on_gpu)
    matmul_dtype = torch.float32 if dtype == torch.float32 else fast_matmul_dtype(device)
    with torch.cuda.stream(_stream(device)) if on_gpu else contextlib.nullcontext():
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
        _stream(device).synchronize()
    return result


def translate_run(
    mapper: KVMapper,
    source: torch.Tensor,
    first_token: int,
    page: PageFormat,
    first_layer: ExactFirstLayer | None = None,
) -> tuple[list[torch.Tensor], int]:
    """source: [2, tokens, source layers, source heads, dim], whole pages of a peer starting at
    position ``first_token``. Returns this engine's pages of their translation, each a flat
    [page.numel] tensor in ``page``'s layout and dtype (``PageFormat.from_tokens``), and how
    many tokens got this engine's exact layer 0 from ``first_layer`` (None: layer 0 mapped)."""
    spec, size = mapper.target, page.page_size
    shape = (2, source.shape[1], spec.num_layers, spec.num_kv_heads, spec.head_dim)
    positions = torch.arange(first_token, first_token + source.shape[1])
    out = staging("result", shape, page.dtype)
    target = translate_tokens(mapper, source, positions, page.dtype, out=out)
    exact = first_layer.overwrite(source, positions, target) if first_layer is not None else 0
    pages = [page.from_tokens(target[:, i : i + size]) for i in range(0, source.shape[1], size)]
    return pages, exact


def staging(name, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """This thread's reusable buffer ``name`` (any hashable) of ``shape``, page-locked when a
    GPU translates: grown as needed, never shrunk, valid until this thread asks for ``name``
    again. A translation worker reads pages and stages results in these instead of allocating
    page-locked memory on every call."""
    numel = math.prod(shape)
    buffers = _worker.__dict__.setdefault("buffers", {})
    buffer = buffers.get((name, dtype))
    if buffer is None or buffer.numel() < numel:
        buffer = torch.empty(numel, dtype=dtype, pin_memory=torch.cuda.is_available())
        buffers[name, dtype] = buffer
    return buffer[:numel].view(shape)


def _stream(device: torch.device) -> torch.cuda.Stream:
    """This thread's CUDA stream on ``device``."""
    streams = _worker.__dict__.setdefault("streams", {})
    if device not in streams:
        streams[device] = torch.cuda.Stream(device)
    return streams[device]


def hand_over_seconds(
    mapper: KVMapper, tokens: int, page_size: int, threads: int = 1, concurrent: int = 1
) -> float:
    """Seconds KVMapStorage's own work on ``tokens`` stored tokens takes on this machine when
    ``concurrent`` swaps are translated at once (by as many workers, each its own thread, as
    KVMapStorage runs them), with ``threads`` torch threads (SGLang's server processes run one):
    the peer's bfloat16 pages checked (CRC-32) and decoded, translated on the mapper's device
    and encoded into this engine's pages. File reads and SGLang's own bookkeeping are not in it.
    The best of two rounds after a warm-up, each timed until the last of its swaps is done."""
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
        translate_run(mapper, source, 0, target_page)

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with ThreadPoolExecutor(concurrent) as workers:
            list(workers.map(hand_over, [stored[:1]] * concurrent))  # warm-up
            runs = []
            for _ in range(2):
                started = time.perf_counter()
                list(workers.map(hand_over, [stored] * concurrent))
                runs.append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(before)
    return min(runs)


def _page_format(spec, page_size: int) -> PageFormat:
    return PageFormat(
        "page_first", page_size, spec.num_layers, spec.num_kv_heads, spec.head_dim, torch.bfloat16
    )
