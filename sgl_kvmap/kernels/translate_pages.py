"""translate_pages: one model's cached KV slots -> another model's KV pool slots.

Engines keep KV in pools of token slots; a page is a run of slots. Every layout SGLang and
FlashInfer use can be viewed per layer as ``[slots, kv_heads, head_dim]`` (NHD with page size
1, HiCache's host pages reshaped), so the op takes that view and slot indices, and works for
any page size. Keys are post-RoPE on both sides; ``positions`` are the tokens' positions in
the sequence (the source's keys were rotated at them and the target's are rotated at them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..capture import KVCache
from ..errors import KVMapError
from ..mapper import KVMapper


@dataclass
class PagedKV:
    """A KV pool view. keys[l], values[l]: [slots, kv_heads, head_dim] (keys post-RoPE)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

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
) -> None:
    """Write the translation of ``source`` slots into ``target`` slots, in place.

    source_slots, target_slots, positions: [tokens] int64. The source pool must have the
    mapper's source geometry and the target pool its target geometry (dtypes may differ;
    math is float32, results are cast to the target pool's dtype).
    """
    _check(mapper, source, target, source_slots, target_slots, positions)
    cache = KVCache(
        [k[source_slots] for k in source.keys],
        [v[source_slots] for v in source.values],
        positions,
    )
    mapped = mapper.map(cache)
    for pool, layers in ((target.keys, mapped.keys), (target.values, mapped.values)):
        for buffer, layer in zip(pool, layers):
            buffer[target_slots] = layer.to(buffer.dtype)


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
    if not source_slots.shape == target_slots.shape == positions.shape or source_slots.ndim != 1:
        raise KVMapError(
            f"source_slots {tuple(source_slots.shape)}, target_slots {tuple(target_slots.shape)} "
            f"and positions {tuple(positions.shape)} must be equal-length 1-D tensors"
        )
