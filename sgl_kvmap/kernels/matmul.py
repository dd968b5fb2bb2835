"""Which dtype a device multiplies fast: the products' dtype for ``translate_pages``.

A GPU's tensor cores and a CPU with native bfloat16 (AMX, AVX512-BF16) multiply bfloat16 at
least as fast as float32; a CPU without it (AVX2 only) emulates bfloat16 products and runs them
many times slower than float32. SGLang's server processes run torch with one thread, so the
choice is measured once per process, device type and thread count, not assumed.
"""

from __future__ import annotations

import functools
import time

import torch

_PROBE_SHAPE = (256, 2048, 1024)  # [tokens, features] @ [features, outputs]: a map's products


def fast_matmul_dtype(device: torch.device | str) -> torch.dtype:
    """bfloat16 if ``device`` multiplies it at least as fast as float32, else float32.

    CUDA devices: bfloat16 (tensor cores). CPU: measured on a map-sized product with the
    current ``torch.get_num_threads()``, once per thread count."""
    device = torch.device(device)
    if device.type != "cpu":
        return torch.bfloat16
    return _fastest_on_cpu(torch.get_num_threads())


@functools.cache
def _fastest_on_cpu(threads: int) -> torch.dtype:
    seconds = {dtype: _product_seconds(dtype) for dtype in (torch.bfloat16, torch.float32)}
    return torch.bfloat16 if seconds[torch.bfloat16] <= seconds[torch.float32] else torch.float32


def _product_seconds(dtype: torch.dtype, repeats: int = 3) -> float:
    tokens, features, outputs = _PROBE_SHAPE
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, features, generator=generator).to(dtype)
    w = torch.randn(features, outputs, generator=generator).to(dtype)
    x @ w  # warm-up: first calls pick kernels
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        x @ w
        best = min(best, time.perf_counter() - started)
    return best
