"""HiCache flat pages <-> token-major KV (pure torch; no sglang import).

A HiCache page in storage is the host pool's page flattened: K block then V block, each in the
order of the writer's host layout (files carry no header, so the reader must know it):

    page_first         [2, page, layers, heads, dim]
    layer_first        [2, layers, page, heads, dim]
    page_first_direct  [2, 1, layers, page, heads, dim]
    page_head          [2, 1, heads, page, layers, dim]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.errors import KVMapError

_ORDER = {  # axes of one K (or V) block, outermost first: P page tokens, L layers, H heads, D dim
    "page_first": "PLHD",
    "layer_first": "LPHD",
    "page_first_direct": "LPHD",
    "page_head": "HPLD",
}
TOKEN_MAJOR = "PLHD"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


_GEOMETRY = ("layout", "page_size", "layers", "heads", "head_dim")


@dataclass(frozen=True)
class PageFormat:
    """What one engine's stored pages look like: host layout, geometry of its shard, dtype."""

    layout: str
    page_size: int
    layers: int
    heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.layout not in _ORDER:
            raise KVMapError(f"unsupported HiCache layout {self.layout!r}; known: {sorted(_ORDER)}")
        if self.dtype not in DTYPES.values():
            raise KVMapError(f"unsupported KV dtype {self.dtype}; known: {sorted(DTYPES)}")
        sizes = (self.page_size, self.layers, self.heads, self.head_dim)
        if any(type(n) is not int or n < 1 for n in sizes):
            raise KVMapError(f"page geometry (page, layers, heads, dim) {sizes} is not positive")

    def to_dict(self) -> dict:
        names = {dtype: name for name, dtype in DTYPES.items()}
        return {**{f: getattr(self, f) for f in _GEOMETRY}, "dtype": names[self.dtype]}

    @classmethod
    def from_dict(cls, data: dict) -> PageFormat:
        """Inverse of ``to_dict`` (KVMapError for anything malformed)."""
        if not isinstance(data, dict) or set(data) != {*_GEOMETRY, "dtype"}:
            raise KVMapError(f"not a page format: {data!r}")
        if data["dtype"] not in DTYPES:
            raise KVMapError(f"unsupported KV dtype {data['dtype']!r}")
        return cls(**{**data, "dtype": DTYPES[data["dtype"]]})

    @property
    def numel(self) -> int:
        return 2 * self.page_size * self.layers * self.heads * self.head_dim

    def empty_page(self, pin: bool = False) -> torch.Tensor:
        """A flat buffer [numel] to read one stored page into (``pin``: page-locked, for a
        fast copy to a GPU)."""
        return torch.empty(self.numel, dtype=self.dtype, pin_memory=pin)

    def to_tokens(self, flat: torch.Tensor) -> torch.Tensor:
        """flat: [numel] -> [2, page, layers, heads, dim] (K, V)."""
        if flat.numel() != self.numel:
            raise KVMapError(f"a stored page has {flat.numel()} values, expected {self.numel}")
        sizes = dict(P=self.page_size, L=self.layers, H=self.heads, D=self.head_dim)
        order = _ORDER[self.layout]
        block = flat.view(2, *(sizes[a] for a in order))
        return block.permute(0, *(1 + order.index(a) for a in TOKEN_MAJOR))

    def from_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """[2, page, layers, heads, dim] -> flat [numel] in this layout's order and dtype."""
        order = _ORDER[self.layout]
        block = tokens.permute(0, *(1 + TOKEN_MAJOR.index(a) for a in order))
        return block.to(self.dtype).contiguous().flatten()
