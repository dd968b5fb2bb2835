"""A mapper fitted on a target that IS a cross-layer linear function of the source recovers it."""

from dataclasses import replace

import pytest
import torch

from sgl_kvmap.core.cache import KVCache
from sgl_kvmap.core.errors import KVMapError
from sgl_kvmap.core.mapper import content_features
from sgl_kvmap.core.rope import rope, unrope
from sgl_kvmap.core.spec import tables_for_spec
from sgl_kvmap.fitting.calibrate import PairStatistics, fit_from_statistics
from sgl_kvmap.fitting.config import CalibrationConfig
from sgl_kvmap.models.capture import capture_kv

from .conftest import tiny_model

# target layer -> source layers it is built from (3 source layers, 4 target layers)
TRUE_SOURCES = [[0], [0, 2], [1], [1, 2]]


def synthetic_target_cache(source_cache: KVCache, source_spec, target_spec, weights) -> KVCache:
    """Target post-RoPE K/V that are exact affine maps of the source's content-space K/V."""
    t = len(source_cache)
    src_tables, tgt_tables = (
        tables_for_spec(source_spec, source_cache.positions),
        tables_for_spec(target_spec, source_cache.positions),
    )
    content = {
        "k": [
            unrope(k, src_tables, source_spec.rope_style).reshape(t, -1) for k in source_cache.keys
        ],
        "v": [v.reshape(t, -1) for v in source_cache.values],
    }
    shape = (t, target_spec.num_kv_heads, target_spec.head_dim)
    out = {"k": [], "v": []}
    for layer, sources in enumerate(TRUE_SOURCES):
        for kind in ("k", "v"):
            w, b = weights[kind][layer]
            y = (torch.cat([content[kind][s] for s in sources], 1) @ w + b).reshape(shape)
            out[kind].append(rope(y, tgt_tables, target_spec.rope_style) if kind == "k" else y)
    return KVCache(out["k"], out["v"], source_cache.positions)


def cross_family_pair():
    """Llama-3-scaled RoPE (half-split) -> GLM (partial, interleaved), geometry differs too."""
    return tiny_model("llama3", seed=7), tiny_model(
        "glm", seed=8, layers=4, kv_heads=1, head_dim=32
    )


@pytest.fixture(scope="module", params=["qwen2->qwen2", "llama3->glm"])
def exact_problem(request, tiny_pair):
    source, target = tiny_pair if request.param == "qwen2->qwen2" else cross_family_pair()
    torch.manual_seed(0)
    ws, wt = source.spec.kv_width, target.spec.kv_width
    weights = {
        kind: [(torch.randn(len(s) * ws, wt) / ws**0.5, torch.randn(wt)) for s in TRUE_SOURCES]
        for kind in ("k", "v")
    }
    stats = statistics_of(
        source, target, lambda src: synthetic_target_cache(src, source.spec, target.spec, weights)
    )
    return source, target, weights, stats


def statistics_of(source, target, target_cache_of) -> PairStatistics:
    """Statistics of six random 64-token windows of ``source`` (the last held out) against the
    synthetic target caches ``target_cache_of(source_cache)``."""
    stats = PairStatistics(source.spec, target.spec)
    for i in range(6):
        src = capture_kv(source.model, torch.randint(0, 100, (64,)))
        stats.update(
            content_features(src, source.spec, slice(1, None)),
            content_features(target_cache_of(src), target.spec, slice(1, None)),
            held_out=i == 5,
        )
    return stats


def test_exact_linear_target_is_recovered(exact_problem):
    source, target, weights, stats = exact_problem
    mapper, report = fit_from_statistics(stats, CalibrationConfig(ridge=1e-6, top_k=2))
    for layer, sources in enumerate(TRUE_SOURCES):
        assert set(sources) <= set(mapper.selection[layer])
    assert min(report.r2_k) > 0.999 and min(report.r2_v) > 0.999
    src = capture_kv(source.model, torch.randint(0, 100, (80,)))  # unseen tokens and positions
    expected = synthetic_target_cache(src, source.spec, target.spec, weights)
    mapped = mapper.map(src)
    for got, want in zip(mapped.keys + mapped.values, expected.keys + expected.values):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=2e-3)


def test_auto_k_prefers_the_smallest_sufficient_k(exact_problem):
    *_, stats = exact_problem
    mapper, report = fit_from_statistics(stats, CalibrationConfig(ridge=1e-6))
    assert report.chosen_k == 2  # k=1 misses layers built from two sources; 2 and 3 are both exact
    assert report.per_k[1]["k"] < 0.99 < report.per_k[2]["k"]


def test_auto_layer_k_picks_each_layers_own_k(exact_problem):
    *_, stats = exact_problem
    mapper, report = fit_from_statistics(stats, CalibrationConfig(ridge=1e-6, top_k="auto-layer"))
    assert report.layer_ks == [1, 2, 1, 2]  # the number of true sources of each target layer
    assert [len(s) for s in mapper.selection] == report.layer_ks
    assert min(report.r2_k) > 0.999 and report.heldout["v"] > 0.999


def test_relative_ridge_scales_with_the_features(exact_problem):
    """The same relative ridge gives the same map when every feature is scaled by 1000."""
    from sgl_kvmap.core.fit import Ridge, fit_affine
    from sgl_kvmap.core.stats import Moments

    x, y = torch.randn(300, 6), torch.randn(300, 2)
    maps = []
    for scale in (1.0, 1000.0):
        m = Moments.empty(torch.zeros(6), torch.zeros(2))
        m.update(x * scale, y)
        w, _ = fit_affine(m, torch.arange(6), torch.arange(2), Ridge(0.5, relative=True))
        maps.append(w * scale)
    torch.testing.assert_close(maps[0], maps[1], rtol=1e-4, atol=1e-6)


def test_map_refuses_a_cache_of_another_geometry(exact_problem, tiny_pair):
    *_, stats = exact_problem
    mapper, _ = fit_from_statistics(stats, CalibrationConfig(ridge=1e-6, top_k=1))
    wrong = capture_kv(tiny_pair[1].model, torch.randint(0, 100, (10,)))  # the target's own cache
    with pytest.raises(KVMapError, match="source cache has"):
        mapper.map(wrong)


def test_mapping_between_a_model_and_itself_is_near_exact(tiny_pair):
    """Source == target: each layer is exactly its own source layer (k=1 suffices)."""
    model = tiny_pair[0]
    stats = PairStatistics(model.spec, model.spec)
    for i in range(4):
        feats = content_features(
            capture_kv(model.model, torch.randint(0, 100, (64,))), model.spec, slice(1, None)
        )
        stats.update(feats, feats, held_out=i == 3)
    mapper, report = fit_from_statistics(stats, CalibrationConfig(ridge=1e-6, top_k=1))
    assert mapper.selection == [[0], [1], [2]]
    src = capture_kv(model.model, torch.randint(0, 100, (30,)))
    for got, want in zip(mapper.map(src).keys, src.keys):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def test_bfloat16_matrix_products_stay_within_bfloat16_rounding(exact_problem):
    """matmul_dtype=bfloat16 changes the map by about bf16's precision (2^-8), no more."""
    source, _, _, stats = exact_problem
    mapper, _ = fit_from_statistics(stats, CalibrationConfig(ridge=1e-6, top_k=2))
    src = capture_kv(source.model, torch.randint(0, 100, (80,)))
    exact, fast = mapper.map(src), mapper.map(src, matmul_dtype=torch.bfloat16)
    for e, f in zip(exact.keys + exact.values, fast.keys + fast.values):
        assert f.dtype == torch.float32
        relative = (f - e).norm() / e.norm()
        assert 1e-5 < relative < 2e-2  # really computed in bf16, and close


def low_rank_target(src: KVCache, source_spec, target_spec, factors) -> KVCache:
    """Target post-RoPE K/V that are rank-r maps of ALL the source's content-space K/V."""
    t, layers = len(src), target_spec.num_layers
    x = content_features(src, source_spec, slice(0, None))
    tables = tables_for_spec(target_spec, src.positions)
    out = {}
    for kind, (a, b, bias) in factors.items():
        y = (x[kind] @ a @ b + bias).reshape(t, layers, target_spec.num_kv_heads, -1)
        out[kind] = [y[:, layer] for layer in range(layers)]
    keys = [rope(k, tables, target_spec.rope_style) for k in out["k"]]
    return KVCache(keys, out["v"], src.positions)


@pytest.fixture(scope="module")
def low_rank_problem(tiny_pair):
    """Target K/V of true rank 3 over all source layers, as statistics and as caches."""
    source, target = tiny_pair
    torch.manual_seed(1)
    dx = source.spec.num_layers * source.spec.kv_width
    dy = target.spec.num_layers * target.spec.kv_width
    factors = {
        kind: (torch.randn(dx, 3) / dx**0.5, torch.randn(3, dy), torch.randn(dy))
        for kind in ("k", "v")
    }
    stats = statistics_of(
        source, target, lambda src: low_rank_target(src, source.spec, target.spec, factors)
    )
    return source, target, factors, stats


def test_reduced_rank_recovers_a_low_rank_map_through_its_projection(low_rank_problem):
    source, target, factors, stats = low_rank_problem
    mapper, report = fit_from_statistics(stats, CalibrationConfig(ridge=1e-6, rank=3))
    assert mapper.rank == 3 and mapper.source_layers_per_target == source.spec.num_layers
    assert mapper.projections["k"].shape == (source.spec.num_layers * source.spec.kv_width, 3)
    assert mapper.maps["v"][0].weight.shape == (3, target.spec.kv_width)
    assert min(report.r2_k) > 0.999 and min(report.r2_v) > 0.999
    src = capture_kv(source.model, torch.randint(0, 100, (50,)))  # unseen tokens
    expected = low_rank_target(src, source.spec, target.spec, factors)
    mapped = mapper.map(src)
    for got, want in zip(mapped.keys + mapped.values, expected.keys + expected.values):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=2e-3)
    short, short_report = fit_from_statistics(stats, CalibrationConfig(ridge=1e-6, rank=1))
    assert short_report.heldout["k"] < 0.9  # rank 1 cannot hold a rank-3 map


def test_full_rank_equals_the_all_layer_ridge(exact_problem):
    source, target, _, stats = exact_problem
    config = CalibrationConfig(ridge=1e-3, top_k=source.spec.num_layers)
    full, full_report = fit_from_statistics(stats, config)
    rank = source.spec.num_layers * source.spec.kv_width  # every direction kept
    reduced, reduced_report = fit_from_statistics(stats, replace(config, rank=rank))
    src = capture_kv(source.model, torch.randint(0, 100, (40,)))
    for a, b in zip(full.map(src).keys, reduced.map(src).keys):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
    assert reduced_report.heldout["v"] == pytest.approx(full_report.heldout["v"], abs=1e-4)


def test_candidate_ranks_double_up_to_the_widest():
    from sgl_kvmap.core.fit import Geometry, candidate_ranks

    assert candidate_ranks(Geometry(24, 128, 28, 256, 128)) == [128, 256, 512, 1024, 2048, 3072]
    assert candidate_ranks(Geometry(3, 32, 4, 32, 32)) == [96]


def test_auto_rank_records_every_rank_tried(low_rank_problem):
    *_, stats = low_rank_problem
    mapper, report = fit_from_statistics(stats, CalibrationConfig(ridge=1e-6, rank="auto"))
    assert report.rank == mapper.rank == 96 and "rank 96" in report.per_k
    assert report.summary()["rank"] == 96 and report.heldout["k"] > 0.999


def test_auto_rank_keeps_the_k_layer_map_only_where_it_is_clearly_better(low_rank_problem):
    from sgl_kvmap.fitting.calibrate import _better_map

    *_, stats = low_rank_problem
    config = CalibrationConfig(ridge=1e-6)
    k_layers = fit_from_statistics(stats, config)
    short = fit_from_statistics(stats, replace(config, rank=1))  # cannot hold the rank-3 map
    mapper, report = _better_map(short, k_layers, tolerance=0.01)
    assert mapper is k_layers[0] and report.rank is None and "rank 1" in report.per_k
    exact = fit_from_statistics(stats, replace(config, rank=3))  # as good: the cheaper family
    mapper, report = _better_map(exact, fit_from_statistics(stats, config), tolerance=0.01)
    assert mapper is exact[0] and report.rank == 3 and 1 in report.per_k


def test_bad_ranks_are_refused(low_rank_problem):
    *_, stats = low_rank_problem
    for bad in (0, "most"):
        with pytest.raises(KVMapError, match="rank"):
            CalibrationConfig(rank=bad)
    with pytest.raises(KVMapError, match="rank must be in"):
        fit_from_statistics(stats, CalibrationConfig(rank=10_000))


def test_to_moves_every_weight_and_leaves_the_original(tiny_pair):
    """A reduced-rank mapper moved to another device carries its maps and projections there
    and a copy of its recorded info; moved back it maps exactly as before."""
    from .conftest import fit_tiny_mapper

    mapper = fit_tiny_mapper(*tiny_pair, rank=16)
    moved = mapper.to("meta")
    tensors = [t for layers in moved.maps.values() for m in layers for t in (m.weight, m.bias)]
    assert all(t.is_meta for t in tensors + list(moved.projections.values()))
    assert not mapper.maps["k"][0].weight.is_meta and not mapper.projections["k"].is_meta
    moved.info["touched"] = True
    assert "touched" not in mapper.info
    cache = capture_kv(tiny_pair[0].model, torch.randint(0, 100, (20,)))
    back, before = mapper.to("cpu").map(cache), mapper.map(cache)
    for got, want in zip(back.keys + back.values, before.keys + before.values):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["k-layer", "reduced-rank + residual"])
def test_a_head_subset_maps_exactly_those_heads_of_the_full_map(tiny_pair, family):
    """``for_target_heads`` slices the weights per output head: mapping with it gives the full
    map's output for those heads, in the order asked, with a target spec of that many heads."""
    from .conftest import fit_tiny_mapper, with_random_residual

    source, target = tiny_pair[0], tiny_model("qwen2", seed=3, layers=2, kv_heads=4, head_dim=8)
    cache = capture_kv(source.model, torch.randint(0, 100, (20,)))
    if family == "k-layer":
        mapper = fit_tiny_mapper(source, target)
    else:
        mapper = with_random_residual(fit_tiny_mapper(source, target, rank=16), cache)
    full = mapper.map(cache)
    for heads in ([0], [2, 3], [3, 1]):
        part = mapper.for_target_heads(heads)
        assert part.target.num_kv_heads == len(heads)
        assert part.target.fingerprint != mapper.target.fingerprint
        mapped = part.map(cache)
        for got, want in zip(mapped.keys + mapped.values, full.keys + full.values):
            torch.testing.assert_close(got, want[:, heads], rtol=1e-5, atol=1e-5)
    with pytest.raises(KVMapError, match="not KV heads"):
        mapper.for_target_heads([4])
