"""Attention-weighted calibration: weighted moments, attention received, one-pass collection."""

import pytest
import torch

from sgl_kvmap.core.errors import KVMapError
from sgl_kvmap.core.fit import fit_affine
from sgl_kvmap.core.stats import Moments, moments_from_tensors, moments_to_tensors, residuals
from sgl_kvmap.core.token_weights import attention_paid, attention_received, token_weights
from sgl_kvmap.fitting.calibrate import CalibrationState, collect_many
from sgl_kvmap.fitting.config import CalibrationConfig
from sgl_kvmap.models.capture import run

from .conftest import tiny_model


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


def test_attention_received_matches_the_models_own_attention_probabilities():
    loaded = tiny_model("qwen3", seed=3)  # QK-norm: queries differ from the raw projections
    ids = torch.randint(0, 100, (40,))
    result = run(loaded.model, ids, want_queries=True)
    ours = attention_received(result.queries, result.cache.keys)
    loaded.model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            out = loaded.model(input_ids=ids[None], output_attentions=True)
    finally:
        loaded.model.set_attn_implementation("sdpa")
    probs = torch.stack(out.attentions)[:, 0]  # [layers, heads, i, j]
    received = probs.sum(2).mean((0, 1))
    uniform = torch.tensor([sum(1 / (i + 1) for i in range(j, 40)) for j in range(40)])
    torch.testing.assert_close(ours, received / uniform, rtol=1e-4, atol=1e-5)
    last = [q[-7:] for q in result.queries]  # the last 7 positions' queries only
    torch.testing.assert_close(
        attention_paid(last, result.cache.keys),
        probs[:, :, -7:].sum(2).mean((0, 1)),
        rtol=1e-4,
        atol=1e-5,
    )


def test_uniform_attention_gives_weight_one():
    queries = [torch.zeros(10, 4, 8)]
    keys = [torch.randn(10, 2, 8)]
    torch.testing.assert_close(attention_received(queries, keys), torch.ones(10))


def test_token_weights_mean_one_and_power_zero_is_unweighted():
    received = torch.tensor([4.0, 1.0, 0.25, 1.0])
    torch.testing.assert_close(token_weights(received, 0.0), torch.ones(4))
    weights = token_weights(received, 1.0)
    assert weights.mean().item() == pytest.approx(1.0)
    assert weights[0] / weights[2] == pytest.approx(16.0)
    root = received.sqrt()
    torch.testing.assert_close(token_weights(received, 0.5), root / root.mean())
    with pytest.raises(KVMapError):
        token_weights(received, -1.0)


def test_one_pass_grows_weighted_and_unweighted_statistics_alike(tiny_pair):
    """Several weightings grown together equal each grown alone."""
    from sgl_kvmap.fitting.calibrate import collect_statistics

    source, target = tiny_pair
    windows = [torch.randint(0, 100, (48,)) for _ in range(4)]
    plain = CalibrationConfig(tokens=192, window=48, heldout_every=2)
    weighted = CalibrationConfig(tokens=192, window=48, heldout_every=2, attention_power=1.0)
    together = collect_many(
        source,
        target,
        windows,
        plain,
        [
            CalibrationState.empty(source.spec, target.spec, True, 0.0),
            CalibrationState.empty(source.spec, target.spec, False, 1.0),
        ],
    )
    alone = [
        collect_statistics(source, target, windows, plain, both_directions=True),
        collect_statistics(source, target, windows, weighted),
    ]
    for a, b in zip(together, alone):
        for split in ("train", "heldout"):
            ma, mb = a.forward.__dict__[split]["v"], b.forward.__dict__[split]["v"]
            assert ma.n == pytest.approx(mb.n)
            torch.testing.assert_close(ma.xy, mb.xy)
    assert together[1].reverse is None
    differs = together[0].forward.train["k"].xy - together[1].forward.train["k"].xy
    assert differs.abs().max() > 1e-3  # the weighting did change the statistics
    with pytest.raises(KVMapError, match="attention power"):
        collect_statistics(source, target, windows, plain, state=together[1])
