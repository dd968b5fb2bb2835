"""The non-linear residual of a reduced-rank map: its zero start, its shapes, its rates."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from sgl_kvmap.core.errors import KVMapError
from sgl_kvmap.core.mapper import content_features
from sgl_kvmap.core.residual import initial_residual, output_rates

from .conftest import fit_tiny_mapper, random_cache, with_random_residual


def test_the_zero_start_is_exactly_the_linear_map_with_unit_pre_activations(
    tiny_pair, reduced_mapper
):
    cache = random_cache(tiny_pair[0])
    z = content_features(cache, reduced_mapper.source)["k"] @ reduced_mapper.projections["k"]
    start = initial_residual(z, 8, reduced_mapper.target.num_layers, reduced_mapper.target.kv_width)
    assert (z @ start.weight_in).pow(2).mean().sqrt().item() == pytest.approx(1.0, rel=1e-5)
    plain = reduced_mapper.map(cache)
    grown = dataclasses.replace(reduced_mapper, residuals={"k": start, "v": start}).map(cache)
    for a, b in zip(plain.keys + plain.values, grown.keys + grown.values):
        assert torch.equal(a, b)


def test_residuals_need_a_reduced_rank_map_of_matching_shapes(tiny_pair, reduced_mapper):
    cache = random_cache(tiny_pair[0])
    good = with_random_residual(reduced_mapper, cache).residuals
    k_layer = fit_tiny_mapper(*tiny_pair)
    with pytest.raises(KVMapError, match="reduced-rank"):
        dataclasses.replace(k_layer, residuals=good)
    short = {
        kind: dataclasses.replace(r, weights_out=r.weights_out[:-1]) for kind, r in good.items()
    }
    with pytest.raises(KVMapError, match="do not fit"):
        dataclasses.replace(reduced_mapper, residuals=short)
    with pytest.raises(KVMapError, match="hidden"):
        initial_residual(torch.ones(3, 16), 0, 4, 32)


def test_output_rates_match_a_linear_step_in_output_size(tiny_pair, reduced_mapper):
    """A step of the returned size on every entry of B_l moves the output by as much as a step of
    the layer's linear rate on W_l does (both as the norm of one token's output change, for
    steps of random sign)."""
    z = (
        content_features(random_cache(tiny_pair[0], tokens=400), reduced_mapper.source)["k"]
        @ reduced_mapper.projections["k"]
    )
    residual = initial_residual(z, 64, 1, 256)
    (rate,) = output_rates(residual, z, [1e-3])
    h = F.gelu(z @ residual.weight_in)
    generator = torch.Generator().manual_seed(0)
    signs = lambda rows: torch.randint(0, 2, (rows, 256), generator=generator) * 2.0 - 1  # noqa: E731
    linear_move = (z @ (1e-3 * signs(z.shape[1]))).norm(dim=1).mean()
    residual_move = (h @ (rate * signs(64))).norm(dim=1).mean()
    assert residual_move.item() == pytest.approx(linear_move.item(), rel=0.25)
