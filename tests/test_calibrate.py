"""fit_mapper and the fit from statistics: text -> captures -> statistics -> a KVMapper that
recovers a target that IS a cross-layer (or low-rank) linear function of the source."""

from dataclasses import replace

import pytest
import torch

from sgl_kvmap import fit_mapper
from sgl_kvmap.core.errors import KVMapError, PairMismatchError
from sgl_kvmap.core.fit import fit_affine
from sgl_kvmap.core.spec import spec_from_config
from sgl_kvmap.core.stats import Moments
from sgl_kvmap.fitting.calibrate import (
    CalibrationState,
    collect_many,
    fit_from_statistics,
)
from sgl_kvmap.fitting.config import CalibrationConfig
from sgl_kvmap.models.capture import LoadedModel, capture_kv

from .conftest import (
    SMALL_CALIBRATION,
    TRUE_SOURCES,
    char_tokenizer,
    low_rank_target,
    synthetic_target_cache,
)


def test_fit_both_directions_from_text(tiny_pair, text_dir):
    source, target = tiny_pair
    results = fit_mapper(
        source,
        target,
        [text_dir / "calib"],
        CalibrationConfig(**SMALL_CALIBRATION),
        both_directions=True,
    )
    (forward, f_report), (reverse, r_report) = results
    assert (forward.source, forward.target) == (source.spec, target.spec)
    assert (reverse.source, reverse.target) == (target.spec, source.spec)
    assert f_report.train_tokens + f_report.heldout_tokens == 8 * 127  # skip_first=1 per window
    assert f_report.heldout_tokens == 2 * 127
    assert set(f_report.per_k) == {1, 2, 3} and f_report.chosen_k in f_report.per_k
    assert (
        forward.info["calibration"]["tokens"] == 1024
        and forward.info["metrics"]["k"] == f_report.chosen_k
    )


def test_pairs_with_different_tokenizers_are_refused(tiny_pair):
    source = tiny_pair[0]
    other_tok = char_tokenizer(extra="§")
    other = LoadedModel(
        source.model, other_tok, spec_from_config(source.model.config, other_tok, "other")
    )
    with pytest.raises(PairMismatchError, match="different tokenizers"):
        fit_mapper(source, other, config=CalibrationConfig(**SMALL_CALIBRATION))


def test_statistics_grown_in_steps_through_a_file_equal_one_pass(tiny_pair, tmp_path):
    from sgl_kvmap.fitting.calibrate import collect_statistics, load_state, save_state

    source, target = tiny_pair
    config = CalibrationConfig(tokens=1024, window=64, heldout_every=4)
    windows = [torch.randint(0, 100, (64,)) for _ in range(12)]
    whole = collect_statistics(source, target, windows, config, both_directions=True)
    first = collect_statistics(source, target, windows[:8], config, both_directions=True)
    save_state(first, tmp_path / "stats.safetensors")
    resumed = load_state(tmp_path / "stats.safetensors", source.spec, target.spec)
    resumed = collect_statistics(source, target, windows, config, True, state=resumed)
    assert resumed.windows == 12
    for a, b in ((whole.forward, resumed.forward), (whole.reverse, resumed.reverse)):
        for split in ("train", "heldout"):
            for kind in ("k", "v"):
                ma, mb = getattr(a, split)[kind], getattr(b, split)[kind]
                assert ma.n == mb.n
                torch.testing.assert_close(ma.xy, mb.xy)
                torch.testing.assert_close(ma.xx, mb.xx)
    assert whole.forward.heldout["k"].n == 3 * 63  # windows 3, 7, 11
    with pytest.raises(KVMapError, match="another model pair"):
        load_state(tmp_path / "stats.safetensors", target.spec, source.spec)


def test_statistics_of_two_corpora_merge_into_the_fit_of_one_pass(tiny_pair):
    """A second corpus captured apart (its own shifts) merged in: the same fit as one pass."""
    from sgl_kvmap.fitting.calibrate import collect_statistics, fit_from_statistics

    source, target = tiny_pair
    config = CalibrationConfig(tokens=1024, window=64, heldout_every=4, top_k=2)
    generator = torch.Generator().manual_seed(7)
    code = [torch.randint(0, 60, (64,), generator=generator) for _ in range(8)]
    prose = [torch.randint(60, 128, (64,), generator=generator) for _ in range(8)]
    whole = collect_statistics(source, target, code + prose, config, both_directions=True)
    merged = collect_statistics(source, target, code, config, both_directions=True).merged(
        collect_statistics(source, target, prose, config, both_directions=True)
    )
    assert merged.windows == 16
    assert merged.forward.heldout["k"].n == whole.forward.heldout["k"].n == 4 * 63
    for a, b in ((whole.forward, merged.forward), (whole.reverse, merged.reverse)):
        (fit_a, _), (fit_b, _) = fit_from_statistics(a, config), fit_from_statistics(b, config)
        for kind in ("k", "v"):
            for ma, mb in zip(fit_a.maps[kind], fit_b.maps[kind]):
                torch.testing.assert_close(ma.weight, mb.weight, rtol=1e-3, atol=1e-4)
                torch.testing.assert_close(ma.bias, mb.bias, rtol=1e-3, atol=1e-3)
    with pytest.raises(KVMapError, match="one direction"):
        merged.merged(collect_statistics(source, target, code, config))


def test_heldout_windows_come_from_files_no_training_window_reads(tmp_path):
    """Choosing k needs text the maps never saw: no file feeds both splits."""
    from sgl_kvmap.fitting.calibrate import _heldout_indices, calibration_token_windows

    letters = "abcdefghijklmnop"
    for letter in letters:
        (tmp_path / f"{letter}.txt").write_text(letter * 300)
    tokenizer = char_tokenizer()
    config = CalibrationConfig(tokens=64 * 16, window=64, heldout_every=4)
    windows = calibration_token_windows(tokenizer, [tmp_path], config)
    assert len(windows) == 16
    heldout = _heldout_indices(len(windows), 4)
    chars = [set(w.tolist()) for w in windows]  # one id per letter, one letter per file
    seen_heldout = set().union(*(c for i, c in enumerate(chars) if i in heldout))
    seen_train = set().union(*(c for i, c in enumerate(chars) if i not in heldout))
    assert seen_heldout and seen_train and not seen_heldout & seen_train
    bigger = calibration_token_windows(tokenizer, [tmp_path], replace(config, tokens=64 * 32))
    assert all(torch.equal(a, b) for a, b in zip(windows, bigger))  # statistics can be grown
    (tmp_path / "short").mkdir()
    for name in ("x.txt", "y.txt"):
        (tmp_path / "short" / name).write_text("x" * 100)  # one window each
    with pytest.raises(KVMapError, match="too few"):
        calibration_token_windows(tokenizer, [tmp_path / "short"], config)
    with pytest.raises(KVMapError, match="two text files"):
        calibration_token_windows(tokenizer, [tmp_path / "a.txt"], config)


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


def test_a_fixed_k_above_the_source_layers_reads_every_source_layer(exact_problem):
    """``top_k`` 4 on a 3-layer source (the bench's recipe on a small source): every target
    layer reads all 3 source layers, as ``top_k`` 3 does, instead of failing."""
    *_, stats = exact_problem
    wide, report = fit_from_statistics(stats, CalibrationConfig(ridge=1e-6, top_k=4))
    exact, _ = fit_from_statistics(stats, CalibrationConfig(ridge=1e-6, top_k=3))
    assert report.chosen_k == 3
    assert wide.selection == exact.selection and all(len(s) == 3 for s in wide.selection)


def test_auto_layer_k_picks_each_layers_own_k(exact_problem):
    *_, stats = exact_problem
    mapper, report = fit_from_statistics(stats, CalibrationConfig(ridge=1e-6, top_k="auto-layer"))
    assert report.layer_ks == [1, 2, 1, 2]  # the number of true sources of each target layer
    assert [len(s) for s in mapper.selection] == report.layer_ks
    assert min(report.r2_k) > 0.999 and report.heldout["v"] > 0.999


def test_relative_ridge_scales_with_the_features(exact_problem):
    """The same relative ridge gives the same map when every feature is scaled by 1000."""
    from sgl_kvmap.core.fit import Ridge

    x, y = torch.randn(300, 6), torch.randn(300, 2)
    maps = []
    for scale in (1.0, 1000.0):
        m = Moments.empty(torch.zeros(6), torch.zeros(2))
        m.update(x * scale, y)
        w, _ = fit_affine(m, torch.arange(6), torch.arange(2), Ridge(0.5, relative=True))
        maps.append(w * scale)
    torch.testing.assert_close(maps[0], maps[1], rtol=1e-4, atol=1e-6)


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


def test_a_token_budget_far_beyond_the_text_takes_the_text_without_planning_every_window(
    tmp_path,
):
    """Before: ``--tokens 1e12`` built the set of every planned held-out window index (about
    2.4e8 of them) before reading a token. Now the windows the text gives are taken, the same
    as under a budget that just covers them, in little memory."""
    import tracemalloc

    from sgl_kvmap.fitting.calibrate import calibration_token_windows

    for letter in "abcdefghijklmnop":
        (tmp_path / f"{letter}.txt").write_text(letter * 300)
    config = CalibrationConfig(tokens=64 * 16, window=64, heldout_every=4)
    fitting = calibration_token_windows(char_tokenizer(), [tmp_path], config)
    tracemalloc.start()
    huge = calibration_token_windows(char_tokenizer(), [tmp_path], replace(config, tokens=10**12))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 64 * 2**20
    assert len(huge) >= len(fitting)
    assert all(torch.equal(a, b) for a, b in zip(fitting, huge))
