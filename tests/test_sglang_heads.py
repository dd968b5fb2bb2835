"""Which KV heads a TP rank holds: SGLang 0.5.23's rule (layers/linear.py, QKVParallelLinear:
with tp_size >= total KV heads, ``num_kv_head_replicas = tp_size // total`` and the K/V shard
loaded on rank r is ``r // num_kv_head_replicas``; otherwise rank r loads heads
[r * total / tp, (r + 1) * total / tp)). The expected tables are that rule written out."""

import pytest

from sgl_kvmap.core.errors import KVMapError
from sgl_kvmap.sglang.heads import rank_heads, ranks_covering_heads


@pytest.mark.parametrize(
    "kv_heads, tp, held, covering",
    [
        (2, 1, [[0, 1]], [0]),
        (2, 2, [[0], [1]], [0, 1]),
        (2, 4, [[0], [0], [1], [1]], [0, 2]),
        (2, 8, [[0]] * 4 + [[1]] * 4, [0, 4]),
        (8, 4, [[0, 1], [2, 3], [4, 5], [6, 7]], [0, 1, 2, 3]),
        (1, 2, [[0], [0]], [0]),
    ],
)
def test_heads_follow_sglangs_split_and_replication(kv_heads, tp, held, covering):
    assert [rank_heads(kv_heads, tp, rank) for rank in range(tp)] == held
    assert ranks_covering_heads(kv_heads, tp) == covering


@pytest.mark.parametrize("kv_heads, tp, rank", [(2, 3, 0), (4, 3, 1), (2, 2, 2), (2, 0, 0)])
def test_impossible_shards_are_refused(kv_heads, tp, rank):
    with pytest.raises(KVMapError):
        rank_heads(kv_heads, tp, rank)
