"""KVMapStorage in real ``sglang.launch_server`` processes over a real Mooncake store (issue 32).

A ``mooncake_master`` with its HTTP metadata server runs on free ports of 127.0.0.1
(sgl_kvmap.sglang.mooncake_master's ``Master``), and the two engines of tests/test_sglang_live.py
(the tiny pair, both packs) run from the lines ``sgl-kvmap sglang-args --store mooncake
--mooncake-master 127.0.0.1:PORT --mooncake-metadata URL ...`` prints, each a real server with
its own Mooncake client over TCP, as on two hosts: no page or record is a file. The lines are run
as that module runs them (``Deployment``: the printed line with ``bash -c``, the CPU test
environment of its docstring added), plus the one variable the printed recipe asks each engine's
host to export, ``MOONCAKE_LOCAL_HOSTNAME`` (127.0.0.1 here). The test reads the store through a
third Mooncake client in this process: to wait until A's write-through has stored a turn's pages,
and to read A's pages and records and B's audit copies back.

One pair of servers, one swap: A serves a session's first turn, B its second. Then ``sgl-kvmap
bench --live --store mooncake`` on a trace of six requests, each of its two replays (re-prefill,
translated) over a master of its own, with servers started from the lines sglang-args prints.
"""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("sglang", reason="the live-server tests need SGLang 0.5.23 (setup_cpu.sh)")

from sgl_kvmap.sglang.mooncake_master import Master, unavailable  # noqa: E402
from sgl_kvmap.sglang.servers import free_port_base  # noqa: E402

from .test_bench_mooncake import trace  # noqa: E402, F401 (a fixture)
from .test_sglang_live import (  # noqa: E402
    ANSWER,
    ENVIRONMENT,
    NAMES,
    PAGE,
    STARTUPS,
    Deployment,
    assert_translated,
    first_turn,
    leading,
    page_hashes,
    prompt,
    translated,
)

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

MOONCAKE_ENVIRONMENT = {**ENVIRONMENT, "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1"}


class MooncakeDeployment(Deployment):
    """``Deployment`` over ``master``: the store is read through a third client. Its engines
    may translate a prefix's first page (``--sinks translate``), as the file store's scenarios
    check them."""

    def __init__(self, folder, pair, master: Master):
        store_args = ("--store", "mooncake", "--mooncake-master", master.address)
        store_args += ("--mooncake-metadata", master.metadata)
        super().__init__(
            folder,
            pair,
            [(0, 1), (1, 0)],
            free_port_base(2),
            folder / "counters",
            store_args=store_args,
            env=MOONCAKE_ENVIRONMENT,
            sinks="translate",
        )
        from .test_sglang_mooncake import remover

        self.master, self.client_of_test = master, remover(master)

    def keyspace(self, served_name: str):
        from sgl_kvmap.sglang.mooncake import Keyspace, model_prefix

        return Keyspace(self.client_of_test, model_prefix({}, served_name), 0)

    def stored(self, model: str, tokens: list[int]) -> list[bool]:
        keyspace = self.keyspace(NAMES[model])
        return [keyspace.exists(key) for key in page_hashes(tokens)]

    def reader(self, served_name: str):
        return self.keyspace(served_name)

    def counters(self, model: str) -> dict:
        """KVMapStorage's counters of ``model``'s server (its stats file)."""
        path = self.store / "kvmap-stats" / f"{NAMES[model]}_0_1.json"
        return json.loads(path.read_text())["counters"]


def test_bench_live_replays_over_a_local_master(served_pair, trace, tmp_path, monkeypatch):  # noqa: F811
    """``sgl-kvmap bench --live --store mooncake`` (the command, in this process): each replay
    starts a master of its own and both servers from the lines ``sglang-args --store mooncake``
    prints for it; two sessions of three turns of tests/test_bench_mooncake.py's trace (block 0
    shared), alternating between the models, replayed in re-prefill and translated: every
    request is answered, each server set up its Mooncake client (its log), and the translated
    replay's swaps read translated tokens from the store. First in the module, so that it runs
    before the module's pair of servers starts: at most two servers at once."""
    from click.testing import CliRunner

    from sgl_kvmap.cli import main

    for name, value in ENVIRONMENT.items():
        monkeypatch.setenv(name, value)
    out, stores = tmp_path / "run", tmp_path / "live"
    args = [
        "bench",
        *("--small", served_pair["names"][0], "--large", served_pair["names"][1]),
        *("--pack-up", served_pair["packs"][0, 1], "--pack-down", served_pair["packs"][1, 0]),
        *("--trace", str(trace), "--scale", "8", "--sessions", "2", "--quality-tokens", "1"),
        *("--policy", "alternate", "--mode", "translated", "--prefetch-threshold", "64"),
        *("--store", "mooncake", "--live", "--device", "cpu", "--port", str(free_port_base(2))),
        *("--store-path", str(stores), "--out", str(out)),
    ]
    started = time.monotonic()
    result = CliRunner().invoke(main, args)
    print(f"bench --live --store mooncake: {time.monotonic() - started:.1f} s")
    assert result.exit_code == 0, result.output
    run = json.loads((out / "run.json").read_text())
    assert run["config"]["store"] == "mooncake" and "live SGLang servers" in run["machine"]
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert {r["mode"] for r in records} == {"reprefill", "translated"} and len(records) == 12
    swaps = [r for r in records if r["mode"] == "translated" and r["swapped"]]
    assert swaps and sum(r["reused"]["translated"] for r in swaps) > 0, swaps
    # where a live swap's time went: the stages its server's KVMapStorage timed meanwhile
    translated = [r for r in swaps if r["reused"]["translated"]]
    assert all(r["stages"]["map"] > 0 and r["stages"]["read"] > 0 for r in translated)
    assert all(r["stages"]["map"] < r["ttft_s"] for r in translated)
    logs = sorted((stores / "logs").glob("*.log"))
    assert len(logs) == 4
    assert all("Mooncake store setup successfully" in log.read_text() for log in logs)


@pytest.fixture(scope="module")
def live(served_pair, tmp_path_factory):
    folder = tmp_path_factory.mktemp("live-mooncake")
    started = time.monotonic()
    with Master(folder / "master.log") as master:
        deployment = MooncakeDeployment(folder, served_pair, master)
        try:
            yield deployment
        finally:
            deployment.stop(*list(deployment.servers))
            deployment.client_of_test.close()
    for name, seconds in STARTUPS:
        print(f"server {name} healthy after {seconds:.1f} s")
    print(f"Mooncake live deployment: {time.monotonic() - started:.1f} s")


@pytest.fixture(scope="module")
def swapped_session(live):
    """A's first turn (400 prompt tokens + its answer), then the second turn (the history + 60
    new tokens) on B: (B's prompt, B's generation, the storage tokens expected)."""
    with live.client("a", "b") as client:
        history = first_turn(client, live, "a", prompt(1, 400))
        second = [*history, *prompt(2, 60)]
        expected = translated(live, "a", history, second)
        return second, client.generate("b", second, ANSWER), expected


def test_the_printed_lines_name_the_master_and_no_folder(live):
    """Every engine's printed line stores in Mooncake at this master; B translates from A."""
    for model in "ab":
        extra = live.extra_config(model)
        assert extra["inner_backend"] == "mooncake" and "file_storage_path" not in extra
        assert extra["master_server_address"] == live.master.address
        assert extra["metadata_server"] == live.master.metadata
    assert live.extra_config("b")["translate"]


def test_a_session_served_by_a_is_translated_for_b_over_mooncake(live, swapped_session):
    """A's stored pages (all full pages of its 407 tokens of KV: 25 at 16-token pages) are in
    Mooncake, not in files; B reports all but the last ``tail_pages`` of them (22 at 3) as
    storage hits in SGLang's own ``cached_tokens_details``, its KVMapStorage counts those pages
    translated and no fallback, and B answers."""
    second, generation, expected = swapped_session
    stored = leading(live.stored("a", second))
    translated_pages = stored - live.extra_config("b")["tail_pages"]
    assert stored == 407 // PAGE and expected == translated_pages * PAGE > 0
    assert generation.cached == {"device": 0, "host": 0, "storage": expected}
    assert generation.prompt_tokens == len(second) and len(generation.output_ids) > 0
    counters = live.counters("b")
    assert counters["translated_pages_delivered"] == translated_pages, counters
    assert not [name for name in counters if name.startswith("fallback.")], counters
    assert live.counters("a")["stored_pages"] >= stored
    assert not list(live.store.rglob("*.bin"))  # pages and records live in Mooncake only


def test_bs_kv_for_the_translated_pages_is_the_translation_of_as_over_mooncake(
    live, swapped_session, served_pair
):
    """Read back through Mooncake: B's audit copies of the pages it received equal the pack's
    translation of A's stored pages at the positions A's records give, as over the file store
    (tests/test_sglang_live.py's ``assert_translated``)."""
    second, _, expected = swapped_session
    keys = page_hashes(second)[: expected // PAGE]
    assert_translated(live, NAMES["a"], NAMES["b"], keys, served_pair["packs"][0, 1])
