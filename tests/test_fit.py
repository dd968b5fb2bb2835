import torch

from sgl_kvmap.core.fit import (
    Geometry,
    candidate_ks,
    fit_affine,
    probe_scores,
    r2_by_head,
    ridge_solve,
    top_k_selection,
)
from sgl_kvmap.core.stats import Moments, residuals


def moments_of(x, y, batches=3):
    m = Moments.empty(x[:10].mean(0), y[:10].mean(0))
    for xb, yb in zip(x.chunk(batches), y.chunk(batches)):
        m.update(xb, yb)
    return m


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
        )  # fmt: skip  (batches multiply in float32)
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


def test_ridge_equals_direct_least_squares():
    x, y = torch.randn(200, 5).double(), torch.randn(200, 3).double()
    xc, yc = x - x.mean(0), y - y.mean(0)
    lam = 0.7
    w = ridge_solve(xc.T @ xc, xc.T @ yc, lam)
    augmented_x = torch.cat((xc, lam**0.5 * torch.eye(5, dtype=torch.float64)))
    augmented_y = torch.cat((yc, torch.zeros(5, 3, dtype=torch.float64)))
    direct = torch.linalg.lstsq(augmented_x, augmented_y).solution
    torch.testing.assert_close(w, direct, rtol=1e-9, atol=1e-9)


def test_exact_affine_target_is_recovered_with_r2_one():
    x = torch.randn(500, 8)
    w_true, b_true = torch.randn(8, 4), torch.randn(4)
    m = moments_of(x, x @ w_true + b_true)
    w, b = fit_affine(m, torch.arange(8), torch.arange(4), ridge=1e-8)
    torch.testing.assert_close(w.float(), w_true, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(b.float(), b_true, rtol=1e-4, atol=1e-4)
    sse, sst = residuals(m, torch.arange(8), torch.arange(4), w, b)
    assert r2_by_head(sse, sst, 2).min() > 0.9999


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


def test_probe_scores_find_the_informative_source_layer():
    n, ws, wt = 400, 4, 6
    source = torch.randn(n, 3 * ws)  # 3 source layers
    target_layers = [
        source[:, 2 * ws : 3 * ws] @ torch.randn(ws, wt),
        source[:, 0:ws] @ torch.randn(ws, wt),
    ]
    y = torch.cat(target_layers, 1) + 0.01 * torch.randn(n, 2 * wt)
    train = {kind: moments_of(source, y) for kind in ("k", "v")}
    geo = Geometry(3, ws, 2, wt, target_head_dim=3)
    scores = probe_scores(train, geo, ridge=1e-3)
    assert scores.shape == (2, 3)
    assert top_k_selection(scores, 1) == [[2], [0]]
    assert scores[0, 2] > 0.99 and scores[0, 1] < 0.1


def test_candidate_ks():
    assert candidate_ks(24) == [1, 2, 4, 8, 16, 24]
    assert candidate_ks(1) == [1]


def test_singular_gram_still_solves_as_ridge():
    """Fewer samples than features (rank-deficient Gram): the ridge solution still exists."""
    x = torch.randn(5, 12).double()
    xc = x - x.mean(0)
    null = torch.linalg.svd(xc).Vh[5:].T  # directions the 5 samples never visit
    gram = xc.T @ xc - 0.2 * null @ null.T  # indefinite there, as float32 sums can leave it
    y = torch.randn(5, 2).double()
    w = ridge_solve(gram, xc.T @ (y - y.mean(0)), 0.1)
    direct = torch.linalg.solve(
        xc.T @ xc + 0.1 * torch.eye(12, dtype=torch.float64), xc.T @ (y - y.mean(0))
    )
    torch.testing.assert_close(w, direct, rtol=1e-5, atol=1e-6)
