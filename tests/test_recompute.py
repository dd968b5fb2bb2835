"""Selective recompute: the target recomputes chosen tokens of a (translated) cache."""

import pytest
import torch

from sgl_kvmap.capture import KVCache, capture_kv, recompute_tokens, run

from .conftest import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", seed=3)


def noisy(cache: KVCache, seed: int = 0) -> KVCache:
    generator = torch.Generator().manual_seed(seed)
    return KVCache(
        [k + 0.3 * torch.randn(k.shape, generator=generator) for k in cache.keys],
        [v + 0.3 * torch.randn(v.shape, generator=generator) for v in cache.values],
        cache.positions,
    )


def test_recompute_over_an_exact_cache_gives_it_back(model):
    ids = torch.randint(0, 100, (40,))
    exact = capture_kv(model.model, ids)
    again = recompute_tokens(model.model, exact, ids, torch.tensor([0, 7, 8, 23, 39]))
    for got, want in zip(again.keys + again.values, exact.keys + exact.values):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_recomputed_tokens_see_the_cache_and_earlier_recomputed_tokens(model):
    """Reference: recompute one token at a time, each over the cache as already repaired."""
    ids = torch.randint(0, 100, (32,))
    stale = noisy(capture_kv(model.model, ids))
    positions = torch.tensor([25, 3, 12, 13])  # any order: recomputed in position order
    got = recompute_tokens(model.model, stale, ids, positions)
    want = stale
    for p in sorted(positions.tolist()):
        fresh = run(model.model, ids[p : p + 1], past=want.slice(0, p)).cache.slice(p)
        want = KVCache(
            [torch.cat((w[:p], f, w[p + 1 :])) for w, f in zip(want.keys, fresh.keys)],
            [torch.cat((w[:p], f, w[p + 1 :])) for w, f in zip(want.values, fresh.values)],
            want.positions,
        )
    for g, w, s in zip(got.keys + got.values, want.keys + want.values, stale.keys + stale.values):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
        untouched = torch.ones(len(ids), dtype=torch.bool)
        untouched[positions] = False
        assert torch.equal(g[untouched], s[untouched])  # the rest of the cache is left alone
        assert not torch.allclose(g[positions], s[positions])


def test_recompute_refuses_bad_positions(model):
    ids = torch.randint(0, 100, (10,))
    cache = capture_kv(model.model, ids)
    for bad in (torch.tensor([10]), torch.tensor([-1]), torch.tensor([2, 2])):
        with pytest.raises(ValueError, match="distinct indices"):
            recompute_tokens(model.model, cache, ids, bad)
    assert recompute_tokens(model.model, cache, ids, torch.tensor([], dtype=torch.long)) is cache
