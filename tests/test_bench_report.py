"""The report of ``sgl-kvmap bench`` on hand-built records: summary numbers against hand
computation, the markdown, the four figures, and the records' JSON round trip."""

from __future__ import annotations

import json
import sys

import pytest

from sgl_kvmap.bench.records import Quality, RequestRecord, Scores
from sgl_kvmap.bench.report import (
    DASH,
    FIGURES,
    INSTALL_HINT,
    SUMMARY_FILE,
    summarize,
    summary_markdown,
    write_report,
)

HEADER = {
    "command": "sgl-kvmap bench --trace chat.jsonl --scale 0.1",
    "pair": "small -> large (Qwen2.5-Coder 0.5B -> 1.5B)",
    "trace": "chat.jsonl",
    "scale": 0.1,
    "requests": 4,
    "sessions": 1,
    "page_size": 16,
    "date": "2025-01-02",
    "machine": "1x H200",
}
PROMPTS = [50, 120, 220, 330]  # request 0 opens the session, 1..3 are swapped
IDEAL = [0, 100, 200, 300]


def record(policy, mode, request, *, swapped, ttft, computed, quality=None, **reused):
    tiers = {"device": 0, "host": 0, "storage": 0, "translated": 0, **reused}
    assert sum(tiers.values()) + computed == PROMPTS[request]
    return RequestRecord(
        policy=policy,
        mode=mode,
        request=request,
        session=0,
        turn=request,
        model="large" if request % 2 else "small",
        swapped=swapped,
        prompt_tokens=PROMPTS[request],
        ideal_reuse_tokens=IDEAL[request],
        reused=tiers,
        computed=computed,
        ttft_s=ttft,
        quality=quality,
    )


def quality(agreement, nll, reference_nll=1.0):
    return Quality(tokens=32, agreement=agreement, nll=nll, reference_nll=reference_nll)


def alternate(mode, swapped_rows):
    """Policy "alternate": request 0 unswapped (computed), requests 1..3 from ``swapped_rows``
    of (ttft, computed, {tier: tokens}, quality)."""
    first = record("alternate", mode, 0, swapped=False, ttft=0.05, computed=50)
    rows = [
        record("alternate", mode, index, swapped=True, ttft=ttft, computed=c, quality=q, **tiers)
        for index, (ttft, c, tiers, q) in enumerate(swapped_rows, start=1)
    ]
    return [first, *rows]


REPREFILL = alternate(
    "reprefill",
    [
        (0.10, 100, {"storage": 20}, None),
        (0.20, 200, {"storage": 20}, None),
        (0.30, 300, {"storage": 30}, None),
    ],
)
TRANSLATED = alternate(
    "translated",
    [
        (0.04, 20, {"translated": 100}, quality(1.0, 1.0)),
        (0.08, 40, {"translated": 180}, quality(0.5, 1.2)),
        (0.15, 30, {"translated": 300}, quality(0.75, 1.1)),
    ],
)
TAIL = alternate(
    "tail",
    [
        (0.05, 36, {"translated": 84}, quality(1.0, 1.0)),
        (0.10, 56, {"translated": 164}, quality(1.0, 1.0)),
        (0.14, 46, {"translated": 284}, quality(0.5, 1.3)),
    ],
)
STICKY = [
    record("sticky", "reprefill", 0, swapped=False, ttft=0.05, computed=50),
    record("sticky", "reprefill", 1, swapped=False, ttft=0.03, computed=70, device=50),
    record("sticky", "reprefill", 2, swapped=False, ttft=0.04, computed=100, device=120),
]
ONE_SWAP = [  # a policy replayed only translated: nothing to compare with
    record("swap-0.25", "translated", 0, swapped=False, ttft=0.05, computed=50),
    record(
        "swap-0.25",
        "translated",
        1,
        swapped=True,
        ttft=0.06,
        computed=20,
        translated=100,
        quality=quality(0.9, 1.4),
    ),
]
RECORDS = [*STICKY, *TAIL, *REPREFILL, *ONE_SWAP, *TRANSLATED]


@pytest.fixture(scope="module")
def rows():
    return {(row["policy"], row["mode"]): row for row in summarize(RECORDS)}


def test_rows_come_one_per_replay_in_report_order():
    keys = [(row["policy"], row["mode"]) for row in summarize(RECORDS)]
    assert keys == [
        ("sticky", "reprefill"),
        ("alternate", "reprefill"),
        ("alternate", "translated"),
        ("alternate", "tail"),
        ("swap-0.25", "translated"),
    ]


def test_swapped_token_counts(rows):
    row = rows["alternate", "translated"]
    assert (row["requests"], row["swapped"]) == (4, 3)
    assert row["swapped_tokens"] == {
        "prompt_tokens": 120 + 220 + 330,
        "ideal_reuse_tokens": 600,
        "reused": {"device": 0, "host": 0, "storage": 0, "translated": 580},
        "computed": 90,
    }
    assert row["all_tokens"]["computed"] == 140
    assert row["all_tokens"]["prompt_tokens"] == 720


def test_prefill_saved_against_the_policys_reprefill(rows):
    assert rows["alternate", "translated"]["prefill_saved"] == pytest.approx(1 - 90 / 600)
    assert rows["alternate", "tail"]["prefill_saved"] == pytest.approx(1 - 138 / 600)
    assert rows["alternate", "reprefill"]["prefill_saved"] == pytest.approx(0.0)


def test_ttft_ratio_is_the_ratio_of_medians(rows):
    translated = rows["alternate", "translated"]
    assert translated["ttft_median_s"] == pytest.approx(0.08)
    assert translated["ttft_mean_s"] == pytest.approx((0.04 + 0.08 + 0.15) / 3)
    assert translated["ttft_ratio"] == pytest.approx(0.08 / 0.20)
    assert rows["alternate", "tail"]["ttft_ratio"] == pytest.approx(0.10 / 0.20)
    assert rows["alternate", "reprefill"]["ttft_ratio"] == pytest.approx(1.0)


def test_ttft_ratio_pairs_the_same_requests():
    without_first_swap = [r for r in TRANSLATED if r.request != 1]
    (_, row) = summarize([*REPREFILL, *without_first_swap])
    assert row["paired_requests"] == 2
    assert row["ttft_ratio"] == pytest.approx(((0.08 + 0.15) / 2) / ((0.20 + 0.30) / 2))
    assert row["prefill_saved"] == pytest.approx(1 - 70 / 500)


def test_quality_means(rows):
    translated = rows["alternate", "translated"]
    assert translated["judged_requests"] == 3
    assert translated["agreement_mean"] == pytest.approx(0.75)
    assert translated["nll_mean"] == pytest.approx(1.1)
    assert translated["reference_nll_mean"] == pytest.approx(1.0)
    assert translated["nll_increase"] == pytest.approx(0.1)
    assert rows["alternate", "tail"]["agreement_mean"] == pytest.approx(2.5 / 3)
    assert rows["alternate", "reprefill"]["agreement_mean"] is None


def test_intervals_hold_the_estimate_and_are_reproducible(rows):
    translated = rows["alternate", "translated"]
    low, high = translated["agreement_ci"]
    assert 0.5 <= low <= 0.75 <= high <= 1.0 and low < high
    low, high = translated["ttft_ratio_ci"]
    assert 0.04 / 0.30 <= low <= 0.4 <= high <= 0.15 / 0.10
    again = {(row["policy"], row["mode"]): row for row in summarize(RECORDS)}
    assert again["alternate", "translated"]["ttft_ratio_ci"] == translated["ttft_ratio_ci"]


def test_nothing_swapped_or_nothing_to_compare_is_none(rows):
    sticky = rows["sticky", "reprefill"]
    assert sticky["swapped"] == 0
    assert sticky["swapped_tokens"] is None
    assert sticky["ttft_median_s"] is None and sticky["ttft_ratio"] is None
    assert sticky["prefill_saved"] is None
    assert sticky["all_tokens"]["reused"]["device"] == 170
    one_swap = rows["swap-0.25", "translated"]
    assert one_swap["swapped"] == 1 and one_swap["ttft_median_s"] == pytest.approx(0.06)
    assert one_swap["prefill_saved"] is None and one_swap["ttft_ratio"] is None
    assert one_swap["agreement_mean"] == pytest.approx(0.9) and one_swap["agreement_ci"] is None


def table_line(markdown: str, section: str, policy: str, mode_title: str) -> list[str]:
    body = markdown.split(f"## {section}")[1].split("\n## ")[0]
    for line in body.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if cells[:2] == [policy, mode_title]:
            return cells
    raise AssertionError(f"no row {policy}/{mode_title} in {section}:\n{body}")


def test_markdown_has_the_header_and_the_rows():
    markdown = summary_markdown(RECORDS, HEADER)
    assert f"`{HEADER['command']}`" in markdown
    for key, value in HEADER.items():
        assert f"**{key}**" in markdown and str(value) in markdown
    translated = table_line(markdown, "Swapped requests", "alternate", "translated")
    assert "85.0%" in translated and "80.0" in translated
    assert any(cell.startswith("0.40 [") for cell in translated)
    quality_row = table_line(markdown, "Agreement", "alternate", "translated")
    assert quality_row[2] == "3" and quality_row[3].startswith("0.75 [")
    assert quality_row[-1] == "+0.100"
    assert "bootstrap" in markdown


def test_markdown_says_dash_where_nothing_is_swapped():
    markdown = summary_markdown(RECORDS, HEADER)
    sticky = table_line(markdown, "Swapped requests", "sticky", "re-prefill (HiCache, no packs)")
    assert sticky[3] == "0"
    assert sticky[4:] == [DASH] * len(sticky[4:])
    assert "nan" not in markdown.lower()
    one_swap = table_line(markdown, "Swapped requests", "swap-0.25", "translated")
    assert one_swap[-4] == DASH and one_swap[-1] == DASH  # no re-prefill replay to compare with


def test_markdown_needs_the_whole_header():
    with pytest.raises(ValueError, match="scale"):
        summary_markdown(RECORDS, {k: v for k, v in HEADER.items() if k != "scale"})


def test_report_writes_the_summary_and_four_figures(tmp_path):
    pytest.importorskip("matplotlib")
    summary = write_report(RECORDS, HEADER, tmp_path / "report")
    assert summary == tmp_path / "report" / SUMMARY_FILE
    text = summary.read_text()
    assert text.startswith(summary_markdown(RECORDS, HEADER))
    for name in FIGURES:
        png = tmp_path / "report" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
        assert f"]({name})" in text
    assert sorted(p.name for p in summary.parent.iterdir()) == sorted([SUMMARY_FILE, *FIGURES])


def test_report_draws_a_run_without_swaps(tmp_path):
    pytest.importorskip("matplotlib")
    write_report(STICKY, HEADER, tmp_path)
    assert all((tmp_path / name).stat().st_size > 0 for name in FIGURES)


def test_report_without_matplotlib_says_how_to_get_the_figures(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    summary = write_report(RECORDS, HEADER, tmp_path)
    assert INSTALL_HINT in summary.read_text()
    assert [p.name for p in tmp_path.iterdir()] == [SUMMARY_FILE]


def test_records_round_trip_through_json():
    lines = [json.dumps(record.to_json()) for record in RECORDS]
    assert [RequestRecord.from_json(json.loads(line)) for line in lines] == RECORDS
    assert summarize([RequestRecord.from_json(json.loads(line)) for line in lines]) == summarize(
        RECORDS
    )


def test_a_rerun_replaces_only_an_earlier_runs_own_files(tmp_path, monkeypatch):
    """`bench --out` over an earlier run replaces it; anything else it finds there is the
    user's and refuses the run with the folder untouched. Before: a folder under one of the
    run's file names (here quality.png/) passed as the run's own and was deleted with what it
    held."""
    from sgl_kvmap.bench.run import RUN_FILE, save_run
    from sgl_kvmap.core.errors import KVMapError

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the summary alone is enough here
    out = tmp_path / "run"
    save_run(RECORDS, HEADER, out)
    save_run(STICKY, HEADER, out)  # an earlier run is replaced
    assert json.loads((out / RUN_FILE).read_text()) == HEADER
    figure = next(iter(FIGURES))
    mine = out / figure
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    with pytest.raises(KVMapError, match=f"did not write: \\['{figure}'\\]"):
        save_run(RECORDS, HEADER, out)
    assert (mine / "notes.txt").read_text() == "the user's"
    (mine / "notes.txt").unlink()
    mine.rmdir()
    (out / "notes.txt").write_text("the user's")
    with pytest.raises(KVMapError, match="notes.txt"):
        save_run(RECORDS, HEADER, out)
    other = tmp_path / "other"
    other.mkdir()
    (other / "data.csv").write_text("1,2")
    with pytest.raises(KVMapError, match="not a benchmark run's output"):
        save_run(RECORDS, HEADER, other)
    assert (other / "data.csv").read_text() == "1,2"


# ---- the true continuation, against the baselines


def judged(policy, mode, request, served, reference, source, no_prefix=0.1, translated=0):
    """A swapped request judged on a 32-token continuation: (accuracy, nll) per condition;
    ``translated`` of its prompt tokens came translated (the rest computed)."""
    baselines = {
        "reference": Scores(*reference),
        "source": Scores(*source),
        "no_prefix": Scores(no_prefix, 5.0),
    }
    scored = Quality(1, 1.0, 1.0, 1.0, 32, Scores(*served), baselines)
    computed = PROMPTS[request] - translated
    return record(
        policy, mode, request, swapped=True, ttft=0.1, computed=computed, quality=scored,
        translated=translated,
    )  # fmt: skip


# per request: served, reference, source as (accuracy, nll)
BEATS = [((0.6, 1.5), (0.7, 1.2), (0.4, 2.0)), ((0.5, 1.6), (0.6, 1.3), (0.3, 2.2))] * 2
WORSE = [((0.2, 2.5), (0.7, 1.2), (0.4, 2.0)), ((0.1, 2.9), (0.6, 1.3), (0.3, 2.2))] * 2


def scored_replay(policy, mode, rows, requests=(1, 3), translates=True):
    """Swapped requests judged on their continuation; requests 1 and 3 are served by the large
    model (up swaps), request 2 by the small one (a down swap). In a translating mode, half of
    each prompt came translated (none with ``translates`` False)."""
    return [
        judged(
            policy, mode, request := requests[i % len(requests)], *row,
            translated=PROMPTS[request] // 2 if mode != "reprefill" and translates else 0,
        )
        for i, row in enumerate(rows)
    ]  # fmt: skip


def test_figures_and_verdicts_are_judged_on_the_swaps_that_translated():
    """A translating replay's continuation figures pool only its swaps that translated
    something, the share is beside them, and a replay where none did says so instead of a
    verdict: its swaps scored as re-prefill, which says nothing of translation."""
    some = [
        *scored_replay("a", "translated", BEATS[:2]),
        *scored_replay("a", "translated", WORSE[:2], translates=False),
    ]
    (summary,) = summarize(some)
    up = summary["continuation"]["up"]
    assert up["swaps"] == 4 and up["translated_swaps"] == 2 and up["continuation_requests"] == 2
    assert up["retention"] == pytest.approx((0.6 + 0.5) / (0.7 + 0.6))
    none = scored_replay("b", "tail", WORSE, translates=False)
    markdown = summary_markdown([*some, *none], HEADER)
    assert "judged on the swaps that translated (2 of 8 swaps" in markdown
    line = table_line(markdown, "Swapped requests against", "b", "translated + tail")
    assert line[3] == "0 of 4" and line[-1] == "nothing translated"
    line = table_line(markdown, "Swapped requests against", "a", "translated")
    assert line[3] == "2 of 4"
    assert "**Verdict**: nothing translated (0 of 4 swaps" in summary_markdown(none, HEADER)
    # swaps that translated but were not judged on the continuation (as on live servers)
    unjudged = [
        record("c", "translated", 1, swapped=True, ttft=0.1, computed=60, translated=60,
               quality=quality(0.5, 1.1)),
        record("c", "translated", 2, swapped=True, ttft=0.1, computed=220,
               quality=quality(0.5, 1.1)),
    ]  # fmt: skip
    line = summary_markdown(unjudged, HEADER).split("**Verdict**")[1].splitlines()[0]
    assert "no translating replay has a gap to close judged" in line and "(1 of 2 swaps" in line


def test_retention_and_gap_closed_pool_accuracy_over_requests():
    (summary,) = summarize(scored_replay("p", "tail", BEATS))
    row = summary["continuation"]["up"]
    assert summary["continuation"]["down"]["continuation_requests"] == 0
    assert row["continuation_requests"] == 4 and row["continuation_tokens"] == 128
    assert row["continuation_accuracy"] == pytest.approx(
        {"served": 0.55, "reference": 0.65, "source": 0.35, "no_prefix": 0.1}
    )
    assert row["continuation_nll"]["served"] == pytest.approx(1.55)
    assert row["retention"] == pytest.approx(0.55 / 0.65)
    assert row["gap_closed"] == pytest.approx((0.55 - 0.35) / (0.65 - 0.35))
    low, high = row["gap_closed_ci"]
    assert 0 < low <= row["gap_closed"] <= high and row["verdict"] == "beats"


def test_the_verdict_reads_the_gap_closed_interval():
    rows = summarize([*scored_replay("a", "reprefill", BEATS), *scored_replay("a", "tail", WORSE)])
    worse = rows[1]["continuation"]["up"]
    assert worse["gap_closed"] < 0 and worse["gap_closed_ci"][1] < 0
    assert worse["verdict"] == "worse"
    markdown = summary_markdown(
        [*scored_replay("b", "translated", BEATS), *scored_replay("a", "tail", WORSE)], HEADER
    )
    assert "beats staying on the source model in 1 of 2 translating replays" in markdown
    assert "does worse in 1" in markdown
    line = table_line(markdown, "Swapped requests against", "a", "translated + tail")
    assert line[2] == "small -> large" and line[-1] == "worse than staying"


def test_swaps_are_judged_per_direction():
    """A down swap (large -> small) is judged apart from the up swaps of the same replay: the
    large source beats the small target's re-prefill, so there is no gap to close there."""
    down = [((0.4, 2.0), (0.5, 1.8), (0.7, 1.2))] * 3
    records = [*scored_replay("p", "tail", BEATS), *scored_replay("p", "tail", down, (2,))]
    (summary,) = summarize(records)
    up, down_stats = summary["continuation"]["up"], summary["continuation"]["down"]
    assert (up["continuation_requests"], down_stats["continuation_requests"]) == (4, 3)
    assert down_stats["retention"] == pytest.approx(0.8) and down_stats["verdict"] is None
    line = table_line(
        summary_markdown(records, HEADER), "Swapped requests against", "p", "translated + tail"
    )
    assert "beats staying" in line[-1]


def test_a_gap_undefined_where_the_reference_does_not_beat_staying():
    rows = [((0.5, 1.0), (0.4, 1.0), (0.4, 1.0))] * 3  # reference == source: no gap to close
    (summary,) = summarize(scored_replay("p", "tail", rows))
    row = summary["continuation"]["up"]
    assert row["gap_closed"] is None and row["gap_closed_ci"] is None and row["verdict"] is None


def test_scored_records_round_trip_through_json():
    records = scored_replay("p", "tail", BEATS)
    lines = [json.dumps(record.to_json()) for record in records]
    assert [RequestRecord.from_json(json.loads(line)) for line in lines] == records


def test_the_served_record_pools_the_swaps_that_translated_per_mode_and_direction():
    """``bench --record``'s figures: per translating mode, over the up swaps of every policy that
    translated something (a swap that translated nothing says nothing of the pack), the pooled
    retention and gap closed and the low end of the gap's interval, under the keys the engines'
    quality floor reads; a down swap has no gap to close, so only its retention is recorded."""
    from sgl_kvmap.bench.report import served_record
    from sgl_kvmap.sglang import StorageSettings

    tail = [
        judged("a", "tail", 1 + 2 * (i % 2), *row, translated=16) for i, row in enumerate(BEATS)
    ]
    nothing = [judged("b", "tail", 3, *WORSE[0])]  # translated nothing: left out
    translated = [judged("b", "translated", 1, *row, translated=16) for row in BEATS[:2]]
    down = [judged("a", "tail", 2, (0.4, 2.0), (0.5, 1.8), (0.7, 1.2), translated=16)] * 2
    up = served_record([*tail, *nothing, *translated, *down], "large")
    pooled = summarize(tail)[0]["continuation"]["up"]
    assert up["served_swaps_tail"] == 4 and up["served_swaps"] == 2
    assert up["served_retention_tail"] == pytest.approx(pooled["retention"])
    assert up["served_gap_closed_tail"] == pytest.approx(pooled["gap_closed"])
    assert up["served_gap_closed_tail_low"] == pooled["gap_closed_ci"][0] > 0
    assert "served_gap_closed_low" in up
    metrics = {**up, "served_tail": 48, "served_page_size": 16, "served_sinks": "native"}
    assert StorageSettings().recorded_gap_closed(metrics, 16) == (
        "served_gap_closed_tail_low",
        up["served_gap_closed_tail_low"],
    )
    assert served_record(down, "small") == {
        "served_swaps_tail": 2,
        "served_retention_tail": pytest.approx(0.8),
    }
    assert served_record(nothing, "large") == {}


def test_the_stages_of_translated_swaps_are_summarised_with_the_hand_over_ratio():
    """Over the swaps that translated (not the one prefilled whole): the median seconds of each
    stage, and the median of time to first token over primed + forward + map, per swap."""
    stages = [
        {"primed": 0.1, "prefetch": 0.3, "map": 0.1, "forward": 0.3, "load": 0.01},
        {"primed": 0.2, "prefetch": 0.5, "map": 0.2, "forward": 0.6, "load": 0.03},
    ]
    rows = [(1.0, 20, {"translated": 100}, None), (2.0, 20, {"translated": 200}, None)]
    rows.append((3.0, 330, {}, None))  # prefilled whole: not a translated swap
    replay = alternate("translated", rows)
    for row, timed in zip(replay[1:], stages):
        row.stages = timed
    replay[3].stages = {"primed": 0.0, "forward": 3.0}
    (row,) = [r for r in summarize([*REPREFILL, *replay]) if r["mode"] == "translated"]
    stats = row["stages"]
    assert stats["swaps"] == 2 and stats["ttft_median_s"] == pytest.approx(1.5)
    assert stats["median_s"]["prefetch"] == pytest.approx(0.4)
    assert stats["median_s"]["load"] == pytest.approx(0.02)
    assert stats["hand_over_ratio"] == pytest.approx((1.0 / 0.5 + 2.0 / 1.0) / 2)
    low, high = stats["hand_over_ratio_ci"]
    assert low == pytest.approx(2.0) and high == pytest.approx(2.0)
    text = summary_markdown([*REPREFILL, *replay], HEADER)
    section = text.split("## Where a translated swap's time goes")[1].split("\n## ")[0]
    assert "| alternate | translated | 2 | 1500.0 |" in section and "*map*:" in section
    assert "2.00 [2.00, 2.00]" in section


def test_live_swaps_without_a_timed_forward_have_stages_but_no_hand_over_ratio():
    rows = [(1.0, 20, {"translated": 100}, None), (2.0, 20, {"translated": 200}, None)]
    rows.append((3.0, 30, {"translated": 300}, None))
    replay = alternate("translated", rows)
    for row in replay[1:]:
        row.stages = {"primed": 0.2, "map": 0.1, "wait": 0.05}
    (row,) = [r for r in summarize([*REPREFILL, *replay]) if r["mode"] == "translated"]
    assert row["stages"]["hand_over_ratio"] is None and row["stages"]["swaps"] == 3
    assert row["stages"]["median_s"] == {"primed": 0.2, "map": 0.1, "wait": 0.05}
