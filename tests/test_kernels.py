"""translate_pages against the reference map, on scattered slots of paged pools, through
each backend: torch, and Triton (compiled on a GPU, else run by Triton's interpreter, which
must then reproduce the reference exactly)."""

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():  # read when the Triton kernels are first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from sgl_kvmap.core.errors import KVMapError  # noqa: E402
from sgl_kvmap.kernels import PagedKV, translate_pages  # noqa: E402
from sgl_kvmap.models.capture import capture_kv  # noqa: E402

from .conftest import fit_tiny_mapper, tiny_model, with_random_residual  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = [
    "torch",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("triton") is None, reason="triton is not installed"
        ),
    ),
]


def pool(spec, slots: int, dtype=torch.float32, device="cpu") -> PagedKV:
    shape = (slots, spec.num_kv_heads, spec.head_dim)
    return PagedKV(
        *(
            [torch.full(shape, float("nan"), dtype=dtype, device=device) for _ in range(n)]
            for n in (spec.num_layers, spec.num_layers)
        )
    )


@pytest.fixture(scope="module")
def reduced_rank_mapper(tiny_pair):
    return fit_tiny_mapper(*tiny_pair, rank=16)


@pytest.fixture(scope="module")
def residual_mapper(tiny_pair, reduced_rank_mapper):
    """The reduced-rank mapper with a non-linear residual (part of its content products)."""
    cache = capture_kv(tiny_pair[0].model, torch.randint(0, 100, (30,)))
    return with_random_residual(reduced_rank_mapper, cache)


def assert_translated(
    mapper, source, target, backend, src_dtype, dst_dtype=None, tokens=40, matmul_dtype=None
):
    """Translate ``tokens`` of a real source cache between scattered slots of two pools on
    DEVICE and compare every written slot with the reference map (cast as the op casts, its
    products in ``matmul_dtype``); slots not written must stay untouched."""
    dst_dtype = dst_dtype or src_dtype
    mapper = mapper.to(DEVICE)
    cache = capture_kv(source.model, torch.randint(0, 100, (tokens,)))
    src_pool, dst_pool = (
        pool(source.spec, 64, src_dtype, DEVICE),
        pool(target.spec, 50, dst_dtype, DEVICE),
    )
    src_slots, dst_slots = torch.randperm(64)[:tokens], torch.randperm(50)[:tokens]
    for buffer, layer in zip(src_pool.keys + src_pool.values, cache.keys + cache.values):
        buffer[src_slots.to(DEVICE)] = layer.to(DEVICE, src_dtype)
    reference = mapper.map(
        type(cache)(
            [k.to(DEVICE, src_dtype) for k in cache.keys],
            [v.to(DEVICE, src_dtype) for v in cache.values],
            cache.positions.to(DEVICE),
        ),
        matmul_dtype,
    )
    translate_pages(
        mapper,
        src_pool,
        src_slots.to(DEVICE),
        dst_pool,
        dst_slots.to(DEVICE),
        cache.positions.to(DEVICE),
        backend=backend,
        matmul_dtype=matmul_dtype,
    )
    # The torch body is the reference: exact. In float32 the interpreter runs the reference's
    # operations one by one: exact too. A GPU may fuse multiply-adds, and the interpreter
    # rounds float32 -> bfloat16 toward zero where torch (and a GPU) round to nearest: there
    # the products' dtype bounds the difference.
    exact = backend == "torch" or DEVICE == "cpu" and src_dtype == dst_dtype == torch.float32
    for buffer, want in zip(dst_pool.keys + dst_pool.values, reference.keys + reference.values):
        got = buffer[dst_slots.to(DEVICE)]
        if exact:
            torch.testing.assert_close(got, want.to(dst_dtype), rtol=0, atol=0)
        else:
            torch.testing.assert_close(got.float(), want.float(), **_tolerance(src_dtype))
        untouched = torch.ones(50, dtype=torch.bool, device=DEVICE)
        untouched[dst_slots.to(DEVICE)] = False
        assert buffer[untouched].isnan().all()


def _tolerance(dtype) -> dict:
    return {"rtol": 2e-2, "atol": 2e-2} if dtype != torch.float32 else {"rtol": 1e-4, "atol": 1e-4}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["k-layer", "reduced-rank", "residual"])
def test_scattered_slots_get_the_reference_translation(
    tiny_pair, tiny_mapper, reduced_rank_mapper, residual_mapper, dtype, family, backend
):
    mappers = {
        "k-layer": tiny_mapper,
        "reduced-rank": reduced_rank_mapper,
        "residual": residual_mapper,
    }
    mapper = mappers[family]
    assert_translated(mapper, *tiny_pair, backend, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_pools_with_float32_products(tiny_pair, tiny_mapper, backend):
    """What a CPU without native bfloat16 runs (``fast_matmul_dtype``): bfloat16 pools, the
    products in float32, as the reference map does with float32 products."""
    assert_translated(tiny_mapper, *tiny_pair, backend, torch.bfloat16, matmul_dtype=torch.float32)


def test_the_fast_products_dtype_follows_the_cpus_instruction_sets(monkeypatch):
    """GPUs multiply bfloat16 fast; a CPU does when torch finds AVX512-BF16 or AMX on it, and
    the answer costs no product (a fresh server pays nothing for it inside a swap)."""
    from sgl_kvmap.kernels import matmul

    assert matmul.fast_matmul_dtype("cuda") == torch.bfloat16
    for avx512_bf16, amx, want in (
        (False, False, torch.float32),
        (True, False, torch.bfloat16),
        (False, True, torch.bfloat16),
    ):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        matmul.cpu_has_native_bfloat16.cache_clear()
        assert matmul.fast_matmul_dtype("cpu") == want
    matmul.cpu_has_native_bfloat16.cache_clear()


@pytest.mark.parametrize("backend", BACKENDS)
def test_pools_of_two_dtypes_round_as_the_reference(tiny_pair, tiny_mapper, backend):
    """A bfloat16 source pool into a float32 target pool: products in bfloat16, the result
    rounded to the source's dtype first, as ``KVMapper.map`` returns it."""
    assert_translated(tiny_mapper, *tiny_pair, backend, torch.bfloat16, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "kind", ["glm", "llama3"], ids=["interleaved-partial-rotary", "scaled-rope"]
)
def test_other_rope_layouts(kind, backend):
    """Interleaved pairs over half the head (GLM) and Llama-3's scaled frequencies, a source
    of another geometry (k-layer: one group per selection, several groups)."""
    source = tiny_model(kind, seed=3)
    target = tiny_model(kind, seed=4, layers=4, kv_heads=1, head_dim=32)
    mapper = fit_tiny_mapper(source, target, top_k=1)
    assert len({tuple(s) for s in mapper.selection}) > 1
    assert_translated(mapper, source, target, backend, torch.float32, tokens=33)


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


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_pool_address_tables_are_copied_once_and_follow_moved_buffers(tiny_pair, tiny_mapper):
    """An engine translates into the same pools again and again: their layer-address tables
    reach the device once. A layer buffer that moves gets a table of its new address."""
    from sgl_kvmap.kernels import triton_translate

    source, target = tiny_pair
    mapper = tiny_mapper.to(DEVICE)
    cache = capture_kv(source.model, torch.randint(0, 100, (24,)))
    src_pool, dst_pool = pool(source.spec, 24, device=DEVICE), pool(target.spec, 24, device=DEVICE)
    for buffer, layer in zip(src_pool.keys + src_pool.values, cache.keys + cache.values):
        buffer[:] = layer.to(DEVICE)
    slots = torch.arange(24, device=DEVICE)
    positions = cache.positions.to(DEVICE)
    translate_pages(mapper, src_pool, slots, dst_pool, slots, positions, backend="triton")
    built = triton_translate._device_table.cache_info().misses
    translate_pages(mapper, src_pool, slots, dst_pool, slots, positions, backend="triton")
    assert triton_translate._device_table.cache_info().misses == built
    dst_pool.values[1] = torch.full_like(dst_pool.values[1], float("nan"))  # moved
    translate_pages(mapper, src_pool, slots, dst_pool, slots, positions, backend="triton")
    assert triton_translate._device_table.cache_info().misses == built + 1
    want = mapper.map(
        type(cache)(
            [k.to(DEVICE) for k in cache.keys], [v.to(DEVICE) for v in cache.values], positions
        )
    )
    torch.testing.assert_close(dst_pool.values[1], want.values[1], **_tolerance(torch.float32))


def test_wrong_pools_and_indices_are_refused(tiny_pair, tiny_mapper):
    source, target = tiny_pair
    slots = torch.arange(4)
    with pytest.raises(KVMapError, match="backend must be one of"):
        translate_pages(
            tiny_mapper,
            pool(source.spec, 8),
            slots,
            pool(target.spec, 8),
            slots,
            slots,
            backend="cuda",
        )
    if importlib.util.find_spec("triton") is not None:
        strided = pool(target.spec, 8)
        strided.keys[0] = torch.full((16, *strided.keys[0].shape[1:]), 0.0)[::2]
        with pytest.raises(KVMapError, match="target pool's layers"):
            translate_pages(
                tiny_mapper,
                pool(source.spec, 8),
                slots,
                strided,
                slots,
                slots,
                backend="triton",
            )
    with pytest.raises(KVMapError, match="one device"):
        translate_pages(
            tiny_mapper.to("meta"),
            pool(source.spec, 8),
            slots,
            pool(target.spec, 8),
            slots,
            slots,
        )
    with pytest.raises(KVMapError, match="pool geometry"):
        translate_pages(
            tiny_mapper, pool(target.spec, 8), slots, pool(target.spec, 8), slots, slots
        )
    with pytest.raises(KVMapError, match="equal-length"):
        translate_pages(
            tiny_mapper, pool(source.spec, 8), slots, pool(target.spec, 8), slots[:3], slots
        )
