"""Which KV heads a tensor-parallel rank of an SGLang engine holds (pure; no sglang import).

SGLang's QKVParallelLinear (0.5.23, ``layers/linear.py``) splits the KV heads over the TP ranks
when there are at least as many heads as ranks; with more ranks than KV heads it replicates
them: every head is held by ``tp_size // num_kv_heads`` consecutive ranks, rank r holding head
``r // replicas``. A rank's KV pool and its stored HiCache pages hold only its own heads.
"""

from __future__ import annotations

from ..core.errors import KVMapError


def rank_heads(num_kv_heads: int, tp_size: int, tp_rank: int) -> list[int]:
    """The model's KV head indices held by ``tp_rank`` of ``tp_size``, in pool order."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise KVMapError(f"TP rank {tp_rank} of {tp_size} is not a rank")
    if tp_size >= num_kv_heads:
        if tp_size % num_kv_heads:
            raise KVMapError(f"{num_kv_heads} KV heads do not replicate over {tp_size} ranks")
        return [tp_rank // (tp_size // num_kv_heads)]
    if num_kv_heads % tp_size:
        raise KVMapError(f"{num_kv_heads} KV heads do not split over {tp_size} ranks")
    per_rank = num_kv_heads // tp_size
    return list(range(tp_rank * per_rank, (tp_rank + 1) * per_rank))


def ranks_covering_heads(num_kv_heads: int, tp_size: int) -> list[int]:
    """The fewest ranks whose pages hold every KV head once, in head order (rank 0 first):
    every rank when heads are split, one rank per head when they are replicated."""
    first_holder: dict[int, int] = {}
    for rank in range(tp_size):
        for head in rank_heads(num_kv_heads, tp_size, rank):
            first_holder.setdefault(head, rank)
    return sorted(set(first_holder.values()))
