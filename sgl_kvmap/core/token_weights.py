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
    tokens = queries[0].shape[0] if queries else 0
    uniform = (1.0 / torch.arange(1, tokens + 1)).flip(0).cumsum(0).flip(0)
    return attention_paid(queries, keys) / uniform


def attention_paid(queries: list[torch.Tensor], keys: list[torch.Tensor]) -> torch.Tensor:
    """Attention the LAST n positions pay each token, summed over them (causal softmax).

    queries: L x [n, heads, head_dim] of positions T-n .. T-1; keys: L x [T, kv_heads, head_dim]
    (post-RoPE, grouped-query heads allowed). Returns [T] float32: sum over the n queries, mean
    over layers and query heads.
    """
    if not queries or len(queries) != len(keys):
        raise KVMapError(f"need one query and key tensor per layer, got {len(queries)}/{len(keys)}")
    n, total = queries[0].shape[0], keys[0].shape[0]
    device = queries[0].device
    causal = torch.ones(n, total, dtype=torch.bool, device=device).tril(total - n)
    paid = torch.zeros(total, device=device)
    for q, k in zip(queries, keys):
        heads, kv_heads = q.shape[1], k.shape[1]
        if heads % kv_heads:
            raise KVMapError(f"{heads} query heads cannot share {kv_heads} kv heads")
        k = k.float().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("ihd,jhd->hij", q.float(), k) / q.shape[-1] ** 0.5
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)  # [heads, n, T]
        paid += probs.sum(1).mean(0)
    return (paid / len(queries)).cpu()


def token_weights(received: torch.Tensor, power: float) -> torch.Tensor:
    """``received ** power`` normalised to mean 1 (so weighted counts stay token counts).
    received: [tokens] > 0; power 0 gives all ones."""
    if power < 0:
        raise KVMapError(f"attention power must be >= 0, got {power}")
    weights = received.clamp(min=1e-12).pow(power)
    return weights / weights.mean()
