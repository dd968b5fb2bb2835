"""Streaming moments: batch-equal, exact to merge across shifts, weighted least squares."""

import pytest
import torch

from sgl_kvmap.core.errors import KVMapError
from sgl_kvmap.core.fit import (
    fit_affine,
)
from sgl_kvmap.core.stats import Moments, moments_from_tensors, moments_to_tensors, residuals

from .conftest import moments_of


def test_streaming_moments_equal_batch_statistics():
    x, y = (
        torch.randn(300, 6) * 5 + 40,
        torch.randn(300, 4) - 7,
    )  # large means, as with sink outliers
    m = moments_of(x, y, batches=7)
    cxx, cxy = m.centered_gram(torch.arange(6)), m.centered_cross(torch.arange(6), torch.arange(4))
    xc, yc = (x - x.mean(0)).double(), (y - y.mean(0)).double()
    torch.testing.assert_close(cxx, xc.T @ xc, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(cxy, xc.T @ yc, rtol=1e-5, atol=1e-3)
    both = moments_of(x[:100], y[:100], 1)
    rest = Moments.empty(both.shift_x, both.shift_y)
    rest.update(x[100:], y[100:])
    merged = both.merged(rest)
    torch.testing.assert_close(merged.centered_gram(torch.arange(6)), cxx, rtol=1e-6, atol=1e-3)


def test_moments_captured_about_other_shifts_merge_exactly():
    """Two corpora captured separately (each shifted by its own first batch) merge into the
    moments of one pass over both: every raw moment, so the fit and its residuals agree."""
    x, y = torch.randn(300, 6) * 5 + 40, torch.randn(300, 4) - 7
    x[200:] += 30  # a second corpus with other means
    one_pass = moments_of(x, y, batches=5)
    first, second = moments_of(x[:200], y[:200], 2), moments_of(x[200:], y[200:], 2)
    assert not torch.equal(first.shift_x, second.shift_x)
    merged = first.merged(second)
    moved = one_pass.reshifted(first.shift_x, first.shift_y)
    for name in ("n", "sum_x", "sum_y", "xx", "xy", "yy"):
        torch.testing.assert_close(
            torch.as_tensor(getattr(merged, name)),
            torch.as_tensor(getattr(moved, name)),
            rtol=1e-6,
            atol=1e-3,
        )  # the tolerance: batches multiply in float32
    torch.testing.assert_close(merged.mean_x, x.double().mean(0))
    cols_x, cols_y = torch.arange(6), torch.arange(4)
    xc, yc = (x - x.mean(0)).double(), (y - y.mean(0)).double()
    torch.testing.assert_close(
        merged.centered_cross(cols_x, cols_y), xc.T @ yc, rtol=1e-6, atol=1e-3
    )
    w, b = fit_affine(merged, cols_x, cols_y, ridge=1e-3)
    sse, _ = residuals(merged, cols_x, cols_y, w, b)
    direct = ((x.double() @ w + b - y.double()) ** 2).sum(0)
    torch.testing.assert_close(sse, direct, rtol=1e-6, atol=1e-3)


def test_residuals_match_direct_computation_on_other_data():
    x, y = torch.randn(100, 5), torch.randn(100, 3)
    m = moments_of(x, y)
    w, b = torch.randn(5, 3).double(), torch.randn(3).double()
    sse, sst = residuals(m, torch.arange(5), torch.arange(3), w, b)
    pred = x.double() @ w + b
    torch.testing.assert_close(sse, (y.double() - pred).square().sum(0), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        sst, (y.double() - y.double().mean(0)).square().sum(0), rtol=1e-6, atol=1e-6
    )


def test_integer_weights_equal_repeated_rows():
    torch.manual_seed(0)
    x, y = torch.randn(50, 6) + 3, torch.randn(50, 4) - 2
    repeats = torch.randint(0, 4, (50,))
    weighted = Moments.empty(x[0], y[0])
    weighted.update(x, y, repeats.float())
    repeated = Moments.empty(x[0], y[0])
    repeated.update(x.repeat_interleave(repeats, 0), y.repeat_interleave(repeats, 0))
    assert weighted.n == pytest.approx(repeated.n)
    cols_x, cols_y = torch.arange(6), torch.arange(4)
    for a, b in (
        (weighted.centered_gram(cols_x), repeated.centered_gram(cols_x)),
        (weighted.centered_cross(cols_x, cols_y), repeated.centered_cross(cols_x, cols_y)),
    ):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)  # float32 products
    w, b = fit_affine(weighted, cols_x, cols_y, 1e-9)
    sse_w, sst_w = residuals(weighted, cols_x, cols_y, w, b)
    sse_r, sst_r = residuals(repeated, cols_x, cols_y, w, b)
    torch.testing.assert_close(sse_w, sse_r, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(sst_w, sst_r, rtol=1e-4, atol=1e-4)


def test_weighted_fit_is_weighted_least_squares():
    torch.manual_seed(1)
    x, y = torch.randn(80, 5, dtype=torch.float64), torch.randn(80, 3, dtype=torch.float64)
    weights = torch.rand(80, dtype=torch.float64) * 3
    m = Moments.empty(x.mean(0), y.mean(0))
    m.update(x, y, weights)
    w, b = fit_affine(m, torch.arange(5), torch.arange(3), 0.0 + 1e-12)
    design = torch.cat([x, torch.ones(80, 1, dtype=torch.float64)], 1) * weights.sqrt()[:, None]
    expected = torch.linalg.lstsq(design, y * weights.sqrt()[:, None]).solution
    torch.testing.assert_close(w, expected[:5], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(b, expected[5], rtol=1e-4, atol=1e-5)
    saved = moments_from_tensors(moments_to_tensors(m, "m"), "m")
    assert saved.n == pytest.approx(m.n) and isinstance(saved.n, float)


def test_bad_weights_are_refused():
    m = Moments.empty(torch.zeros(2), torch.zeros(1))
    with pytest.raises(KVMapError, match="non-negative"):
        m.update(torch.ones(3, 2), torch.ones(3, 1), torch.tensor([1.0, -1.0, 1.0]))
    with pytest.raises(KVMapError, match="weight"):
        m.update(torch.ones(3, 2), torch.ones(3, 1), torch.ones(2))
