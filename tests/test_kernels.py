"""translate_pages against the reference map, on scattered slots of paged pools."""

import pytest
import torch

from sgl_kvmap.capture import capture_kv
from sgl_kvmap.errors import KVMapError
from sgl_kvmap.kernels import PagedKV, translate_pages


def pool(spec, slots: int, dtype=torch.float32) -> PagedKV:
    shape = (slots, spec.num_kv_heads, spec.head_dim)
    return PagedKV(
        [torch.full(shape, float("nan"), dtype=dtype) for _ in range(spec.num_layers)],
        [torch.full(shape, float("nan"), dtype=dtype) for _ in range(spec.num_layers)],
    )


@pytest.fixture(scope="module")
def reduced_rank_mapper(tiny_pair):
    from .conftest import fit_tiny_mapper

    return fit_tiny_mapper(*tiny_pair, rank=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["k-layer", "reduced-rank"])
def test_scattered_slots_get_the_reference_translation(
    tiny_pair, tiny_mapper, reduced_rank_mapper, dtype, family
):
    source, target = tiny_pair
    mapper = tiny_mapper if family == "k-layer" else reduced_rank_mapper
    cache = capture_kv(source.model, torch.randint(0, 100, (40,)))
    src_pool, dst_pool = pool(source.spec, 64, dtype), pool(target.spec, 50, dtype)
    src_slots, dst_slots = torch.randperm(64)[:40], torch.randperm(50)[:40]
    for buffer, layer in zip(src_pool.keys + src_pool.values, cache.keys + cache.values):
        buffer[src_slots] = layer.to(dtype)
    reference = mapper.map(
        type(cache)(
            [k.to(dtype) for k in cache.keys], [v.to(dtype) for v in cache.values], cache.positions
        )
    )
    translate_pages(mapper, src_pool, src_slots, dst_pool, dst_slots, cache.positions)
    for buffer, want in zip(dst_pool.keys + dst_pool.values, reference.keys + reference.values):
        torch.testing.assert_close(buffer[dst_slots], want.to(dtype), rtol=0, atol=0)
        untouched = torch.ones(50, dtype=torch.bool)
        untouched[dst_slots] = False
        assert buffer[untouched].isnan().all()


def test_positions_are_where_the_pages_sit_in_the_sequence(tiny_pair, tiny_mapper):
    """A page in the middle of a prompt is translated at its own positions, not from 0."""
    source, target = tiny_pair
    cache = capture_kv(source.model, torch.randint(0, 100, (48,)))
    src_pool, dst_pool = pool(source.spec, 48), pool(target.spec, 16)
    for buffer, layer in zip(src_pool.keys + src_pool.values, cache.keys + cache.values):
        buffer[:] = layer
    page = torch.arange(32, 48)
    translate_pages(tiny_mapper, src_pool, page, dst_pool, torch.arange(16), page)
    whole = tiny_mapper.map(cache)
    torch.testing.assert_close(dst_pool.keys[1], whole.keys[1][32:], rtol=1e-5, atol=1e-5)


def test_wrong_pools_and_indices_are_refused(tiny_pair, tiny_mapper):
    source, target = tiny_pair
    slots = torch.arange(4)
    with pytest.raises(KVMapError, match="pool geometry"):
        translate_pages(
            tiny_mapper, pool(target.spec, 8), slots, pool(target.spec, 8), slots, slots
        )
    with pytest.raises(KVMapError, match="equal-length"):
        translate_pages(
            tiny_mapper, pool(source.spec, 8), slots, pool(target.spec, 8), slots[:3], slots
        )
