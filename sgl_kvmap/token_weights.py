"""Per-token calibration weights from the target's attention (pure).

A translated key or value matters in proportion to the attention it later receives, so the
ridge loss can weight every calibration token by how much attention the target model pays to
it (the CacheBridge idea). One weight per token, shared by every target layer and head, keeps
the single streamed Gram that all layer selections are cut from.
"""

from __future__ import annotations

import torch

from .errors import KVMapError


def attention_received(queries: list[torch.Tensor], keys: list[torch.Tensor]) -> torch.Tensor:
    """Attention each token receives under causal softmax attention, relative to uniform.

    queries: L x [tokens, heads, head_dim], keys: L x [tokens, kv_heads, head_dim] (both post-RoPE,
    grouped-query heads allowed). Token j's score is the mean over layers and query heads of
    sum_{i >= j} a_ij, divided by the same sum under uniform attention (sum_{i >= j} 1 / (i + 1)),
    so 1 means "as much as an average token at that position". Returns [tokens] float32.
    Scores use 1 / sqrt(head_dim) scaling (no soft-capping or custom scales).
    """
    if not queries or len(queries) != len(keys):
        raise KVMapError(f"need one query and key tensor per layer, got {len(queries)}/{len(keys)}")
    tokens = queries[0].shape[0]
    causal = torch.ones(tokens, tokens, dtype=torch.bool).tril()
    total = torch.zeros(tokens)
    for q, k in zip(queries, keys):
        heads, kv_heads = q.shape[1], k.shape[1]
        if heads % kv_heads:
            raise KVMapError(f"{heads} query heads cannot share {kv_heads} kv heads")
        k = k.float().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("ihd,jhd->hij", q.float(), k) / q.shape[-1] ** 0.5
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)  # [heads, i, j]
        total += probs.sum(1).mean(0)
    uniform = (1.0 / torch.arange(1, tokens + 1)).flip(0).cumsum(0).flip(0)
    return total / len(queries) / uniform


def token_weights(received: torch.Tensor, power: float) -> torch.Tensor:
    """``received ** power`` normalised to mean 1 (so weighted counts stay token counts).
    received: [tokens] > 0; power 0 gives all ones."""
    if power < 0:
        raise KVMapError(f"attention power must be >= 0, got {power}")
    weights = received.clamp(min=1e-12).pow(power)
    return weights / weights.mean()
