"""The engine's own first page for every swap (``sgl_kvmap.sglang.priming``), on in-process
engines: SGLang's scheduler calls, radix tree, HiCache controller and KVMapStorage over a file
store (``sgl_kvmap.sglang.engine``; the live servers' route, the TokenizerManager hook, is
tested in tests/test_sglang_live.py). The engines' models are the tiny random pair of
``served_pair``."""

from __future__ import annotations

import pytest
import torch

from sgl_kvmap.models.capture import run
from sgl_kvmap.sglang import StorageSettings
from sgl_kvmap.sglang.engine import PAGE

from .test_sglang_storage import Cluster, assert_translation_at_true_positions, tokens


@pytest.fixture
def cluster(served_pair, tmp_path):
    cluster = Cluster(served_pair, tmp_path / "store")
    yield cluster
    for engine in cluster.engines:
        engine.close()


def assert_own_kv(engine, slots, prompt):
    """The pool holds, at ``slots``, the KV the engine's model computes for ``prompt`` alone (its
    bfloat16 copy)."""
    exact = run(engine.model.model, torch.tensor(prompt)).cache
    got = engine.pool_kv(slots)
    for g, e in zip(got.keys + got.values, exact.keys + exact.values):
        torch.testing.assert_close(g.float(), e, rtol=0.02, atol=0.02)


def test_a_swap_into_an_engine_that_never_saw_its_first_page_translates_after_it(cluster):
    """Sessions that share no opening: the receiving engine computes the swapped prompt's
    first page first, then the pages the sender stored after it are translated at their true
    positions, and the first page in its pool is its own KV."""
    assert StorageSettings().sinks == "prime"
    prompt = tokens(5 * PAGE + 3, seed=40)
    a, b = cluster.engine(0), cluster.engine(1, sinks="prime")
    sent = a.serve(prompt)
    served = b.serve(prompt)
    assert b.primed == 1
    assert served.tiers.primed == PAGE and served.tiers.device == 0
    assert served.tiers.translated == 4 * PAGE and served.reused == 5 * PAGE
    assert b.storage.counters["fallback.no_native_sink_page"] == 0
    assert_own_kv(b, served.slots[:PAGE], prompt[:PAGE])
    assert_translation_at_true_positions(
        b, served, a.pool_kv(sent.slots), cluster.mapper(0, 1), PAGE, 5 * PAGE
    )


def test_without_priming_the_same_swap_is_prefilled(cluster):
    """The same swap under ``sinks: "native"``: nothing translated, counted."""
    prompt = tokens(5 * PAGE + 3, seed=40)
    a, b = cluster.engine(0), cluster.engine(1, sinks="native")
    a.serve(prompt)
    served = b.serve(prompt)
    assert b.primer is None and served.reused == 0
    assert b.storage.counters["fallback.no_native_sink_page"] >= 1


@pytest.mark.parametrize(
    "case",
    ["first page stored by the engine", "too short for a run after it", "peer holds nothing",
     "served whole"],
)  # fmt: skip
def test_no_priming_where_it_would_not_pay(cluster, case):
    """No first page is computed apart when the engine stored it already, when the prompt has
    no translatable run after it (here: one page after page 0 with a 2-page tail), when no peer
    stored the prompt, or when the request asks to be computed whole (``warm``)."""
    prompt = tokens(5 * PAGE + 3, seed=41)
    a = cluster.engine(0)
    tail = 2 if case.startswith("too short") else 0
    b = cluster.engine(1, sinks="prime", tail_pages=tail)
    if case != "peer holds nothing":
        a.serve(prompt)
    if case.startswith("first page stored"):
        b.serve(prompt[: PAGE + 1], prime=False)
    if case.startswith("too short"):
        prompt = prompt[: 3 * PAGE + 1]
    served = b.serve(prompt, prime=case != "served whole")
    assert b.primed == 0 and served.tiers.primed == 0
    if case.startswith("first page stored"):
        assert served.tiers.device == PAGE and served.tiers.translated == 4 * PAGE


def test_the_report_counts_storage_pages_the_engine_has_not_stored_as_translated(cluster, tmp_path):
    """``plugin.ServerView.report``, over the stores a server's TokenizerManager reads: of the
    tokens SGLang reports from storage, those whose pages the engine has not stored as its own
    are translated; its own pages and device hits are not. Prompts kept for reports are
    bounded."""
    from sgl_kvmap.sglang import plugin

    prompt = tokens(6 * PAGE + 3, seed=42)
    a, b = cluster.engine(0), cluster.engine(1, sinks="prime")
    b.serve(prompt[: 2 * PAGE + 1], prime=False)  # b's own pages 0 and 1
    a.serve(prompt)
    view = plugin.ServerView(b.primer, prime=True)
    view.keep("r", prompt, 0)
    report = view.report("r", {"device": 0, "host": 0, "storage": 5 * PAGE})
    assert report == {
        "translated_tokens": 3 * PAGE,
        "primed_tokens": 0,
        "primed_seconds": 0.0,
        "status": "translated",
    }
    mine = view.report("r", {"device": PAGE, "host": 0, "storage": PAGE})
    assert mine["translated_tokens"] == 0 and mine["status"] == "not translated"
    assert view.report("unknown", {"storage": PAGE}) is None
    for i in range(plugin.MAX_REQUESTS_KEPT + 5):
        view.keep(str(i), prompt, 0)
    assert len(view.requests) == plugin.MAX_REQUESTS_KEPT and "r" not in view.requests


def test_a_server_primes_only_for_peers_whose_pack_its_storage_will_use(cluster, tmp_path):
    """``plugin._build_view`` from a server's arguments as SGLang holds them (the extra config
    ``sglang-args`` prints): a server whose only peer's pack records no figure above the quality
    floor (KVMapStorage will not translate with it) neither primes nor reports; with no floor
    it primes, over the peer's store; a server whose storage backend is not KVMapStorage is
    left alone."""
    import json
    from types import SimpleNamespace

    from sgl_kvmap.sglang import plugin

    def server_args(**settings):
        extra = cluster.extra(1, **settings)
        return SimpleNamespace(
            hicache_storage_backend="dynamic",
            hicache_storage_backend_extra_config=json.dumps(extra),
            tp_size=1,
            pp_size=1,
            page_size=PAGE,
            served_model_name=cluster.deployment["names"][1],
        )

    assert plugin._build_view(server_args(sinks="prime", quality_floor=0.0)) is None
    view = plugin._build_view(server_args(sinks="prime", quality_floor=None))
    assert view.prime and len(view.primer.peers) == 1 and view.primer.page_size == PAGE
    assert not plugin._build_view(server_args(sinks="native", quality_floor=None)).prime
    other = server_args(quality_floor=None)
    other.hicache_storage_backend = "file"
    assert plugin._build_view(other) is None
