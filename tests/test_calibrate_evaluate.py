from dataclasses import replace
from pathlib import Path

import pytest
import torch

from sgl_kvmap import CalibrationConfig, evaluate, fit_mapper
from sgl_kvmap.core.errors import KVMapError, PairMismatchError
from sgl_kvmap.core.spec import spec_from_config
from sgl_kvmap.fitting.evaluate import RATIOS, bootstrap_interval, paired_difference
from sgl_kvmap.fitting.texts import eval_windows, expand_paths
from sgl_kvmap.models.capture import LoadedModel, run

from .conftest import char_tokenizer, tiny_model

SMALL = dict(tokens=1024, window=128, heldout_every=4)


def test_fit_both_directions_from_text(tiny_pair, text_dir):
    source, target = tiny_pair
    results = fit_mapper(
        source, target, [text_dir / "calib"], CalibrationConfig(**SMALL), both_directions=True
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
        fit_mapper(source, other, config=CalibrationConfig(**SMALL))


def test_config_validation():
    with pytest.raises(KVMapError):
        CalibrationConfig(tokens=100, window=128)
    with pytest.raises(KVMapError):
        CalibrationConfig(top_k="many")


def test_self_map_evaluates_as_lossless(text_dir):
    """Mapping a model onto itself: the translated cache must behave like the true one."""
    model = tiny_model("llama3", seed=5)
    ((mapper, _),) = fit_mapper(
        model,
        model,
        [text_dir / "calib"],
        CalibrationConfig(**SMALL, top_k=1, ridge=1e-6, sink_tokens=0),
    )
    windows = eval_windows(model.tokenizer, expand_paths([text_dir / "eval"]), 96, 2)
    report = evaluate(mapper, model, model, windows, prefix_len=64, continuation=32, tail=4)
    assert report.mapped.accuracy == pytest.approx(report.reference.accuracy)
    assert report.mapped.nll == pytest.approx(report.reference.nll, abs=1e-3)
    assert report.source.nll == pytest.approx(report.reference.nll, abs=1e-4)
    assert min(report.r2_k) > 0.999 and min(report.r2_v) > 0.999
    assert min(report.attention_cosine) > 0.999
    # a random tiny model may score no token right on these windows: retention is then None
    # by definition (the windows are this repository's sources, which change)
    assert report.retention == (pytest.approx(1.0) if report.reference.accuracy else None)
    assert report.gap_closed is None


def test_evaluation_baselines_match_direct_runs(tiny_pair, text_dir):
    source, target = tiny_pair
    ((mapper, _),) = fit_mapper(source, target, [text_dir / "calib"], CalibrationConfig(**SMALL))
    windows = eval_windows(target.tokenizer, expand_paths([text_dir / "eval"]), 80, 1)
    report = evaluate(mapper, source, target, windows, prefix_len=48, continuation=32, tail=8)
    w = windows[0]
    direct = run(target.model, w, logits_to_keep=33).logits[:-1]
    acc = (direct.argmax(-1) == w[48:]).float().mean().item()
    assert report.reference.accuracy == pytest.approx(acc)
    none = run(target.model, w[47:], logits_to_keep=33).logits[:-1]
    assert report.no_prefix.nll == pytest.approx(
        torch.nn.functional.cross_entropy(none, w[48:]).item(), rel=1e-5
    )
    assert len(report.r2_k) == target.spec.num_layers == len(report.attention_cosine)
    assert "target, translated + 8-token tail" in report.table()


def test_per_window_scores_average_to_the_report(tiny_pair, text_dir):
    source, target = tiny_pair
    ((mapper, _),) = fit_mapper(source, target, [text_dir / "calib"], CalibrationConfig(**SMALL))
    windows = eval_windows(target.tokenizer, expand_paths([text_dir / "eval"]), 80, 3)
    report = evaluate(mapper, source, target, windows, prefix_len=48, continuation=32, tail=8)
    assert len(report.by_window) == len(windows) == 3
    for name in ("reference", "mapped", "mapped_tail", "source", "no_prefix"):
        per_window = [w[name] for w in report.by_window]
        overall = getattr(report, name)
        assert overall.nll == pytest.approx(sum(q.nll for q in per_window) / 3, rel=1e-5)
        assert overall.accuracy == pytest.approx(sum(q.accuracy for q in per_window) / 3)
    assert len({w["mapped"].nll for w in report.by_window}) == 3  # not one figure copied
    spans = report.intervals()  # from those per-window scores
    assert set(spans) == set(RATIOS) and spans["retention_repaired"] is None  # no repair run
    assert report.to_dict()["intervals"]["retention"] == spans["retention"]


def test_bootstrap_interval_brackets_the_ratio_and_widens_with_the_level():
    generator = torch.Generator().manual_seed(1)
    accuracy = {
        name: (base + 0.1 * torch.rand(16, generator=generator, dtype=torch.float64))
        for name, base in (("reference", 0.8), ("mapped", 0.7), ("source", 0.6))
    }
    means = {name: values.mean().item() for name, values in accuracy.items()}
    gap = (means["mapped"] - means["source"]) / (means["reference"] - means["source"])
    wide = bootstrap_interval(accuracy, "mapped", "source", level=0.9)
    narrow = bootstrap_interval(accuracy, "mapped", "source", level=0.5)
    assert wide[0] < narrow[0] < gap < narrow[1] < wide[1]
    assert bootstrap_interval(accuracy, "mapped", "source", level=0.9) == wide  # fixed seed
    retention = bootstrap_interval(accuracy, "mapped", None)
    assert retention[0] < means["mapped"] / means["reference"] < retention[1] < 1


def test_bootstrap_interval_of_identical_windows_is_the_point_and_undefined_is_none():
    same = {"reference": torch.full((8,), 0.8), "mapped": torch.full((8,), 0.75),
            "source": torch.full((8,), 0.7)}  # fmt: skip
    low, high = bootstrap_interval(same, "mapped", "source")
    assert low == pytest.approx(0.5) and high == pytest.approx(0.5)
    level = {**same, "source": same["reference"]}  # the target does not beat the source
    assert bootstrap_interval(level, "mapped", "source") is None


def test_shared_runs_give_the_same_report_and_refuse_other_windows(tiny_pair, text_dir):
    from sgl_kvmap.fitting.evaluate import EvalRuns

    source, target = tiny_pair
    ((mapper, _),) = fit_mapper(source, target, [text_dir / "calib"], CalibrationConfig(**SMALL))
    windows = eval_windows(target.tokenizer, expand_paths([text_dir / "eval"]), 80, 2)
    runs = EvalRuns(windows, 48, 32)
    first = evaluate(mapper, source, target, windows, 48, 32, tail=8, runs=runs)
    assert len(runs) == 4  # two models x two windows, each run once
    again = evaluate(mapper, source, target, windows, 48, 32, tail=8, runs=runs)
    fresh = evaluate(mapper, source, target, windows, 48, 32, tail=8)
    assert again.to_dict() == first.to_dict()
    assert fresh.reference == first.reference and fresh.mapped.nll == pytest.approx(
        first.mapped.nll
    )
    with pytest.raises(ValueError, match="other windows"):
        evaluate(mapper, source, target, windows, 40, 32, tail=8, runs=runs)
    runs.forget(0)  # what evaluate does with runs of its own after each window
    assert len(runs) == 2 and all(key[1] == 1 for key in runs._runs)


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


def test_layer_fidelity_is_counted_once_whatever_the_tail(tiny_pair, text_dir):
    source, target = tiny_pair
    ((mapper, _),) = fit_mapper(source, target, [text_dir / "calib"], CalibrationConfig(**SMALL))
    windows = eval_windows(target.tokenizer, expand_paths([text_dir / "eval"]), 80, 2)
    at_zero = evaluate(mapper, source, target, windows, 48, 32, tail=0)
    at_eight = evaluate(mapper, source, target, windows, 48, 32, tail=8)
    assert at_zero.attention_cosine == pytest.approx(at_eight.attention_cosine)
    assert at_zero.r2_k == pytest.approx(at_eight.r2_k)
    assert max(at_zero.attention_cosine) <= 1 + 1e-6
    assert at_zero.mapped_tail == at_zero.mapped


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


def test_stdlib_docs_are_the_reference_pages_written_once(tmp_path):
    from pydoc_data.topics import topics

    from sgl_kvmap.fitting.texts import default_eval_files, stdlib_docs_files

    files = stdlib_docs_files(tmp_path)
    assert len(files) == len(topics) > 50
    assert {f.stem: f.read_text(encoding="utf-8") for f in files} == topics
    stamp = files[0].stat().st_mtime_ns
    assert stdlib_docs_files(tmp_path) == files and files[0].stat().st_mtime_ns == stamp
    assert not list(tmp_path.glob("*.partial"))
    assert not set(files) & set(default_eval_files())  # calibration text, never evaluation


def test_code_corpus_is_the_stdlib_and_dependency_sources_never_evaluation_packages():
    import torch as torch_package

    from sgl_kvmap.fitting.texts import (
        EVAL_PACKAGES,
        code_corpus_files,
        default_eval_files,
        package_files,
        stdlib_files,
    )

    files = code_corpus_files()
    torch_root = Path(torch_package.__file__).parent
    assert set(stdlib_files()) < set(files)
    assert any(torch_root in f.parents for f in files)  # a dependency's own sources
    assert all(f.suffix == ".py" for f in files) and len(set(files)) == len(files)
    assert not set(files) & set(default_eval_files())
    assert set(package_files(EVAL_PACKAGES)) <= set(default_eval_files())
    assert package_files(["no_such_package_here"]) == []


def test_paired_difference_cancels_what_the_runs_share():
    """Windows differ far more than two runs on them do: pairing sees the runs' small, steady
    difference where an unpaired comparison would see noise."""
    generator = torch.Generator().manual_seed(2)
    before = torch.rand(64, generator=generator, dtype=torch.float64)  # spread ~0.29
    after = before + 0.02 + 0.005 * torch.randn(64, generator=generator, dtype=torch.float64)
    paired = paired_difference(before, after)
    assert paired["low"] < 0.02 < paired["high"] and 0 < paired["low"]
    assert paired["mean"] == pytest.approx((after - before).mean().item())
    assert paired["se"] < 0.001 < before.std().item() / 8  # unpaired SE of one run's mean
    assert paired_difference(after, before)["mean"] == pytest.approx(-paired["mean"])
    same = paired_difference(before, before)
    assert same == {"mean": 0.0, "se": 0.0, "low": 0.0, "high": 0.0}
    with pytest.raises(ValueError, match="one length"):
        paired_difference(before, after[:10])
