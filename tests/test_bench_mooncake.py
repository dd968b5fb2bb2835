"""`sgl-kvmap bench --store mooncake` on the tiny pair: each replay starts a real
``mooncake_master`` on free ports of 127.0.0.1 (sgl_kvmap.sglang.mooncake_master) and both
in-process engines store and read their pages and records through Mooncake clients of their own
over TCP. Device pools too small for the trace push reuse down to the storage tier, where the
file store and Mooncake must serve the same tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sgl_kvmap.bench.replay import replay
from sgl_kvmap.bench.run import BenchConfig, plan
from sgl_kvmap.bench.workload import WorkloadConfig, load_workload
from sgl_kvmap.sglang.mooncake_master import unavailable

from .test_bench_replay import PAGE, TEXT, UNTIMED, deployment  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
# Eight sessions of three turns (3, 5 and 7 blocks of 32 tokens at scale 16, block 0 shared),
# every session's turn k before any turn k + 1: between two turns of a session each engine
# serves more than its host pool holds.
SESSIONS, TURNS, SCALE = 8, 3, 16
SMALL_POOL = 32 * PAGE  # device tokens, above the longest prompt (224); the host pool twice that


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    rows = []
    for turn in range(TURNS):
        for session in range(SESSIONS):
            ids = [0, *range(100 * session + 1, 100 * session + 3 + 2 * turn)]
            rows.append(
                {
                    "timestamp": 1000 * turn + 10 * session,
                    "input_length": 512 * len(ids),
                    "output_length": 64,
                    "hash_ids": ids,
                }
            )
    trace = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return trace


@pytest.fixture(scope="module")
def turns(deployment, trace):  # noqa: F811
    config = WorkloadConfig(
        str(trace), scale=SCALE, sessions=SESSIONS, max_prompt_tokens=None, page_size=PAGE
    )
    return load_workload(config, deployment.models["small"].tokenizer, text_files=TEXT)


def test_mooncake_replays_reuse_the_same_tokens_per_tier_as_the_file_store(deployment, turns):  # noqa: F811
    """Re-prefill and translated replays of an alternating routing over each store, with device
    pools the trace overflows: storage serves pages in both (the tier the default pools never
    reach), translation happens, and every request reuses the same tokens from every tier.
    Engines that start empty and may translate a prefix's first page."""
    config = BenchConfig(WorkloadConfig(scale=SCALE, page_size=PAGE), policies=("alternate",))
    ((replay_plan, _),) = plan(turns, config)
    served = {}
    for store in ("file", "mooncake"):
        replay_plan.references.clear()
        served[store] = [
            replay(
                deployment,
                replay_plan,
                mode,
                quality_tokens=2,
                page_size=PAGE,
                device_tokens=SMALL_POOL,
                store=store,
                **UNTIMED,
                overrides={"sinks": "translate"},
            )
            for mode in ("reprefill", "translated")
        ]
    for file_run, mooncake_run in zip(served["file"], served["mooncake"]):
        assert [r.reused for r in mooncake_run] == [r.reused for r in file_run]
        assert [r.fallbacks for r in mooncake_run] == [r.fallbacks for r in file_run]
    reprefill, translated = served["mooncake"]
    assert sum(r.reused["storage"] for r in reprefill) > 0
    assert sum(r.reused["translated"] for r in translated) > 0


def test_the_command_replays_over_mooncake_and_says_so(deployment, trace, tmp_path):  # noqa: F811
    from click.testing import CliRunner

    from sgl_kvmap.cli import main

    out = tmp_path / "run"
    args = [
        "bench",
        *("--small", deployment.names["small"], "--large", deployment.names["large"]),
        *("--pack-up", deployment.packs["small", "large"]),
        *("--pack-down", deployment.packs["large", "small"]),
        *("--trace", str(trace), "--scale", "8", "--sessions", "2"),
        "--quality-tokens",
        "1",
        *("--policy", "sticky", "--store", "mooncake", "--out", str(out)),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    run = json.loads((out / "run.json").read_text())
    assert run["store"].startswith("mooncake") and run["config"]["store"] == "mooncake"
