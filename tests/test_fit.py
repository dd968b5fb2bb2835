"""Ridge maps, probe scores and the candidate k and ranks, from sufficient statistics."""

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
from sgl_kvmap.core.stats import residuals

from .conftest import moments_of


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


def test_candidate_ranks_double_up_to_the_widest():
    from sgl_kvmap.core.fit import Geometry, candidate_ranks

    assert candidate_ranks(Geometry(24, 128, 28, 256, 128)) == [128, 256, 512, 1024, 2048, 3072]
    assert candidate_ranks(Geometry(3, 32, 4, 32, 32)) == [96]
