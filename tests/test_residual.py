"""The non-linear residual on a reduced-rank map: its math, its pack, its tuning."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from sgl_kvmap.core.errors import KVMapError, PackError
from sgl_kvmap.core.mapper import KVMapper, content_features
from sgl_kvmap.core.residual import initial_residual, output_rates
from sgl_kvmap.core.rope import rope
from sgl_kvmap.core.spec import tables_for_spec
from sgl_kvmap.fitting.config import TuneConfig
from sgl_kvmap.fitting.tune import _frozen, _trainable, continuation_loss, tune_mapper
from sgl_kvmap.models.capture import capture_kv

from .conftest import fit_tiny_mapper, with_random_residual

TINY = dict(prompt_len=48, continuation=16, eval_every=5, heldout_windows=2, heldout_every=3)


@pytest.fixture(scope="module")
def reduced(tiny_pair):
    return fit_tiny_mapper(*tiny_pair, rank=16)


def source_cache(tiny_pair, tokens: int = 30, seed: int = 0):
    ids = torch.randint(0, 100, (tokens,), generator=torch.Generator().manual_seed(seed))
    return capture_kv(tiny_pair[0].model, ids)


def test_the_zero_start_is_exactly_the_linear_map_with_unit_pre_activations(tiny_pair, reduced):
    cache = source_cache(tiny_pair)
    z = content_features(cache, reduced.source)["k"] @ reduced.projections["k"]
    start = initial_residual(z, 8, reduced.target.num_layers, reduced.target.kv_width)
    assert (z @ start.weight_in).pow(2).mean().sqrt().item() == pytest.approx(1.0, rel=1e-5)
    plain = reduced.map(cache)
    grown = dataclasses.replace(reduced, residuals={"k": start, "v": start}).map(cache)
    for a, b in zip(plain.keys + plain.values, grown.keys + grown.values):
        assert torch.equal(a, b)


def test_map_adds_gelu_of_the_projected_features_to_every_layer(tiny_pair, reduced):
    """y_l = z W_l + b_l + gelu(z A + c) B_l in content space, keys re-roped at their positions."""
    cache = source_cache(tiny_pair)
    mapper = with_random_residual(reduced, cache)
    features = content_features(cache, mapper.source)
    got, plain = mapper.map(cache), reduced.map(cache)
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


def test_pack_round_trip_keeps_the_residual(tiny_pair, reduced, tmp_path):
    cache = source_cache(tiny_pair)
    mapper = with_random_residual(reduced, cache)
    folder = mapper.save_pretrained(tmp_path / "residual")
    config = json.loads((folder / "kvmap.json").read_text())
    assert (config["format_version"], config["rank"], config["residual_hidden"]) == (3, 16, 8)
    assert "non-linear residual of width 8" in (folder / "README.md").read_text()
    loaded = KVMapper.from_pretrained(folder)
    assert loaded.residual_hidden == 8
    want, got = mapper.map(cache), loaded.map(cache)
    for a, b in zip(want.keys + want.values, got.keys + got.values):
        assert torch.equal(a, b)
    # a pack that drops the residual from its description must not load as the plain map
    config["residual_hidden"] = None
    (folder / "kvmap.json").write_text(json.dumps(config))
    with pytest.raises(PackError, match="does not describe"):
        KVMapper.from_pretrained(folder)


def test_plain_reduced_rank_packs_stay_version_2(reduced, tmp_path):
    config = json.loads((reduced.save_pretrained(tmp_path / "plain") / "kvmap.json").read_text())
    assert (config["format_version"], config["residual_hidden"]) == (2, None)


def test_residuals_need_a_reduced_rank_map_of_matching_shapes(tiny_pair, reduced):
    cache = source_cache(tiny_pair)
    good = with_random_residual(reduced, cache).residuals
    k_layer = fit_tiny_mapper(*tiny_pair)
    with pytest.raises(KVMapError, match="reduced-rank"):
        dataclasses.replace(k_layer, residuals=good)
    short = {
        kind: dataclasses.replace(r, weights_out=r.weights_out[:-1]) for kind, r in good.items()
    }
    with pytest.raises(KVMapError, match="do not fit"):
        dataclasses.replace(reduced, residuals=short)
    with pytest.raises(KVMapError, match="hidden"):
        initial_residual(torch.ones(3, 16), 0, 4, 32)


def test_output_rates_match_a_linear_step_in_output_size(tiny_pair, reduced):
    """A step of the returned size on every entry of B_l moves the output by as much as a step of
    the layer's linear rate on W_l does (both as the norm of one token's output change, for
    steps of random sign)."""
    z = (
        content_features(source_cache(tiny_pair, tokens=400), reduced.source)["k"]
        @ reduced.projections["k"]
    )
    residual = initial_residual(z, 64, 1, 256)
    (rate,) = output_rates(residual, z, [1e-3])
    h = F.gelu(z @ residual.weight_in)
    generator = torch.Generator().manual_seed(0)
    signs = lambda rows: torch.randint(0, 2, (rows, 256), generator=generator) * 2.0 - 1  # noqa: E731
    linear_move = (z @ (1e-3 * signs(z.shape[1]))).norm(dim=1).mean()
    residual_move = (h @ (rate * signs(64))).norm(dim=1).mean()
    assert residual_move.item() == pytest.approx(linear_move.item(), rel=0.25)


def test_tuning_grows_trains_and_keeps_a_residual(tiny_pair, reduced, text_dir, tmp_path):
    source, target = tiny_pair
    config = TuneConfig(steps=15, lr=3e-2, warmup=0, residual_hidden=8, **TINY)
    plain = tune_mapper(reduced, source, target, [text_dir / "calib"], TuneConfig(
        steps=1, lr=3e-2, warmup=0, **TINY))[1]  # fmt: skip
    tuned, report = tune_mapper(reduced, source, target, [text_dir / "calib"], config)
    # step 0 scores the fitted map: the residual starts at zero output
    assert report.curve[0]["heldout_nll"] == pytest.approx(plain.curve[0]["heldout_nll"], abs=1e-6)
    assert (
        report.best_step > 0 and report.best["heldout_nll"] < report.curve[0]["heldout_nll"] - 0.01
    )
    assert tuned.residual_hidden == 8 and reduced.residuals is None
    assert any(w.abs().sum() > 0 for w in tuned.residuals["v"].weights_out)
    assert tuned.info["metrics"]["tune_residual_hidden"] == 8
    loaded = KVMapper.from_pretrained(tuned.save_pretrained(tmp_path / "tuned"))
    cache = source_cache(tiny_pair)
    want, got = tuned.map(cache), loaded.map(cache)
    for a, b in zip(want.keys + want.values, got.keys + got.values):
        torch.testing.assert_close(a, b)


def test_gradients_reach_every_residual_tensor_after_one_step(tiny_pair, reduced):
    """At the zero start only the output matrices get a gradient (the hidden layer is behind
    B = 0); once B moves, the hidden layer's weights do too."""
    source, target = tiny_pair
    window = torch.randint(0, 100, (64,), generator=torch.Generator().manual_seed(4))
    cache = capture_kv(source.model, window[:47])
    trainable, groups = _trainable(reduced, TuneConfig(lr=1e-2, residual_hidden=8, **TINY), cache)
    optimizer = torch.optim.Adam(groups)
    residual = trainable.residuals["k"]
    with _frozen(target.model):
        for step in range(2):
            optimizer.zero_grad()
            continuation_loss(trainable, target, cache, window, 48)[0].backward()
            outputs_moved = all(w.grad.abs().sum() > 0 for w in residual.weights_out[1:])
            hidden_moved = residual.weight_in.grad.abs().sum() > 0
            assert outputs_moved and bool(hidden_moved) == (step == 1)
            optimizer.step()


def test_a_residual_needs_a_reduced_rank_map_to_tune(tiny_pair, text_dir):
    config = TuneConfig(steps=1, residual_hidden=8, **TINY)
    with pytest.raises(KVMapError, match="reduced-rank"):
        tune_mapper(fit_tiny_mapper(*tiny_pair), *tiny_pair, [text_dir / "calib"], config)
    with pytest.raises(KVMapError, match="residual_hidden"):
        TuneConfig(residual_hidden=-1)
