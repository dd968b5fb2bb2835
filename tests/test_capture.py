"""Running models: scattered forwards recompute chosen tokens of a (translated) cache exactly
as one-at-a-time recomputation would; layer 0's K/V are the model's own."""

import pytest
import torch

from sgl_kvmap.core.cache import KVCache
from sgl_kvmap.models.capture import (
    capture_kv,
    first_layer_kv,
    forward_scattered,
    recompute_tokens,
    run,
)

from .conftest import assert_same_cache, tiny_model


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


def test_appended_tokens_are_a_plain_forward_after_the_cache(model):
    ids = torch.randint(0, 100, (30,))
    cache = capture_kv(model.model, ids[:20])
    got = forward_scattered(model.model, cache, ids, torch.arange(20, 30), logits_to_keep=2)
    want = run(model.model, ids[20:], past=cache, logits_to_keep=2)
    assert_same_cache(got.cache, want.cache)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="the run 20"):  # appended tokens must follow the cache
        forward_scattered(model.model, cache, ids, torch.tensor([3, 21]))


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama3", "glm"])
def test_first_layer_kv_is_the_models_own(kind):
    """QK-norm, scaled RoPE and partial interleaved RoPE included: layer 0 needs no context."""
    model = tiny_model(kind, seed=4).model
    ids = torch.randint(0, 100, (25,))
    keys, values = first_layer_kv(model, ids)
    exact = capture_kv(model, ids)
    torch.testing.assert_close(keys, exact.keys[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(values, exact.values[0], rtol=1e-5, atol=1e-6)
