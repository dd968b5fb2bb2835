"""Evaluation: every baseline as a direct run would score it, per-window scores, intervals."""

import pytest
import torch

from sgl_kvmap import CalibrationConfig, evaluate, fit_mapper
from sgl_kvmap.fitting.evaluate import RATIOS, bootstrap_interval, paired_difference
from sgl_kvmap.fitting.texts import eval_windows, expand_paths
from sgl_kvmap.models.capture import run
from sgl_kvmap.models.transfer import (
    Repair,
)

from .conftest import SMALL_CALIBRATION, tiny_model


@pytest.fixture(scope="module")
def text_mapper(tiny_pair, text_dir):
    """``tiny_pair``'s source -> target mapper fitted on the calibration text."""
    config = CalibrationConfig(**SMALL_CALIBRATION)
    ((mapper, _),) = fit_mapper(*tiny_pair, [text_dir / "calib"], config)
    return mapper


def test_self_map_evaluates_as_lossless(text_dir):
    """Mapping a model onto itself: the translated cache must behave like the true one."""
    model = tiny_model("llama3", seed=5)
    ((mapper, _),) = fit_mapper(
        model,
        model,
        [text_dir / "calib"],
        CalibrationConfig(**SMALL_CALIBRATION, top_k=1, ridge=1e-6, sink_tokens=0),
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


def test_evaluation_baselines_match_direct_runs(tiny_pair, text_mapper, text_dir):
    source, target = tiny_pair
    windows = eval_windows(target.tokenizer, expand_paths([text_dir / "eval"]), 80, 1)
    report = evaluate(text_mapper, source, target, windows, prefix_len=48, continuation=32, tail=8)
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


def test_per_window_scores_average_to_the_report(tiny_pair, text_mapper, text_dir):
    source, target = tiny_pair
    windows = eval_windows(target.tokenizer, expand_paths([text_dir / "eval"]), 80, 3)
    report = evaluate(text_mapper, source, target, windows, prefix_len=48, continuation=32, tail=8)
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
    same = {
        "reference": torch.full((8,), 0.8),
        "mapped": torch.full((8,), 0.75),
        "source": torch.full((8,), 0.7),
    }
    low, high = bootstrap_interval(same, "mapped", "source")
    assert low == pytest.approx(0.5) and high == pytest.approx(0.5)
    level = {**same, "source": same["reference"]}  # the target does not beat the source
    assert bootstrap_interval(level, "mapped", "source") is None


def test_shared_runs_give_the_same_report_and_refuse_other_windows(
    tiny_pair, text_mapper, text_dir
):
    from sgl_kvmap.fitting.evaluate import EvalRuns

    source, target = tiny_pair
    windows = eval_windows(target.tokenizer, expand_paths([text_dir / "eval"]), 80, 2)
    runs = EvalRuns(windows, 48, 32)
    first = evaluate(text_mapper, source, target, windows, 48, 32, tail=8, runs=runs)
    assert len(runs) == 4  # two models x two windows, each run once
    again = evaluate(text_mapper, source, target, windows, 48, 32, tail=8, runs=runs)
    fresh = evaluate(text_mapper, source, target, windows, 48, 32, tail=8)
    assert again.to_dict() == first.to_dict()
    assert fresh.reference == first.reference and fresh.mapped.nll == pytest.approx(
        first.mapped.nll
    )
    with pytest.raises(ValueError, match="other windows"):
        evaluate(text_mapper, source, target, windows, 40, 32, tail=8, runs=runs)
    runs.forget(0)  # what evaluate does with runs of its own after each window
    assert len(runs) == 2 and all(key[1] == 1 for key in runs._runs)


def test_layer_fidelity_is_counted_once_whatever_the_tail(tiny_pair, text_mapper, text_dir):
    source, target = tiny_pair
    windows = eval_windows(target.tokenizer, expand_paths([text_dir / "eval"]), 80, 2)
    at_zero = evaluate(text_mapper, source, target, windows, 48, 32, tail=0)
    at_eight = evaluate(text_mapper, source, target, windows, 48, 32, tail=8)
    assert at_zero.attention_cosine == pytest.approx(at_eight.attention_cosine)
    assert at_zero.r2_k == pytest.approx(at_eight.r2_k)
    assert max(at_zero.attention_cosine) <= 1 + 1e-6
    assert at_zero.mapped_tail == at_zero.mapped


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


def test_evaluated_repair_spans_mapped_tail_to_the_target_itself(tiny_pair, tiny_mapper, text_dir):
    """No anchors: the repaired hand-off is the tail hand-off. Every translated token an anchor:
    the target has recomputed the whole prompt, so it scores as on its own cache."""
    source, target = tiny_pair
    windows = eval_windows(target.tokenizer, expand_paths([text_dir / "eval"]), 80, 2)

    def report(anchors):
        return evaluate(
            tiny_mapper, source, target, windows, 64, 16, tail=4, repair=Repair(anchors, draft=2)
        )

    none, every = report(0), report(10_000)
    assert none.repaired == none.mapped_tail
    assert every.repaired.accuracy == every.reference.accuracy
    assert every.repaired.nll == pytest.approx(every.reference.nll, rel=1e-4)
    assert every.mapped.nll != pytest.approx(every.reference.nll, rel=1e-4)
    assert every.summary()["eval_repaired_nll"] == every.repaired.nll
    assert "2-token source draft" in every.table()


def test_an_overflowing_map_is_reported_as_broken_not_scored_nan(tiny_pair, text_mapper, text_dir):
    """Before: a map whose translation overflowed (here a 3e38 bias, finite in float32) gave NaN
    scores that `eval` printed as ``nan``; now the evaluation stops naming the conditions."""
    from sgl_kvmap.core.errors import KVMapError

    source, target = tiny_pair
    from dataclasses import replace

    from sgl_kvmap.core.fit import LayerMap

    overflowing = [LayerMap(m.weight, torch.full_like(m.bias, 3e38)) for m in text_mapper.maps["k"]]
    broken = replace(text_mapper, maps={**text_mapper.maps, "k": overflowing})
    windows = eval_windows(target.tokenizer, expand_paths([text_dir / "eval"]), 80, 1)
    with pytest.raises(KVMapError, match="mapped.* is not finite"):
        evaluate(broken, source, target, windows, prefix_len=48, continuation=32, tail=8)


def test_evaluated_recent_anchors_score_as_a_longer_tail(tiny_pair, tiny_mapper, text_dir):
    """The "recent" choice recomputes the tokens just before the tail: its repaired hand-off
    scores as the tail hand-off with that many more tail tokens, window by window."""
    source, target = tiny_pair
    windows = eval_windows(target.tokenizer, expand_paths([text_dir / "eval"]), 80, 2)
    recent = evaluate(
        tiny_mapper, source, target, windows, 64, 16, tail=4, repair=Repair(8, choice="recent")
    )
    longer = evaluate(tiny_mapper, source, target, windows, 64, 16, tail=12)
    assert [w["repaired"] for w in recent.by_window] == [w["mapped_tail"] for w in longer.by_window]
    assert "8 anchors by recency" in recent.table()


def test_the_hand_off_as_served_computes_its_first_page_and_tail(tiny_pair, text_mapper, text_dir):
    """The served hand-off (``served``: page size, tail pages) translates whole pages after a
    first page the target computes, layer 0 mapped, and computes the rest: with a tail that
    leaves only the first page translated it scores as the target's own cache, window by
    window; with 8-token pages and a 1-page tail its first page is computed, 4 pages translated
    with the pack's layer 0 and the rest computed, which scores apart from the library's
    translated cache (4 sink tokens, 47 tokens translated with the target's own layer 0)."""
    source, target = tiny_pair
    windows = eval_windows(target.tokenizer, expand_paths([text_dir / "eval"]), 80, 2)
    whole = evaluate(text_mapper, source, target, windows, 48, 32, tail=8, served=(8, 8))
    assert [w["served"] for w in whole.by_window] == [w["reference"] for w in whole.by_window]
    assert whole.summary()["eval_served_page_size"] == 8
    assert whole.summary()["eval_served_tail"] == 64
    assert "target, as served (8-token pages, 64-token tail)" in whole.table()
    served = evaluate(text_mapper, source, target, windows, 48, 32, tail=0, served=(8, 1))
    assert served.served.nll != served.mapped.nll
    assert served.summary()["eval_served_nll"] == served.served.nll
    off = evaluate(text_mapper, source, target, windows, 48, 32, tail=8, served=None)
    assert off.served is None and "eval_served_page_size" not in off.summary()
