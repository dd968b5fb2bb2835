"""KVMapper: the reference map, its dtypes, its device and head subsets, its residual."""

import pytest
import torch
import torch.nn.functional as F

from sgl_kvmap.core.errors import KVMapError
from sgl_kvmap.core.mapper import content_features
from sgl_kvmap.core.rope import rope
from sgl_kvmap.core.spec import tables_for_spec
from sgl_kvmap.fitting.calibrate import PairStatistics, fit_from_statistics
from sgl_kvmap.fitting.config import CalibrationConfig
from sgl_kvmap.models.capture import capture_kv

from .conftest import fit_tiny_mapper, random_cache, tiny_model, with_random_residual


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


def test_to_moves_every_weight_and_leaves_the_original(tiny_pair):
    """A reduced-rank mapper moved to another device carries its maps and projections there
    and a copy of its recorded info; moved back it maps exactly as before."""

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
    from .conftest import with_random_residual

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


def test_map_adds_gelu_of_the_projected_features_to_every_layer(tiny_pair, reduced_mapper):
    """y_l = z W_l + b_l + gelu(z A + c) B_l in content space, keys re-roped at their positions."""
    cache = random_cache(tiny_pair[0])
    mapper = with_random_residual(reduced_mapper, cache)
    features = content_features(cache, mapper.source)
    got, plain = mapper.map(cache), reduced_mapper.map(cache)
    assert not torch.allclose(got.values[1], plain.values[1])  # the residual moved it
    tables = tables_for_spec(mapper.target, cache.positions)
    shape = (len(cache), mapper.target.num_kv_heads, mapper.target.head_dim)
    for kind, layers in (("k", got.keys), ("v", got.values)):
        z, residual = features[kind] @ mapper.projections[kind], mapper.residuals[kind]
        hidden = F.gelu(z @ residual.weight_in + residual.bias_in)
        for layer, out in enumerate(layers):
            linear = mapper.maps[kind][layer]
            content = z @ linear.weight + linear.bias + hidden @ residual.weights_out[layer]
            want = content.reshape(shape)
            want = rope(want, tables, mapper.target.rope_style) if kind == "k" else want
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
