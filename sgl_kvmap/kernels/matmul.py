"""Which dtype a device multiplies fast: the products' dtype for ``translate_pages``.

A GPU's tensor cores and a CPU with native bfloat16 instructions (AVX512-BF16, AMX) multiply
bfloat16 at least as fast as float32; a CPU without them (AVX2 only) emulates bfloat16 products
and runs them many times slower than float32. The CPU's case is read from the instruction sets
torch detects on it (its own checks, the ones its kernels dispatch on), not timed: a timing
probe cost a fresh server process seconds inside its first swap's deadline, and could differ
between processes of one deployment.
"""

from __future__ import annotations

import functools

import torch


def fast_matmul_dtype(device: torch.device | str) -> torch.dtype:
    """bfloat16 if ``device`` multiplies it natively, else float32.

    CUDA devices: bfloat16 (tensor cores). CPU: bfloat16 when it has AVX512-BF16 or AMX
    (``cpu_has_native_bfloat16``)."""
    device = torch.device(device)
    if device.type != "cpu":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_native_bfloat16() else torch.float32


@functools.cache
def cpu_has_native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX tiles), as torch
    detects it."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, check, lambda: False)() for check in checks)
