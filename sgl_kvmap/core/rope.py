"""Content space: strip RoPE from cached keys (``unrope``) and put it back (``rope``).

Angles come from the model's own rotary module (rebuilt from its config), never from a
re-derived formula, so scaled variants (Llama-3, YaRN, dynamic) and partial rotary behave
exactly as in the model. Tables are reduced to one (cos, sin) per rotation pair:

- ``cos, sin: [tokens, rotary_dim // 2]`` in float32, attention scaling included.
- "half" style pairs dim i with dim i + rotary_dim/2 (Llama, Qwen); "interleaved" pairs
  2i with 2i+1 (GPT-J, GLM, Cohere). Dims at or past rotary_dim pass through unchanged.

With pair (a, b) rotated to (a c - b s, b c + a s), the inverse divides by c^2 + s^2, so the
round trip stays exact when a scaled RoPE multiplies cos and sin by an attention factor.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

import torch

from .errors import KVMapError


class RotaryTables(NamedTuple):
    """cos, sin: [tokens, rotary_dim // 2], float32."""

    cos: torch.Tensor
    sin: torch.Tensor


def rotary_module(config) -> torch.nn.Module:
    """Instantiate the model family's own rotary embedding module from a text config."""
    module = importlib.import_module(
        f"transformers.models.{config.model_type}.modeling_{config.model_type}"
    )
    classes = [getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding")]
    classes = [c for c in classes if isinstance(c, type) and c.__module__ == module.__name__]
    if len(classes) != 1:
        raise KVMapError(
            f"model type {config.model_type!r}: expected one RotaryEmbedding class in "
            f"{module.__name__}, found {[c.__name__ for c in classes]}"
        )
    return classes[0](config=config)


def rotary_tables(module: torch.nn.Module, positions: torch.Tensor) -> RotaryTables:
    """Per-pair cos/sin at ``positions: [tokens]`` (int), from ``module``'s own forward."""
    n_pairs = module.inv_freq.numel()
    probe = torch.zeros(1, dtype=torch.float32)
    cos, sin = module(probe, positions.reshape(1, -1).long())
    cos, sin = cos[0].float(), sin[0].float()
    return RotaryTables(_one_per_pair(cos, n_pairs), _one_per_pair(sin, n_pairs))


def rope(x: torch.Tensor, tables: RotaryTables, style: str) -> torch.Tensor:
    """Apply RoPE. ``x: [tokens, heads, head_dim]`` content-space -> post-RoPE, same shape/dtype."""
    a, b, rest = _split_pairs(x.float(), tables.cos.shape[-1], style)
    cos, sin = tables.cos[:, None, :], tables.sin[:, None, :]
    return _join_pairs(a * cos - b * sin, b * cos + a * sin, rest, style).to(x.dtype)


def unrope(x: torch.Tensor, tables: RotaryTables, style: str) -> torch.Tensor:
    """Strip RoPE. ``x: [tokens, heads, head_dim]`` post-RoPE -> content space, same shape/dtype."""
    a, b, rest = _split_pairs(x.float(), tables.cos.shape[-1], style)
    cos, sin = tables.cos[:, None, :], tables.sin[:, None, :]
    norm = cos * cos + sin * sin
    return _join_pairs((a * cos + b * sin) / norm, (b * cos - a * sin) / norm, rest, style).to(
        x.dtype
    )


def _split_pairs(x: torch.Tensor, n_pairs: int, style: str):
    rotary, rest = x[..., : 2 * n_pairs], x[..., 2 * n_pairs :]
    if style == "half":
        return rotary[..., :n_pairs], rotary[..., n_pairs:], rest
    if style == "interleaved":
        return rotary[..., 0::2], rotary[..., 1::2], rest
    raise KVMapError(f"unknown RoPE style {style!r}")


def _join_pairs(a: torch.Tensor, b: torch.Tensor, rest: torch.Tensor, style: str) -> torch.Tensor:
    rotary = torch.cat((a, b), -1) if style == "half" else torch.stack((a, b), -1).flatten(-2)
    return torch.cat((rotary, rest), -1)


def _one_per_pair(table: torch.Tensor, n_pairs: int) -> torch.Tensor:
    """Reduce a module's [tokens, width] table to [tokens, n_pairs], whatever its layout."""
    width = table.shape[-1]
    if width == n_pairs:
        return table
    if width == 2 * n_pairs and torch.equal(table[:, :n_pairs], table[:, n_pairs:]):
        return table[:, :n_pairs]
    if width == 2 * n_pairs and torch.equal(table[:, 0::2], table[:, 1::2]):
        return table[:, 0::2]
    raise KVMapError(f"cannot read a rotary table of width {width} for {n_pairs} pairs")
