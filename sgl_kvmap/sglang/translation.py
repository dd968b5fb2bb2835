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


def translation_seconds(mapper: KVMapper, tokens: int, threads: int = 1) -> float:
    """Seconds ``translate_tokens`` takes for ``tokens`` tokens of random bfloat16 KV on the
    mapper's device, with ``threads`` torch threads (SGLang's server processes run one). The
    best of two runs after a warm-up."""
    spec = mapper.source
    generator = torch.Generator().manual_seed(0)
    shape = (2, tokens, spec.num_layers, spec.num_kv_heads, spec.head_dim)
    source = torch.randn(shape, generator=generator).to(torch.bfloat16)
    positions = torch.arange(tokens)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        translate_tokens(mapper, source[:, :16], positions[:16], torch.bfloat16)  # warm-up
        runs = []
        for _ in range(2):
            started = time.perf_counter()
            translate_tokens(mapper, source, positions, torch.bfloat16)
            runs.append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(before)
    return min(runs)
