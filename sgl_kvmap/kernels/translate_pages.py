"""translate_pages: one model's cached KV slots -> another model's KV pool slots.

Engines keep KV in pools of token slots; a page is a run of slots. Every layout SGLang and
FlashInfer use can be viewed per layer as ``[slots, kv_heads, head_dim]`` (NHD with page size
1, HiCache's host pages reshaped), so the op takes that view and slot indices, and works for
any page size. Keys are post-RoPE on both sides; ``positions`` are the tokens' positions in
the sequence (the source's keys were rotated at them and the target's are rotated at them).

Two bodies, one op: pools on a GPU go through the Triton kernels (``triton_translate``: one
launch gathers and unropes every layer, one ropes and scatters every layer, the matrix
products between them on cuBLAS); pools in host memory, SGLang's HiCache pages among them,
go through torch (MKL/oneDNN products, bfloat16 on AMX where the CPU has it).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from ..core.cache import KVCache
from ..core.errors import KVMapError
from ..core.mapper import KVMapper

BACKENDS = ("auto", "torch", "triton")


@dataclass
class PagedKV:
    """A KV pool view. keys[l], values[l]: [slots, kv_heads, head_dim] (keys post-RoPE)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @classmethod
    def token_major(cls, kv: torch.Tensor) -> PagedKV:
        """Per-layer views of one token-major buffer ``kv: [2, slots, layers, heads, dim]``
        (K, V), as HiCache's host pages hold them once decoded."""
        return cls(list(kv[0].unbind(1)), list(kv[1].unbind(1)))

    @property
    def geometry(self) -> tuple[int, int, int]:
        """(layers, kv_heads, head_dim)."""
        return (len(self.keys), *self.keys[0].shape[1:]) if self.keys else (0, 0, 0)


def translate_pages(
    mapper: KVMapper,
    source: PagedKV,
    source_slots: torch.Tensor,
    target: PagedKV,
    target_slots: torch.Tensor,
    positions: torch.Tensor,
    *,
    backend: str = "auto",
    matmul_dtype: torch.dtype | None = None,
) -> None:
    """Write the translation of ``source`` slots into ``target`` slots, in place.

    source_slots, target_slots, positions: [tokens] int64. The source pool must have the
    mapper's source geometry and the target pool its target geometry (dtypes may differ;
    RoPE is float32, the products run in ``matmul_dtype``, by default the source pool's dtype
    if it is a 16-bit float (``matmul.fast_matmul_dtype`` says what a device computes fast),
    and results are cast to the target pool's dtype), on the mapper's device. ``backend``:
    "auto" (Triton for CUDA pools it can address, else torch) or one of them by name, for
    benchmarks and tests ("triton" on CPU tensors needs ``TRITON_INTERPRET=1``).
    """
    _check(mapper, source, target, source_slots, target_slots, positions)
    if _backend(backend, source, target) == "triton":
        from . import triton_translate

        triton_translate.translate(
            mapper, source, source_slots, target, target_slots, positions, matmul_dtype
        )
        return
    cache = KVCache(
        [k[source_slots] for k in source.keys],
        [v[source_slots] for v in source.values],
        positions,
    )
    mapped = mapper.map(cache, matmul_dtype)
    for pool, layers in ((target.keys, mapped.keys), (target.values, mapped.values)):
        for buffer, layer in zip(pool, layers):
            buffer[target_slots] = layer.to(buffer.dtype)


def _backend(backend: str, source: PagedKV, target: PagedKV) -> str:
    """The body to run: "auto" takes Triton for CUDA pools it can address; "triton" by name
    refuses pools it cannot."""
    if backend not in BACKENDS:
        raise KVMapError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return backend
    if backend == "auto" and (
        not source.keys[0].is_cuda or importlib.util.find_spec("triton") is None
    ):
        return "torch"
    from .triton_translate import supports

    unsupported = [
        name for name, pool in (("source", source), ("target", target)) if not supports(pool)
    ]
    if not unsupported:
        return "triton"
    if backend == "auto":
        return "torch"
    raise KVMapError(
        f"the Triton kernels need the {unsupported[0]} pool's layers in one float dtype on one "
        "device, each [slots, heads, dim] with dense rows and one slot stride"
    )


def _check(mapper, source, target, source_slots, target_slots, positions) -> None:
    want = (
        (mapper.source.num_layers, mapper.source.num_kv_heads, mapper.source.head_dim),
        (mapper.target.num_layers, mapper.target.num_kv_heads, mapper.target.head_dim),
    )
    got = (source.geometry, target.geometry)
    if got != want:
        raise KVMapError(
            f"pool geometry (layers, kv_heads, head_dim) source {got[0]} / target {got[1]} "
            f"does not match the mapper's {want[0]} / {want[1]}"
        )
    devices = {t.device for t in (source.keys[0], target.keys[0], mapper.maps["k"][0].weight)}
    if len(devices) > 1:
        raise KVMapError(
            f"source pool on {source.keys[0].device}, target pool on {target.keys[0].device}, "
            f"mapper on {mapper.maps['k'][0].weight.device}: put all three on one device "
            "(KVMapper.to)"
        )
    if not source_slots.shape == target_slots.shape == positions.shape or source_slots.ndim != 1:
        raise KVMapError(
            f"source_slots {tuple(source_slots.shape)}, target_slots {tuple(target_slots.shape)} "
            f"and positions {tuple(positions.shape)} must be equal-length 1-D tensors"
        )
