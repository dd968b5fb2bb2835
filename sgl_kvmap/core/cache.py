"""KVCache: one sequence's KV cache, the layout every part of sgl-kvmap passes around (pure).

Token-major, per layer ``keys[l], values[l]: [tokens, kv_heads, head_dim]``, keys post-RoPE
(as engines cache them); ``positions: [tokens]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVCache:
    """One sequence's KV cache.

    keys/values: L x [tokens, kv_heads, head_dim] (keys post-RoPE); positions: [tokens].
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    positions: torch.Tensor

    def __len__(self) -> int:
        return self.positions.numel()

    def slice(self, start: int, end: int | None = None) -> KVCache:
        """Tokens [start, end) of every layer."""
        return KVCache(
            [k[start:end] for k in self.keys],
            [v[start:end] for v in self.values],
            self.positions[start:end],
        )

    def replace_front(self, front: KVCache) -> KVCache:
        """This cache with its first len(front) tokens taken from ``front`` (same positions)."""
        n = len(front)
        return KVCache(
            [torch.cat((f, k[n:])) for f, k in zip(front.keys, self.keys)],
            [torch.cat((f, v[n:])) for f, v in zip(front.values, self.values)],
            self.positions,
        )
