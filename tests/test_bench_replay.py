"""`sgl-kvmap bench`'s replays on tiny models: two engines built from SGLang 0.5.23's own cache
classes (sgl_kvmap/sglang/engine.py, whose CPU substitutions are listed there) share a file store
through KVMapStorage, and a hand-made Mooncake-shaped trace is routed across them.

Substituted: the models are tiny random transformers with a character tokenizer (the real pair
runs in tests/test_realpair.py and benchmarks/results/bench_*); the held-out text is this
repository's own sources.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from sgl_kvmap.bench.records import MODES, TIERS
from sgl_kvmap.bench.replay import Deployment, ReplayPlan, fresh_scores, replay
from sgl_kvmap.bench.routing import parse_policy, swapped
from sgl_kvmap.bench.run import BenchConfig, plan, run_bench
from sgl_kvmap.bench.workload import (
    WorkloadConfig,
    ideal_reuse,
    load_workload,
    shared_opening,
)
from sgl_kvmap.core.cache import KVCache
from sgl_kvmap.core.mapper import KVMapper
from sgl_kvmap.kernels import fast_matmul_dtype
from sgl_kvmap.sglang.launch import PrefetchDeadline

PAGE = 8
# what the scenarios below check is what each replay reuses and translates, not when: their
# prompts are a few 8-token pages (below SGLang's 256-token prefetch threshold) and SGLang waits
# for every prefetch (on a loaded test machine a 1 s deadline would decide instead)
UNTIMED = {"prefetch_threshold": PAGE, "deadline": PrefetchDeadline("wait_complete")}
TEXT = sorted((Path(__file__).parent.parent / "sgl_kvmap").rglob("*.py"))

# Four sessions of 2-3 turns; every session opens with block 0 (the trace's shared system
# prompt) and each later turn extends its previous prompt, as in the Mooncake trace.
TRACE = [
    (0, 96, [0, 1, 2]),
    (10, 80, [0, 3, 4]),
    (20, 150, [0, 1, 2, 5, 6]),
    (30, 140, [0, 3, 4, 7, 8]),
    (40, 120, [0, 9, 10, 11]),
    (50, 210, [0, 1, 2, 5, 6, 12, 13]),
    (60, 90, [0, 14, 15]),
    (70, 170, [0, 9, 10, 11, 16, 17]),
    (80, 150, [0, 14, 15, 18, 19]),
]


@pytest.fixture(scope="module")
def deployment(served_pair) -> Deployment:
    """ "small" (3 layers x 2 KV heads x 16) and "large" (4 layers x 1 KV head x 32) with a pack
    each way, served under their folders' names."""
    roles = ("small", "large")
    packs = {(roles[s], roles[t]): pack for (s, t), pack in served_pair["packs"].items()}
    return Deployment(
        dict(zip(roles, served_pair["models"])), dict(zip(roles, served_pair["names"])), packs
    )


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    trace = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    rows = [
        {"timestamp": t, "input_length": n * 16, "output_length": 64, "hash_ids": ids}
        for t, n, ids in TRACE
    ]
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return trace


@pytest.fixture(scope="module")
def turns(deployment, trace):
    config = WorkloadConfig(
        str(trace), scale=16, sessions=4, max_prompt_tokens=None, page_size=PAGE
    )
    return load_workload(config, deployment.models["small"].tokenizer, text_files=TEXT)


@pytest.fixture(scope="module")
def records(deployment, turns):
    """Every mode of an alternating and a sticky routing on engines that start empty (no warm
    opening; the levers test below compares with it) and may translate a prefix's first page
    (``sinks: translate``: so a fresh engine's swaps translate), the tail mode recomputing one
    page."""
    config = BenchConfig(
        WorkloadConfig(scale=16, page_size=PAGE),
        policies=("sticky", "alternate"),
        quality_tokens=4,
        tail_pages=1,
        warm_opening=False,
        sinks="translate",
        **UNTIMED,
    )
    return run_bench(deployment, turns, config)


def of(records, policy, mode):
    return [r for r in records if r.policy == policy and r.mode == mode]


def test_the_trace_makes_sessions_that_share_prefixes(turns):
    assert [t.session for t in turns] == [0, 1, 0, 1, 2, 0, 3, 2, 3]
    assert [t.turn for t in turns] == [0, 0, 1, 1, 0, 2, 0, 1, 1]


def test_per_tier_counts_add_up_to_the_prompt(records):
    assert {(r.policy, r.mode) for r in records} == {("sticky", "reprefill")} | {
        ("alternate", m) for m in MODES
    }
    for r in records:
        assert sum(r.reused[t] for t in TIERS) + r.computed == r.prompt_tokens
        assert min(r.reused.values()) >= 0 and r.computed >= 1
        assert r.ttft_s > 0


def test_sticky_routing_swaps_and_translates_nothing(records):
    sticky = of(records, "sticky", "reprefill")
    assert not any(r.swapped for r in sticky) and {r.model for r in sticky} == {"small"}
    assert all(r.reused["translated"] == 0 and r.quality is None for r in sticky)
    # one model serving everything reuses, from its device cache, all an oracle could
    assert [r.reused["device"] for r in sticky] == [r.ideal_reuse_tokens for r in sticky]


def test_reprefill_translates_nothing_and_the_translating_modes_save_prefill(records):
    reprefill = of(records, "alternate", "reprefill")
    assert all(r.reused["translated"] == 0 for r in reprefill)
    for mode in ("translated", "tail"):
        served = of(records, "alternate", mode)
        swaps = [r for r in served if r.swapped]
        # a model's pages computed over translated KV are never stored for translation back,
        # so a swap back to the first model finds only its own pages: not every swap translates
        assert sum(r.reused["translated"] > 0 for r in swaps) >= 4
        assert sum(r.computed for r in swaps) < sum(r.computed for r in reprefill if r.swapped)
        assert all(r.quality is not None and 0 <= r.quality.agreement <= 1 for r in swaps)
    # the tail recomputes the last page of every translated run
    for t, f in zip(of(records, "alternate", "tail"), of(records, "alternate", "translated")):
        if t.swapped and f.reused["translated"]:
            assert t.reused["translated"] == f.reused["translated"] - PAGE


def test_swaps_are_scored_on_the_true_continuation_beside_the_baselines(deployment, turns, records):
    """Every swapped request carries its scores on its turn's continuation under the cache that
    served it, and the same baselines in every mode: the reprefill replay's own scores
    (reference), the source model computing the prompt (staying) and the target computing the
    turn's new tokens alone, each equal to a fresh forward of that model."""
    by_mode = {mode: of(records, "alternate", mode) for mode in MODES}
    for records_of_request in zip(*by_mode.values()):
        reference = records_of_request[0]
        if not reference.swapped:
            assert all(r.quality is None for r in records_of_request)
            continue
        turn = turns[reference.request]
        baselines = reference.quality.baselines
        assert reference.quality.continuation == baselines["reference"]
        for record in records_of_request:
            assert record.quality.continuation_tokens == len(turn.continuation) == 32
            assert record.quality.baselines == baselines
            assert 0 <= record.quality.continuation.accuracy <= 1
        target = deployment.models[reference.model].model
        source = deployment.models[deployment.other(reference.model)].model
        new = turn.tokens[-turn.new_tokens :]
        assert baselines["source"] == fresh_scores(source, turn.tokens, turn.continuation)
        assert baselines["no_prefix"] == fresh_scores(target, new, turn.continuation)
        own = fresh_scores(target, turn.tokens, turn.continuation)
        assert baselines["reference"].nll == pytest.approx(own.nll, abs=1e-3)


def test_the_levers_a_warm_opening_and_a_longer_tail(deployment, turns, records):
    """``warm_opening``: every engine serves the shared opening (the trace's block 0, 4 pages)
    before the replay, so a swap finds it on its own device and translates only what
    follows; ``tail_pages`` 2: the tail mode recomputes two pages of every translated run."""
    opening = shared_opening(turns, PAGE)
    assert len(opening) == 32 and all(t.tokens[:32] == opening for t in turns)  # block 0
    config = BenchConfig(
        WorkloadConfig(scale=16, page_size=PAGE),
        policies=("alternate",),
        quality_tokens=2,
        tail_pages=2,
        warm_opening=True,
        **UNTIMED,
    )
    levers = run_bench(deployment, turns, config)
    cold = {(r.mode, r.request): r for r in of(records, "alternate", "translated")}
    for record in levers:
        if record.mode == "translated" and record.swapped:
            before = cold["translated", record.request]
            assert record.reused["translated"] <= before.reused["translated"]
            assert record.reused["device"] + record.reused["host"] >= len(opening)
    warm = {r.request: r for r in levers if r.mode == "translated"}
    for record in levers:
        if record.mode == "tail" and record.swapped and warm[record.request].reused["translated"]:
            tail = warm[record.request].reused["translated"] - record.reused["translated"]
            assert tail == min(2 * PAGE, warm[record.request].reused["translated"])


def test_reuse_never_exceeds_what_an_oracle_could_reuse(records):
    for r in records:
        assert r.prompt_tokens - r.computed <= r.ideal_reuse_tokens


def test_every_translated_request_holds_the_reference_translation(deployment, turns):
    """Tokens a swapped request got by translation hold exactly the pack's map of what the
    sending engine computed for them (read from its device pool, where its tree holds them) at
    their true positions, as the translation runs (bfloat16 pools, products in the CPU's fast
    dtype). Engines that start empty and may translate a prefix's first page."""
    config = BenchConfig(
        WorkloadConfig(scale=16, page_size=PAGE), policies=("alternate",), quality_tokens=2
    )
    ((replay_plan, _),) = plan(turns, config)
    replay(deployment, replay_plan, "reprefill", quality_tokens=2, page_size=PAGE, **UNTIMED)
    checked = []

    def check(engines, i, slots, record):
        n = record.reused["translated"]
        if not n:
            return
        start = record.prompt_tokens - record.computed - n
        receiver = replay_plan.models[i]
        sender = deployment.other(receiver)
        tokens = list(turns[i].tokens[: start + n])
        stored = engines[sender].cached_slots(tokens)
        assert len(stored) == start + n  # the sender holds every translated token
        held = engines[sender].pool_kv(stored[start:])
        sent = KVCache(held.keys, held.values, torch.arange(start, start + n))
        mapper = KVMapper.from_pretrained(deployment.packs[sender, receiver])
        want = mapper.map(sent, fast_matmul_dtype("cpu"))
        got = engines[receiver].pool_kv(slots[start : start + n])
        for g, w in zip(got.keys + got.values, want.keys + want.values):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        moved = mapper.map(dataclasses.replace(sent, positions=sent.positions + PAGE))
        assert not torch.equal(moved.keys[0], want.keys[0])  # so the position was checked
        checked.append(i)

    replay(
        deployment,
        replay_plan,
        "translated",
        quality_tokens=2,
        page_size=PAGE,
        **UNTIMED,
        overrides={"sinks": "translate"},
        inspect=check,
    )
    assert len(checked) >= 3 and all(replay_plan.swapped[i] for i in checked)


def test_a_request_that_falls_back_computes_what_reprefill_computes(deployment, turns):
    """With ``sinks: native`` a swap into an engine without its own copy of the prefix's first
    page is not translated (fallback ``no_native_sink_page``): it must compute exactly what the
    same request computes under re-prefill."""
    config = BenchConfig(
        WorkloadConfig(scale=16, page_size=PAGE), policies=("alternate",), quality_tokens=2
    )
    ((replay_plan, _),) = plan(turns, config)
    reference = replay(
        deployment, replay_plan, "reprefill", quality_tokens=2, page_size=PAGE, **UNTIMED
    )
    served = replay(
        deployment,
        replay_plan,
        "translated",
        quality_tokens=2,
        page_size=PAGE,
        **UNTIMED,
        overrides={"sinks": "native"},
    )
    fell_back = [
        (r, ref) for r, ref in zip(served, reference) if r.fallbacks.get("no_native_sink_page")
    ]
    assert fell_back
    for r, ref in fell_back:
        assert r.reused["translated"] == 0
        assert r.computed == ref.computed and r.reused == ref.reused


def test_translating_modes_need_the_reference_replay_first(deployment, turns):
    models = parse_policy("alternate").route(turns)
    fresh = ReplayPlan("alternate", turns, models, swapped(turns, models), ideal_reuse(turns, PAGE))
    with pytest.raises(Exception, match="reprefill"):
        replay(deployment, fresh, "translated", page_size=PAGE, **UNTIMED)


def test_the_command_writes_records_summary_and_plots_and_keeps_foreign_folders(
    deployment, trace, tmp_path, monkeypatch
):
    """`sgl-kvmap bench` through click, as a user runs it, on the tiny pair and the hand-made
    trace (held-out text: the default files, as for the real pair)."""
    from click.testing import CliRunner

    from sgl_kvmap.cli import main

    args = [
        "bench",
        *("--small", deployment.names["small"], "--large", deployment.names["large"]),
        *("--pack-up", deployment.packs["small", "large"]),
        *("--pack-down", deployment.packs["large", "small"]),
        *("--trace", str(trace), "--scale", "8", "--sessions", "4", "--quality-tokens", "2"),
        *("--policy", "sticky", "--policy", "alternate", "--mode", "translated"),
    ]
    out = tmp_path / "run"
    result = CliRunner().invoke(main, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    lines = (out / "records.jsonl").read_text().splitlines()
    assert len(lines) == 9 * 3  # sticky once; alternate in reprefill and translated
    assert {json.loads(line)["mode"] for line in lines} == {"reprefill", "translated"}
    run = json.loads((out / "run.json").read_text())
    assert run["command"].startswith("sgl-kvmap bench --small ")
    assert "1/8" in run["scale"] and run["trace"] == trace.name and "pack_01" in run["packs"]
    assert all((out / name).stat().st_size > 0 for name in ("summary.md", "ttft_cdf.png"))
    assert "alternate" in result.output and "sticky" in result.output
    small_pages = ["--page-size", "16", "--prefetch-threshold", "16"]
    again = CliRunner().invoke(main, [*args, *small_pages, "--out", str(out), "--json"])
    assert again.exit_code == 0, again.output
    assert {row["policy"] for row in json.loads(again.stdout)} == {"sticky", "alternate"}
    config = json.loads((out / "run.json").read_text())["config"]
    assert config["workload"]["page_size"] == 16 and config["prefetch_threshold"] == 16
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert all(sum(r["reused"].values()) % 16 == 0 for r in records)
    assert any(sum(r["reused"].values()) % 64 for r in records)  # reuse at 16-token pages

    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    refused = CliRunner().invoke(main, [*args, "--out", str(foreign)])
    assert refused.exit_code == 1 and "not a benchmark run's output" in refused.stderr
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_the_command_records_the_served_figures_in_the_packs(deployment, trace, tmp_path):
    """`sgl-kvmap bench --record` through click, at the serving defaults (warm opening, sinks
    prime, the 3-page tail) on copies of the tiny packs: each pack's metrics then hold the
    retention and gap closed of the swaps it translated in each translating mode, computed here
    from records.jsonl, with the page size, sinks policy and tail they were served with, and an
    engine serving as the run served reads them for its quality floor. A pack downloaded into
    the Hugging Face cache is refused before any work."""
    import shutil

    from click.testing import CliRunner

    from sgl_kvmap.cli import main
    from sgl_kvmap.core.mapper import KVMapper
    from sgl_kvmap.sglang import StorageSettings

    packs = {
        pair: Path(shutil.copytree(folder, tmp_path / f"pack-{pair[1]}"))
        for pair, folder in deployment.packs.items()
    }
    args = [
        "bench",
        *("--small", deployment.names["small"], "--large", deployment.names["large"]),
        *("--pack-up", str(packs["small", "large"]), "--pack-down", str(packs["large", "small"])),
        *("--trace", str(trace), "--scale", "8", "--sessions", "4", "--quality-tokens", "2"),
        *("--policy", "alternate", "--mode", "translated", "--mode", "tail"),
    ]
    out = tmp_path / "run"
    result = CliRunner().invoke(main, [*args, "--out", str(out), "--record"])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    recorded = 0
    for (_, receiver), pack in packs.items():
        metrics = KVMapper.from_pretrained(pack).info["metrics"]
        for mode, suffix in (("tail", "_tail"), ("translated", "")):
            swaps = [
                r["quality"]
                for r in records
                if r["mode"] == mode and r["model"] == receiver and r["reused"]["translated"]
            ]
            if not swaps:
                assert f"served_swaps{suffix}" not in metrics
                continue
            served = sum(q["continuation"]["accuracy"] for q in swaps)
            reference = sum(q["baselines"]["reference"]["accuracy"] for q in swaps)
            assert metrics[f"served_swaps{suffix}"] == len(swaps)
            assert metrics[f"served_retention{suffix}"] == pytest.approx(served / reference)
            recorded += 1
        if any(key.startswith("served_") for key in metrics):
            assert metrics["served_page_size"] == 16 and metrics["served_sinks"] == "prime"
            assert metrics["served_first_layer"] == "mapped"
            assert metrics["served_derived"] == "withhold"
            assert metrics["served_command"].startswith("sgl-kvmap bench ")
            assert f"recorded in {pack}" in result.stderr
        if "served_swaps_tail" in metrics:
            assert metrics["served_tail"] == StorageSettings.tail_pages * 16
        gaps = {key for key in metrics if key.startswith("served_gap_closed")}
        assert gaps <= {f"served_gap_closed{s}{low}" for s in ("", "_tail") for low in ("", "_low")}
        if "served_gap_closed_tail" in metrics and metrics["served_swaps_tail"] >= 2:
            assert StorageSettings().recorded_gap_closed(metrics, 16) == (
                "served_gap_closed_tail_low",
                metrics["served_gap_closed_tail_low"],
            )
    assert recorded >= 2  # both modes translated swaps at the defaults
    snapshot = Path(shutil.copytree(packs["small", "large"], tmp_path / "snapshots" / ("0" * 40)))
    refused = CliRunner().invoke(
        main, [*args, "--pack-up", str(snapshot), "--out", str(tmp_path / "no"), "--record"]
    )
    assert refused.exit_code == 2 and "--record" in refused.output
    assert not (tmp_path / "no").exists()


def test_a_small_device_pool_evicts_and_reuse_comes_back_from_the_host_pool(deployment, turns):
    """With room for a few pages on the device, SGLang evicts (write-through kept a host copy):
    later turns reuse their history from the host tier and the tiers still add up."""
    config = BenchConfig(WorkloadConfig(scale=16, page_size=PAGE), policies=("sticky",))
    ((replay_plan, _),) = plan(turns, config)
    small = replay(
        deployment, replay_plan, "reprefill", page_size=PAGE, **UNTIMED, device_tokens=256
    )
    large = replay(
        deployment, replay_plan, "reprefill", page_size=PAGE, **UNTIMED, device_tokens=8192
    )
    assert sum(r.reused["host"] + r.reused["storage"] for r in small) > 0
    for s, g in zip(small, large):
        assert sum(s.reused.values()) + s.computed == s.prompt_tokens
        assert s.prompt_tokens - s.computed == g.prompt_tokens - g.computed  # nothing lost


def test_teacher_forced_agreement_is_greedy_decodings_common_prefix(deployment):
    """The replay judges a mode with one teacher-forced forward over the reference answer; its
    agreement must equal that of the mode's own greedy answer, for caches that keep all, some
    or none of the reference."""
    from sgl_kvmap.bench.records import agreement
    from sgl_kvmap.bench.replay import greedy_answer, teacher_forced
    from sgl_kvmap.models.capture import run

    model = deployment.models["large"].model
    out = run(model, torch.arange(3, 60), logits_to_keep=1)
    last = out.logits[-1]
    reference = greedy_answer(model, out.cache, last, 12)
    generator = torch.Generator().manual_seed(0)
    seen = []
    for noise in (0.0, 0.3, 1.0, 3.0, 10.0):
        noised = KVCache(
            [k + noise * torch.randn(k.shape, generator=generator) for k in out.cache.keys],
            [v + noise * torch.randn(v.shape, generator=generator) for v in out.cache.values],
            out.cache.positions,
        )
        greedy = greedy_answer(model, noised, last, 12)
        _, predicted = teacher_forced(model, noised, last, reference)
        seen.append(agreement(greedy, reference, 12))
        assert agreement(predicted, reference, 12) == seen[-1]
    assert seen[0] == 1.0 and min(seen) < 1.0


def test_every_request_records_where_its_time_went(records):
    """In process every request records its stages (``records.STAGES``); a swap that translated
    spent time in the store's read, map and transfer stages, each within its time to first token,
    and the stages on the request's own path (priming, prefetch, load, forward) add up to no
    more than it."""
    from sgl_kvmap.bench.records import STAGES

    for record in records:
        assert set(record.stages) <= set(STAGES) and record.stages["forward"] > 0
        assert all(seconds >= 0 for seconds in record.stages.values())
        path = sum(record.stages[s] for s in ("primed", "prefetch", "load", "forward"))
        assert path <= record.ttft_s
    translated = [r for r in records if r.reused["translated"]]
    assert translated
    for record in translated:
        assert all(record.stages[s] > 0 for s in ("hit_query", "read", "map", "write"))
        assert max(record.stages[s] for s in ("read", "map", "write")) < record.ttft_s
