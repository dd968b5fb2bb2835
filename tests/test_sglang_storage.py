"""The SGLang extension along the route a live SGLang 0.5.23 server takes
(sgl_kvmap/sglang/engine.py): engines of two models share a file store through KVMapStorage;
sessions move between them.

Every scenario checks that the KV in the receiving engine's device pool equals the reference
translation (the pack's ``KVMapper.map`` of what the sending engine stored) at the tokens' TRUE
positions, and that the receiving model's logits over its pool match the logits over that
reference. Substitutions are listed in sgl_kvmap/sglang/engine.py.
"""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch

from sgl_kvmap.core.cache import KVCache
from sgl_kvmap.core.errors import KVMapError
from sgl_kvmap.core.mapper import KVMapper
from sgl_kvmap.kernels import fast_matmul_dtype
from sgl_kvmap.models.capture import load_model, run
from sgl_kvmap.sglang import PeerSettings, StorageSettings
from sgl_kvmap.sglang.engine import PAGE, Engine, page_keys
from sgl_kvmap.sglang.launch import sglang_extra_config

from .conftest import fit_tiny_mapper, hicache_storage_config, save_loaded

torch.manual_seed(0)

# The engines of the scenarios below prefetch prompts of a few 8-token pages (below SGLang's
# 256-token threshold) and wait for every prefetch (SGLang's wait_complete policy): they check
# what is translated and where it lands, on a machine whose load would otherwise decide whether
# a 1 s deadline cuts a prefetch. The deadline's own behaviour has tests of its own below.
UNTIMED = {"prefetch_threshold": PAGE, "prefetch_policy": "wait_complete"}


@pytest.fixture(scope="module")
def deployment(served_pair):
    """Two model folders (their served names, as loaded back by the engines) and a pack each
    way: "a" (3 layers x 2 KV heads x 16) and "b" (4 layers x 1 KV head x 32)."""
    return served_pair


@pytest.fixture
def cluster(deployment, tmp_path):
    """Engines of "a" and "b" over one fresh store; ``cluster.engine(i, **settings)`` starts
    engine i (translating from the other when ``translate``); all are closed afterwards."""
    return Cluster(deployment, tmp_path / "store")


class Cluster:
    def __init__(self, deployment, store):
        self.deployment, self.store, self.engines = deployment, store, []

    def extra(self, i: int, translate: bool = True, pack=None, **settings) -> dict:
        names, other = self.deployment["names"], 1 - i
        peer = PeerSettings(names[other], str(pack or self.deployment["packs"][other, i]))
        settings.setdefault("interface_v1", True)
        settings.setdefault("tail_pages", 0)  # every stored page translated, unless a test asks
        # a fresh engine translates from page 0, so the scenarios check that page's translation
        # too; the default, native, has tests of its own
        settings.setdefault("sinks", "translate")
        settings.setdefault("quality_floor", None)  # the tiny packs record no measured gap
        ours = StorageSettings(translate=translate, peers=(peer,), **settings)
        return sglang_extra_config(ours, str(self.store))

    def engine(self, i: int, model=None, **settings) -> Engine:
        model = model or self.deployment["models"][i]
        name, extra = self.deployment["names"][i], self.extra(i, **settings)
        engine = Engine(model, name, extra, **UNTIMED)
        self.engines.append(engine)
        return engine

    def mapper(self, source: int, target: int) -> KVMapper:
        return KVMapper.from_pretrained(self.deployment["packs"][source, target])

    def files(self, i: int) -> list[str]:
        """Page files the store holds for engine i's model (records excluded)."""
        name = self.deployment["names"][i].replace("/", "-")
        return [f for f in os.listdir(self.store) if f == f"{f[:64]}_{name}_0_1.bin"]


@pytest.fixture(autouse=True)
def _close_engines(request):
    yield
    cluster = request.node.funcargs.get("cluster")
    for engine in cluster.engines if cluster else ():
        engine.close()


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 100, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_translation_at_true_positions(target, served, source_kv, mapper, start, end):
    """Tokens [start, end) of ``served`` hold ``mapper``'s translation of ``source_kv`` (the
    sender's stored KV of those tokens) rotated at positions start..end-1, exactly as the
    translation runs (bfloat16 pools, the products in the CPU's fast dtype); and the model's
    logits over the pool equal those over that reference."""
    assert start % PAGE == 0 and end % PAGE == 0 and end > start
    sent = KVCache(
        [k[start:end] for k in source_kv.keys],
        [v[start:end] for v in source_kv.values],
        torch.arange(start, end),
    )
    want = mapper.map(sent, fast_matmul_dtype("cpu"))
    got = target.pool_kv(served.slots[start:end])
    for g, w in zip(got.keys + got.values, want.keys + want.values):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    shifted = mapper.map(dataclasses.replace(sent, positions=sent.positions + PAGE))
    assert not torch.equal(shifted.keys[0], want.keys[0])  # so the position is what was checked


def assert_logits_over_pool(target, served, prompt):
    """The model's logits for the computed tokens equal a plain forward over the pool's prefix:
    the engine read the prefix from the slots that hold it."""
    prefix = target.pool_kv(served.slots[: served.reused])
    rest = torch.tensor(prompt[served.reused :])
    want = run(target.model.model, rest, past=prefix, logits_to_keep=rest.numel()).logits
    torch.testing.assert_close(served.logits, want)


def assert_swap(target, served, sender, sent, mapper, prompt, start, end):
    """Tokens [start, end) of ``served`` are the translation of what ``sender`` stored for
    ``sent`` at their true positions, and the target's logits over its pool are right."""
    source_kv = sender.pool_kv(sent.slots)
    assert_translation_at_true_positions(target, served, source_kv, mapper, start, end)
    assert_logits_over_pool(target, served, prompt)


def test_a_fresh_target_translates_the_whole_prefix(cluster):
    """(a) The receiving engine never saw the session: every full page the sender stored is
    translated, the first page (attention sinks) included, the partial page is computed."""
    prompt = tokens(5 * PAGE + 3, seed=1)
    a, b = cluster.engine(0, translate=False), cluster.engine(1)
    sent = a.serve(prompt)
    served = b.serve(prompt)
    assert served.reused == 5 * PAGE
    assert b.storage.counters["translated_pages_delivered"] == 5
    assert_swap(b, served, a, sent, cluster.mapper(0, 1), prompt, 0, 5 * PAGE)


def test_pages_after_a_cached_first_page_land_at_their_true_positions(cluster):
    """(b) The receiving engine's tree already holds page 0 (a shared opening it served): SGLang
    asks storage for pages 1.. with prefix keys that omit the matched node's own pages, and the
    translation must still rotate page p at p * PAGE."""
    prompt = tokens(4 * PAGE + 5, seed=2)
    a, b = cluster.engine(0, translate=False), cluster.engine(1)
    b.serve(prompt[: PAGE + 2])  # the shared opening, natively
    sent = a.serve(prompt)
    served = b.serve(prompt)
    assert served.reused == 4 * PAGE
    assert b.storage.counters["translated_pages_delivered"] == 3
    assert_swap(b, served, a, sent, cluster.mapper(0, 1), prompt, PAGE, 4 * PAGE)


def test_a_target_that_served_the_first_turns_translates_only_the_rest(cluster):
    """(c) Turn 1 on the target, turn 2 on the source (which recomputes: no pack into it), turn
    3 back on the target: its tree holds the first pages, the source's store the rest."""
    turn1 = tokens(3 * PAGE + 4, seed=3)
    turn2 = turn1 + tokens(3 * PAGE, seed=4)
    turn3 = turn2 + tokens(PAGE + 1, seed=5)
    a, b = cluster.engine(0, translate=False), cluster.engine(1)
    b.serve(turn1)
    sent = a.serve(turn2)
    served = b.serve(turn3)
    assert served.reused == 6 * PAGE
    assert b.storage.counters["translated_pages_delivered"] == 3
    assert_swap(b, served, a, sent, cluster.mapper(0, 1), turn3, 3 * PAGE, 6 * PAGE)


def test_alternating_turns_translate_only_what_each_engine_lacks(cluster):
    """(d) A -> B -> A -> B with packs both ways: each swap translates only the pages the
    receiving engine lacks; nothing translated, nor anything computed after it, is stored as
    a model's own page, so nothing is translated twice or from a translation."""
    t1 = tokens(2 * PAGE + 3, seed=6)
    t2 = t1 + tokens(2 * PAGE, seed=7)
    t3 = t2 + tokens(2 * PAGE, seed=8)
    t4 = t3 + tokens(PAGE + 2, seed=9)
    a, b = cluster.engine(0), cluster.engine(1)
    sent1 = a.serve(t1)  # pages 0-1 stored for "a"
    got2 = b.serve(t2)  # translates pages 0-1; its own pages 2-3 descend from them: withheld
    assert got2.reused == 2 * PAGE and b.storage.counters["translated_pages_delivered"] == 2
    assert cluster.files(1) == []
    sent3 = a.serve(t3)  # a's tree holds pages 0-1; b stored nothing to translate back
    assert sent3.reused == 2 * PAGE and a.storage.counters["translated_pages_delivered"] == 0
    assert len(cluster.files(0)) == 6  # all of a's own pages, computed by a
    got4 = b.serve(t4)  # b's tree holds pages 0-3 (t2); pages 4-5 come from a, translated
    assert got4.reused == 6 * PAGE and b.storage.counters["translated_pages_delivered"] == 4
    assert cluster.files(1) == []
    mapper = cluster.mapper(0, 1)
    assert_translation_at_true_positions(b, got2, a.pool_kv(sent1.slots), mapper, 0, 2 * PAGE)
    assert_translation_at_true_positions(
        b, got4, a.pool_kv(sent3.slots), mapper, 4 * PAGE, 6 * PAGE
    )
    assert_logits_over_pool(b, got4, t4)


def test_shared_derived_pages_are_translated_back_and_never_read_as_a_models_own(cluster):
    """(d) with ``derived: share``: the pages B computes over pages it received translated are
    stored apart (``.derived``), never as B's own; the swap back to A translates them into A's
    pages at their true positions (A -> B -> A -> B), and an engine of B that serves only exact
    pages finds none of them."""
    t1 = tokens(2 * PAGE + 3, seed=6)
    t2 = t1 + tokens(2 * PAGE, seed=7)
    t3 = t2 + tokens(2 * PAGE, seed=8)
    t4 = t3 + tokens(PAGE + 2, seed=9)
    a, b = cluster.engine(0, derived="share"), cluster.engine(1, derived="share")
    a.serve(t1)
    got2 = b.serve(t2)  # translates pages 0-1; computes pages 2-3 over them: derived
    assert b.storage.counters["derived_pages_stored"] == 2
    assert cluster.files(1) == []
    sent3 = a.serve(t3)  # a's tree holds pages 0-1; pages 2-3 come from b's derived pages
    assert sent3.reused == 4 * PAGE
    assert a.storage.counters["translated_pages_delivered"] == 2
    assert a.storage.counters["derived_pages_read"] == 2
    assert_translation_at_true_positions(
        a, sent3, b.pool_kv(got2.slots), cluster.mapper(1, 0), 2 * PAGE, 4 * PAGE
    )
    assert_logits_over_pool(a, sent3, t3)
    assert len(cluster.files(0)) == 2  # a's pages 4-5 descend from translations: apart too
    got4 = b.serve(t4)  # b's tree holds pages 0-3; pages 4-5 from a's derived pages
    assert got4.reused == 6 * PAGE
    assert b.storage.counters["derived_pages_read"] == 2
    assert_translation_at_true_positions(
        b, got4, a.pool_kv(sent3.slots), cluster.mapper(0, 1), 4 * PAGE, 6 * PAGE
    )
    exact_only = cluster.engine(1, translate=False)
    assert exact_only.serve(t2).reused == 0


def test_derived_pages_are_stored_only_by_engines_that_share_them(cluster):
    """Under the default, ``withhold``, an engine stores nothing it computed over translated
    KV; a peer that shares its own derived pages is not read by an engine that withholds."""
    t1 = tokens(2 * PAGE + 3, seed=6)
    t2 = t1 + tokens(2 * PAGE, seed=7)
    t3 = t2 + tokens(2 * PAGE, seed=8)
    a, b = cluster.engine(0), cluster.engine(1, derived="share")
    a.serve(t1)
    b.serve(t2)
    assert b.storage.counters["derived_pages_stored"] == 2
    assert a.serve(t3).reused == 2 * PAGE
    assert a.storage.counters["translated_pages_delivered"] == 0
    assert "derived_pages_stored" not in a.storage.counters


def test_sessions_sharing_a_system_prompt_translate_it_once(cluster):
    """(e) Two sessions open with the same two pages: the second swap finds them in the target's
    tree (translated for the first session) and translates only its own pages."""
    system = tokens(2 * PAGE, seed=10)
    one, two = system + tokens(2 * PAGE + 1, seed=11), system + tokens(3 * PAGE + 1, seed=12)
    a, b = cluster.engine(0, translate=False), cluster.engine(1)
    a.serve(one)
    b.serve(one)
    assert b.storage.counters["translated_pages_delivered"] == 4
    sent = a.serve(two)
    served = b.serve(two)
    assert served.reused == 5 * PAGE
    assert b.storage.counters["translated_pages_delivered"] == 4 + 3
    assert_swap(b, served, a, sent, cluster.mapper(0, 1), two, 2 * PAGE, 5 * PAGE)


def test_a_prefix_ending_mid_page_translates_its_full_pages(cluster):
    """(f) The sender stored a prefix that ends mid-page: its full pages are translated, the
    partial page and the rest are computed by the receiver."""
    first = tokens(3 * PAGE + 5, seed=13)
    prompt = first + tokens(2 * PAGE, seed=14)
    a, b = cluster.engine(0, translate=False), cluster.engine(1)
    sent = a.serve(first)
    served = b.serve(prompt)
    assert served.reused == 3 * PAGE
    assert_swap(b, served, a, sent, cluster.mapper(0, 1), prompt, 0, 3 * PAGE)


def exact_logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    """The model's logits over the whole prompt computed from scratch."""
    ids = torch.tensor(prompt)
    return run(engine.model.model, ids, logits_to_keep=ids.numel()).logits


@pytest.mark.parametrize(
    "case, reason",
    [
        ("missing pack", "pack_invalid"),
        ("damaged pack", "pack_invalid"),
        ("pack of another pair", "model_mismatch"),
        ("tokenizer differs", "tokenizer_mismatch"),
        ("host pool of another geometry", "geometry_mismatch"),
        ("sinks: native, no first page of its own", "no_native_sink_page"),
        ("this engine's model unreadable", "model_unverifiable"),
    ],
)
def test_fallbacks_prefill_natively_and_count_the_reason(
    cluster, deployment, tmp_path, case, reason
):
    """Any doubt: nothing is translated, the reason is counted, and the request is computed
    exactly as without sgl-kvmap."""
    prompt = tokens(4 * PAGE + 3, seed=20)
    cluster.engine(0, translate=False).serve(prompt)
    settings, model = {}, None
    if case == "missing pack":
        settings["pack"] = tmp_path / "nowhere"
    elif case == "damaged pack":
        settings["pack"] = damaged_copy(deployment["packs"][0, 1], tmp_path)
    elif case == "pack of another pair":
        settings["pack"] = deployment["packs"][1, 0]
    elif case == "tokenizer differs":
        settings["model_path"] = other_tokenizer_copy(deployment["names"][1], tmp_path)
    elif case == "host pool of another geometry":  # b's name, a's pool shape and model
        model = deployment["models"][0]
    elif case.startswith("sinks"):
        settings["sinks"] = "native"
    elif case == "this engine's model unreadable":
        settings["model_path"] = str(tmp_path / "no-such-model")
    b = cluster.engine(1, model=model, **settings)
    served = b.serve(prompt)
    assert served.reused == 0
    assert b.storage.counters[f"fallback.{reason}"] >= 1
    assert b.storage.counters["translated_pages_delivered"] == 0
    torch.testing.assert_close(served.logits, exact_logits(b, prompt))


def pack_recording(folder, tmp_path, **metrics):
    """A copy of the pack at ``folder`` whose metrics record ``metrics`` (as ``eval --record``
    writes them)."""
    mapper = KVMapper.from_pretrained(folder)
    mapper.info["metrics"].update(metrics)
    return mapper.save_pretrained(tmp_path / "recorded", overwrite=True)


# how the cluster's engines serve: what a served figure must have been measured under
SERVED = {"served_tail": PAGE, "served_page_size": PAGE, "served_sinks": "translate"}


@pytest.mark.parametrize(
    "tail_pages, metrics, floor, translates",
    [
        (0, {"eval_gap_closed": -0.2}, 0.0, False),  # worse than staying on the source
        (0, {"eval_gap_closed": 0.0}, 0.0, False),  # no better than staying
        (0, {"eval_gap_closed": 0.3}, 0.0, True),
        (0, {"eval_gap_closed": 0.3}, 0.5, False),  # the operator asks for more
        (1, {"eval_gap_closed": 0.3, "eval_gap_closed_tail": -0.1}, 0.0, False),  # the tail's
        (1, {"eval_gap_closed": -0.3, "eval_gap_closed_tail": 0.1}, 0.0, True),
        (0, {}, 0.0, False),  # nothing measured: cannot be shown to clear the floor
        (0, {"eval_gap_closed": -0.9}, None, True),  # no floor
        # served figures (bench --record) come first where served as this engine serves
        (1, {"eval_gap_closed_tail": -0.1, **SERVED, "served_gap_closed_tail_low": 0.2}, 0, True),
        (0, {"eval_gap_closed": 0.3, **SERVED, "served_gap_closed_low": -0.1}, 0.0, False),
        (1, {"eval_gap_closed_tail": -0.1, **SERVED, "served_gap_closed_tail_low": 0.2,
             "served_tail": 2 * PAGE}, 0.0, False),  # served with another tail
        (1, {"eval_gap_closed_tail": -0.1, **SERVED, "served_gap_closed_tail_low": 0.2,
             "served_sinks": "native"}, 0.0, False),  # served under another sinks policy
        (1, {"eval_gap_closed_tail": -0.1, **SERVED, "served_gap_closed_tail_low": 0.2,
             "served_first_layer": "exact"}, 0.0, False),  # served with another layer 0
        (1, {"eval_gap_closed_tail": -0.1, **SERVED, "served_gap_closed_tail_low": 0.2,
             "served_first_layer": "mapped"}, 0.0, True),  # as this engine serves it
        (1, {"eval_gap_closed_tail": -0.1, **SERVED, "served_gap_closed_tail_low": 0.2,
             "served_derived": "share"}, 0.0, False),  # served sharing derived pages
        (1, {"eval_gap_closed_tail": -0.1, **SERVED, "served_gap_closed_tail_low": 0.2,
             "served_derived": "withhold"}, 0.0, True),
    ],
)  # fmt: skip
def test_a_pack_translates_only_above_the_quality_floor(
    cluster, deployment, tmp_path, tail_pages, metrics, floor, translates
):
    """The gap closed a pack records for the engine's mode (the tail's when it recomputes a
    tail) must be above the floor; otherwise the peer is not used, the reason is counted, and
    every request is prefilled exactly as without sgl-kvmap."""
    prompt = tokens(4 * PAGE + 3, seed=23)
    cluster.engine(0, translate=False).serve(prompt)
    pack = pack_recording(deployment["packs"][0, 1], tmp_path, **metrics)
    b = cluster.engine(1, pack=pack, tail_pages=tail_pages, quality_floor=floor)
    served = b.serve(prompt)
    delivered = b.storage.counters["translated_pages_delivered"]
    assert (delivered > 0) == translates
    assert b.storage.counters["fallback.pack_below_floor"] == (0 if translates else 1)
    if not translates:
        assert served.reused == 0
        torch.testing.assert_close(served.logits, exact_logits(b, prompt))


# the library's hand-off as these engines serve it (``eval --record``): 8-token pages, 1-page tail
AS_SERVED = {"eval_served_page_size": PAGE, "eval_served_tail": PAGE}
NO_GAP = {"eval_source_accuracy": 0.7, "eval_reference_accuracy": 0.6}


@pytest.mark.parametrize(
    "sinks, metrics, translates",
    [
        ("prime", {"eval_gap_closed_tail": -0.5, **AS_SERVED, "eval_gap_closed_served": 0.2},
         True),  # the figure as served comes before the library's own hand-off
        ("native", {"eval_gap_closed_tail": -0.5, **AS_SERVED, "eval_gap_closed_served": 0.2},
         True),
        ("prime", {"eval_gap_closed_tail": -0.5, **AS_SERVED, "eval_gap_closed_served": 0.2,
                   "eval_served_tail": 2 * PAGE}, False),  # measured with another tail
        ("translate", {"eval_gap_closed_tail": -0.5, **AS_SERVED, "eval_gap_closed_served": 0.2},
         False),  # these engines translate first pages: not what was measured
        ("prime", {**NO_GAP, **AS_SERVED, "eval_retention_served": 0.97}, True),  # no gap
        ("prime", {**NO_GAP, **AS_SERVED, "eval_retention_served": 0.9}, False),
        ("prime", {**NO_GAP, "eval_retention_tail": 0.99}, True),  # the library's hand-off
        ("prime", {**NO_GAP}, False),  # no retention measured
    ],
)  # fmt: skip
def test_the_floor_reads_the_hand_off_as_served_and_the_retention_of_a_pack_with_no_gap(
    cluster, deployment, tmp_path, sinks, metrics, translates
):
    """The library's figure of the hand-off as these engines serve it (``eval --record``: the
    same page size and tail, the first page computed) is read before its own hand-off's; a pack
    whose target does not beat its source records no gap closed, and its retention must reach
    the retention floor (0.95 by default) instead."""
    prompt = tokens(4 * PAGE + 3, seed=24)
    cluster.engine(0, translate=False).serve(prompt)
    pack = pack_recording(deployment["packs"][0, 1], tmp_path, **metrics)
    b = cluster.engine(1, pack=pack, tail_pages=1, quality_floor=0.0, sinks=sinks)
    b.serve(prompt[: PAGE + 1], prime=False)  # a first page of its own, whatever the policy
    b.serve(prompt)
    assert (b.storage.counters["translated_pages_delivered"] > 0) == translates
    assert b.storage.counters["fallback.pack_below_floor"] == (0 if translates else 1)


def test_the_default_floor_is_better_than_staying_on_the_source():
    assert StorageSettings().quality_floor == 0.0
    for floor in (float("nan"), 2.0, "0.1", True):
        with pytest.raises(KVMapError, match="quality_floor"):
            StorageSettings(quality_floor=floor)
    extra = StorageSettings(quality_floor=None).to_extra_config()
    assert StorageSettings.from_extra_config(extra).quality_floor is None


@pytest.mark.parametrize("sinks", ["native", "prime"])
def test_native_sinks_translate_after_a_first_page_of_its_own(cluster, sinks):
    """``"sinks": "native"``, and "prime" (the default) for an engine that holds the first
    page already: the first page must be the engine's own; after it, translation."""
    assert StorageSettings().sinks == "prime"
    prompt = tokens(4 * PAGE + 3, seed=21)
    a, b = cluster.engine(0, translate=False), cluster.engine(1, sinks=sinks)
    b.serve(prompt[: PAGE + 1])
    sent = a.serve(prompt)
    served = b.serve(prompt)
    assert served.reused == 4 * PAGE and b.storage.counters["translated_pages_delivered"] == 3
    assert_translation_at_true_positions(
        b, served, a.pool_kv(sent.slots), cluster.mapper(0, 1), PAGE, 4 * PAGE
    )


def test_an_opening_a_peer_stored_is_computed_by_the_engine_that_serves_it(cluster):
    """Under the default sinks policy, an engine serving an opening of several pages that its
    peer already stored (``sgl-kvmap warm`` on the second server) computes it itself: no page is
    translated, its pool holds its own KV for the opening, and a session after the opening,
    swapped from the peer, is translated only after it."""
    opening = tokens(4 * PAGE, seed=26)
    session = [*opening, *tokens(3 * PAGE + 5, seed=27)]
    a, b = cluster.engine(0), cluster.engine(1, sinks=StorageSettings.sinks)
    a.serve([*opening, 1])
    warmed = b.serve([*opening, 1], prime=False)  # as ``sgl-kvmap warm`` asks
    assert warmed.reused == 0 and b.storage.counters["translated_pages_delivered"] == 0
    assert b.storage.counters["fallback.no_native_sink_page"] >= 1
    exact = run(b.model.model, torch.tensor(opening)).cache
    got = b.pool_kv(warmed.slots[: len(opening)])
    for g, e in zip(got.keys + got.values, exact.keys + exact.values):
        torch.testing.assert_close(g.float(), e, rtol=0.02, atol=0.02)
    sent = a.serve(session)
    served = b.serve(session)
    assert served.tiers.device == len(opening) and served.tiers.translated == 3 * PAGE
    assert_translation_at_true_positions(
        b, served, a.pool_kv(sent.slots), cluster.mapper(0, 1), len(opening), 7 * PAGE
    )


def test_native_pages_always_win(cluster):
    """A page stored by this model is loaded as it is, never a translation of a peer's."""
    prompt = tokens(4 * PAGE + 3, seed=22)
    a = cluster.engine(0, translate=False)
    a.serve(prompt)
    first = cluster.engine(1)
    first.serve(prompt[: 2 * PAGE + 1])  # translated from a: pages 0-1 withheld ...
    cluster.engine(1, translate=False).serve(prompt[: 2 * PAGE + 1])  # ... an exact engine's
    served = (late := cluster.engine(1)).serve(prompt)
    assert late.storage.counters["native_pages"] == 2
    assert late.storage.counters["translated_pages_delivered"] == 2
    exact = run(late.model.model, torch.tensor(prompt[: 2 * PAGE])).cache
    got = late.pool_kv(served.slots[: 2 * PAGE])
    torch.testing.assert_close(got.keys[1], exact.keys[1].bfloat16(), rtol=0, atol=0)


def test_translated_pages_are_never_stored_however_many_were_translated(cluster):
    """Provenance is not a bounded memory: after many other sessions were translated, the
    first one's pages and what follows them are still withheld, and an engine that serves
    exact pages only finds none of them."""
    a, b = cluster.engine(0, translate=False), cluster.engine(1)
    sessions = [tokens(2 * PAGE + 1, seed=100 + i) for i in range(12)]
    for session in sessions:
        a.serve(session)
        b.serve(session)
    assert b.storage.counters["translated_pages_delivered"] == 24
    longer = sessions[0] + tokens(3 * PAGE, seed=99)
    b.serve(longer)
    assert cluster.files(1) == []
    assert b.storage.counters["pages_withheld"] >= 3
    exact_only = cluster.engine(1, translate=False)
    assert exact_only.serve(longer).reused == 0


def test_a_peer_storing_float16_is_read_as_float16(cluster):
    """The peer's dtype is read from each page's record, not assumed."""
    prompt = tokens(3 * PAGE + 1, seed=23)
    a = Engine(
        cluster.deployment["models"][0],
        cluster.deployment["names"][0],
        cluster.extra(0, translate=False),
        dtype=torch.float16,
        **UNTIMED,
    )
    cluster.engines.append(a)
    b = cluster.engine(1)
    sent = a.serve(prompt)
    served = b.serve(prompt)
    assert served.reused == 3 * PAGE
    source_kv = a.pool_kv(sent.slots[: 3 * PAGE])
    assert source_kv.keys[0].dtype == torch.float16
    mapper = cluster.mapper(0, 1)
    want = mapper.map(source_kv, fast_matmul_dtype("cpu"))
    got = b.pool_kv(served.slots[: 3 * PAGE])
    for g, w in zip(got.keys + got.values, want.keys + want.values):
        torch.testing.assert_close(g, w.bfloat16(), rtol=0, atol=0)
    misread = mapper.map(_reinterpreted(source_kv), fast_matmul_dtype("cpu"))
    assert not torch.equal(got.keys[0], misread.keys[0].bfloat16())


def _reinterpreted(cache: KVCache) -> KVCache:
    """float16 values' bytes read as bfloat16 (what an unrecorded dtype would give)."""
    return KVCache(
        [k.view(torch.bfloat16) for k in cache.keys],
        [v.view(torch.bfloat16) for v in cache.values],
        cache.positions,
    )


@pytest.mark.parametrize(
    "damage",
    [
        "random bytes",
        "a truncated file",
        "a truncated record",
        "NaN with a matching record",
        "huge values with a matching record",
    ],
)
def test_a_damaged_peer_page_ends_the_translated_run(cluster, damage, caplog):
    """A peer page that does not match its record, is cut short, holds non-finite values, or
    holds finite values whose translation is not finite (before: written into the engine's
    pool), is never served: the run stops before it, the reason is counted (once logged, with no
    traceback) and the rest is computed."""
    from sgl_kvmap.sglang.records import PageRecord, page_crc32

    prompt = tokens(4 * PAGE + 3, seed=24)
    a, b = cluster.engine(0, translate=False), cluster.engine(1)
    a.serve(prompt)
    key = page_keys(prompt)[2]
    name = cluster.deployment["names"][0].replace("/", "-")
    page_file = cluster.store / f"{key}_{name}_0_1.bin"
    size = page_file.stat().st_size
    record_file = cluster.store / f"{key}.kvmap_{name}_0_1.bin"
    if damage == "random bytes":
        page_file.write_bytes(os.urandom(size))
        reason = "peer_page_damaged"
    elif damage == "a truncated file":
        os.truncate(page_file, size // 2)
        reason = "peer_page_damaged"
    elif damage == "a truncated record":
        os.truncate(record_file, 100)
        reason = "record_invalid"
    else:  # values the record vouches for: finite or not, the checks behind the CRC decide
        huge = damage.startswith("huge")
        bad = torch.full((size // 2,), 3e38 if huge else float("nan"), dtype=torch.bfloat16)
        page_file.write_bytes(bad.view(torch.uint8).numpy().tobytes())
        record = PageRecord.from_tensor(
            torch.frombuffer(bytearray(record_file.read_bytes()), dtype=torch.uint8)
        )
        fixed = dataclasses.replace(record, crc32=page_crc32(bad))
        record_file.write_bytes(fixed.to_tensor().numpy().tobytes())
        reason = "translation_not_finite" if huge else "peer_page_not_finite"
    served = b.serve(prompt)
    assert served.reused == 2 * PAGE
    assert b.storage.counters[f"fallback.{reason}"] >= 1
    assert b.storage.counters["fallback.translation_error"] == 0
    assert not any(r.exc_info for r in caplog.records if r.name.startswith("sgl_kvmap"))
    assert b.pool_kv(served.slots).keys[0].isfinite().all()


def test_a_failing_peer_store_hides_only_the_peer(cluster):
    """A peer store that raises costs the translation, never this engine's own stored pages."""
    prompt = tokens(4 * PAGE + 3, seed=25)
    cluster.engine(0, translate=False).serve(prompt)
    cluster.engine(1, translate=False).serve(prompt[: 2 * PAGE + 1])  # b's own pages 0-1
    b = cluster.engine(1)

    def broken(*args, **kwargs):
        raise OSError("peer store unreachable")

    for store in b.storage.peers[0].stores.values():
        store.batch_exists = store.exists = store.get = broken
    served = b.serve(prompt)
    assert served.reused == 2 * PAGE
    assert b.storage.counters["native_pages"] == 2
    assert b.storage.counters["fallback.peer_store_error"] >= 1
    assert_logits_over_pool(b, served, prompt)


def test_a_pack_changed_on_disk_while_serving_changes_nothing(cluster, deployment, tmp_path):
    """The engine translates with the copy of the pack it verified at start-up."""
    import shutil

    pack = tmp_path / "pack"
    shutil.copytree(deployment["packs"][0, 1], pack)
    prompt = tokens(3 * PAGE + 1, seed=26)
    a, b = cluster.engine(0, translate=False), cluster.engine(1, pack=pack)
    sent = a.serve(prompt)
    os.truncate(pack / "mapper.safetensors", 16)
    served = b.serve(prompt)
    assert served.reused == 3 * PAGE
    assert_translation_at_true_positions(
        b, served, a.pool_kv(sent.slots), cluster.mapper(0, 1), 0, 3 * PAGE
    )


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"translate": "false"}, "translate must be a JSON true/false"),
        ({"interface_v1": "0"}, "interface_v1 must be 0, 1, true or false"),
        ({"interface_v1": 0}, 'KVMapStorage needs "interface_v1": 1'),
        ({"hicache_storage_pass_prefix_keys": False}, '"hicache_storage_pass_prefix_keys": true'),
        ({"peers": [{"model_name": "x", "pack": "y", "dtype": "float16"}]}, "unknown peer key"),
        ({"peers": {"model_name": "x"}}, "peers must be a list"),
        ({"peers": [{"model_name": "x"}]}, "has no pack"),
        ({"sinks": "maybe"}, "sinks must be one of"),
        ({"first_layer": "own"}, "first_layer must be one of"),
        ({"derived": True}, "derived must be a JSON string"),
        ({"derived": "keep"}, "derived must be one of"),
        ({"inner_backend": "hf3fs"}, "not supported by sgl-kvmap"),
    ],
)
def test_a_wrong_extra_config_stops_the_server_with_its_message(cluster, extra, message):
    """SGLang builds the backend while the server starts: a wrong value is refused there."""
    from sgl_kvmap.core.errors import KVMapError

    config = {**cluster.extra(1), **extra}
    with pytest.raises(KVMapError, match=message):
        Engine(cluster.deployment["models"][1], cluster.deployment["names"][1], config)


def damaged_copy(pack, tmp_path):
    import shutil

    broken = tmp_path / "damaged"
    shutil.copytree(pack, broken)
    weights = broken / "mapper.safetensors"
    data = bytearray(weights.read_bytes())
    data[-64:] = bytes(64)  # the tail of the tensor data: the sha256 check must catch it
    weights.write_bytes(bytes(data))
    return broken


def other_tokenizer_copy(model_dir, tmp_path):
    """The model's folder with a different tokenizer (one extra token)."""
    import shutil

    from .conftest import char_tokenizer

    copy = tmp_path / "other_tokenizer"
    shutil.copytree(model_dir, copy)
    char_tokenizer(extra="§").save_pretrained(copy)
    return str(copy)


@pytest.fixture(scope="module")
def two_head_pair(tmp_path_factory):
    """A pair with 2 KV heads on both sides (source 3 layers x 16, target 2 layers x 32) and
    its pack, for tensor parallelism."""
    from .conftest import tiny_model

    root = tmp_path_factory.mktemp("two_heads")
    loaded = (tiny_model("qwen2", seed=1), tiny_model("qwen2", seed=5, layers=2, head_dim=32))
    names = [save_loaded(m, root / n) for m, n in zip(loaded, ("s", "t"))]
    models = [load_model(name) for name in names]
    mapper = dataclasses.replace(fit_tiny_mapper(*models), sink_tokens=4)
    return names, models, str(mapper.save_pretrained(root / "pack"))


@pytest.mark.parametrize("source_tp", [1, 2, 4])
@pytest.mark.parametrize("target_tp", [1, 2, 4])
def test_tensor_parallel_ranks_translate_their_own_heads(
    two_head_pair, tmp_path, source_tp, target_tp
):
    """Over 2 KV heads, TP 1, 2 and 4 on either side (TP 4 replicates each head on 2 ranks, as
    SGLang does): every target rank computes only its own heads, reading each of the source's
    heads once from the ranks that hold it, and its pool holds the reference's columns of
    those heads at the true positions."""
    from sgl_kvmap.sglang.engine import TPGroup
    from sgl_kvmap.sglang.heads import rank_heads

    names, models, pack = two_head_pair
    store = str(tmp_path / "store")
    off = sglang_extra_config(StorageSettings(interface_v1=True), store)
    peer = PeerSettings(names[0], pack, tp_size=source_tp)
    translating = StorageSettings(
        translate=True,
        interface_v1=True,
        peers=(peer,),
        tail_pages=0,
        quality_floor=None,
        sinks="translate",
    )
    on = sglang_extra_config(translating, store)
    prompt = tokens(4 * PAGE + 3, seed=30)
    source, target = TPGroup(models[0], names[0], off, source_tp, **UNTIMED), None
    try:
        sent = source.serve(prompt)
        target = TPGroup(models[1], names[1], on, target_tp, **UNTIMED)
        served = target.serve(prompt)
        source_kv = source.pool_kv([s.slots[: 4 * PAGE] for s in sent])
        want = KVMapper.from_pretrained(pack).map(source_kv, fast_matmul_dtype("cpu"))
        for rank, (engine, got) in enumerate(zip(target.ranks, served)):
            heads = rank_heads(2, target_tp, rank)
            assert got.reused == 4 * PAGE
            assert engine.storage.peers[0].mapper.target.num_kv_heads == len(heads)
            pool = engine.pool_kv(got.slots[: 4 * PAGE])
            for g, w in zip(pool.keys + pool.values, want.keys + want.values):
                torch.testing.assert_close(g, w[:, heads], rtol=0, atol=0)
        rest = torch.tensor(prompt[4 * PAGE :])
        logits = run(models[1].model, rest, past=want, logits_to_keep=rest.numel()).logits
        torch.testing.assert_close(served[0].logits, logits)
    finally:
        for group in (source, target):
            if group is not None:
                group.close()


def test_without_the_peers_weights_layer_0_stays_mapped_and_translation_goes_on(cluster, tmp_path):
    """``first_layer`` "exact" on a host that has the peer's config and tokenizer but not its
    weights: the reason is counted once, and B translates as with layer 0 mapped (its pool is
    the pack's map, every layer)."""
    import shutil

    names = cluster.deployment["names"]
    bare = tmp_path / "a-without-weights"
    shutil.copytree(names[0], bare, ignore=shutil.ignore_patterns("*.safetensors"))
    prompt = tokens(3 * PAGE + 3, seed=62)
    a = cluster.engine(0, translate=False)
    sent = a.serve(prompt)
    extra = cluster.extra(1, first_layer="exact")
    extra["peers"][0]["model_path"] = str(bare)
    b = Engine(cluster.deployment["models"][1], names[1], extra, **UNTIMED)
    cluster.engines.append(b)
    served = b.serve(prompt)
    assert b.storage.counters["fallback.first_layer_unavailable"] == 1
    assert "first_layer_exact_tokens" not in b.storage.counters
    assert_swap(b, served, a, sent, cluster.mapper(0, 1), prompt, 0, 3 * PAGE)


def test_tensor_parallel_ranks_serve_their_heads_of_the_exact_first_layer(two_head_pair, tmp_path):
    """``first_layer`` "exact" with the source at TP 2 (its layer-0 values joined from both
    ranks to read the token ids back) and the target at TP 4 (each head on 2 ranks): every
    rank's layer 0 is its heads of the target's own layer-0 K/V of the prompt, and every other
    layer its heads of the pack's map."""
    from sgl_kvmap.models.capture import first_layer_kv
    from sgl_kvmap.sglang.engine import TPGroup
    from sgl_kvmap.sglang.heads import rank_heads

    names, models, pack = two_head_pair
    store = str(tmp_path / "store")
    off = sglang_extra_config(StorageSettings(interface_v1=True), store)
    translating = StorageSettings(
        translate=True,
        interface_v1=True,
        peers=(PeerSettings(names[0], pack, tp_size=2),),
        tail_pages=0,
        quality_floor=None,
        sinks="translate",
        first_layer="exact",
    )
    prompt = tokens(3 * PAGE + 3, seed=31)
    source, target = TPGroup(models[0], names[0], off, 2, **UNTIMED), None
    try:
        sent = source.serve(prompt)
        target = TPGroup(models[1], names[1], sglang_extra_config(translating, store), 4, **UNTIMED)
        served = target.serve(prompt)
        source_kv = source.pool_kv([s.slots[: 3 * PAGE] for s in sent])
        want = KVMapper.from_pretrained(pack).map(source_kv, fast_matmul_dtype("cpu"))
        own = first_layer_kv(models[1].model, torch.tensor(prompt[: 3 * PAGE]))
        for rank, (engine, got) in enumerate(zip(target.ranks, served)):
            heads = rank_heads(2, 4, rank)
            assert engine.storage.counters["first_layer_exact_tokens"] == 3 * PAGE
            pool = engine.pool_kv(got.slots[: 3 * PAGE])
            for g, w in ((pool.keys[0], own[0]), (pool.values[0], own[1])):
                torch.testing.assert_close(g, w[:, heads].to(g.dtype), rtol=0.01, atol=0.01)
            for g, w in zip(pool.keys[1:] + pool.values[1:], want.keys[1:] + want.values[1:]):
                torch.testing.assert_close(g, w[:, heads], rtol=0, atol=0)
    finally:
        for group in (source, target):
            if group is not None:
                group.close()


def test_a_tail_of_pages_is_left_for_the_target_to_compute(cluster):
    """``tail_pages``: the last pages of a translatable run are computed by the target itself
    (its own KV there), the rest translated at their true positions."""
    prompt = tokens(5 * PAGE + 3, seed=27)
    a, b = cluster.engine(0, translate=False), cluster.engine(1, tail_pages=2)
    sent = a.serve(prompt)
    served = b.serve(prompt)
    assert served.reused == 3 * PAGE and b.storage.counters["translated_pages_delivered"] == 3
    assert_swap(b, served, a, sent, cluster.mapper(0, 1), prompt, 0, 3 * PAGE)


def test_an_unknown_host_layout_starts_the_engine_without_translation(cluster):
    """A host pool whose pages sgl-kvmap cannot read (here SGLang's page_unified layout) turns
    translation off with a logged reason; the server starts."""
    engine = Engine(
        cluster.deployment["models"][1],
        cluster.deployment["names"][1],
        cluster.extra(1),
        layout="page_unified",
        **UNTIMED,
    )
    cluster.engines.append(engine)
    assert engine.storage.counters["fallback.pool_unsupported"] == 1
    assert engine.storage.peers == [] and engine.storage.identity is None


def test_an_mla_pool_switches_translation_off_and_its_pages_are_still_stored(cluster):
    """KVMapStorage built by SGLang's factory for an MLA model gets a real MLA host pool (one
    latent per token, no per-head K and V): translation is off with a logged reason, and the
    engine's own pages are stored and read back through the inner store as without sgl-kvmap.
    Substituted: the host pool is built directly (unpinned) instead of by the cache's factory."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    device = MLATokenToKVPool(
        size=64,
        page_size=PAGE,
        dtype=torch.bfloat16,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
        start_layer=0,
        end_layer=2,
    )
    with host_memory_budget_scope(1 << 28):
        host = MLATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info,
            2.0,
            0,
            PAGE,
            "page_first",
            pin_memory=False,
            device_capacity_tokens=64,
            start_layer=0,
            end_layer=2,
            target_layer_num=2,
        )
    config = hicache_storage_config("mla-model", cluster.extra(1), is_mla_model=True)
    storage = StorageBackendFactory.create_backend("dynamic", config, host)
    storage.register_mem_pool_host(host)
    assert storage.counters["fallback.pool_unsupported"] == 1 and storage.peers == []
    slots = host.alloc(2 * PAGE)
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape))  # every slot distinct
    keys = ["k" * 64, "e" * 64]
    info = HiCacheStorageExtraInfo(prefix_keys=[])
    assert storage.batch_set_v1(keys, slots, info) == [True, True]
    back = host.alloc(2 * PAGE)
    assert not torch.equal(host.get_data_page(int(back[0])), host.get_data_page(int(slots[0])))
    assert storage.batch_exists(keys, info) == 2
    assert storage.batch_get_v1(keys, back, info) == [True, True]
    assert torch.equal(host.get_data_page(int(back[PAGE])), host.get_data_page(int(slots[PAGE])))


# -- the defects a review against SGLang's real control flow found (issue 30) ---------------


def timed_engine(cluster, i: int, base: float, **settings) -> Engine:
    """Engine i under SGLang's ``timeout`` prefetch policy (what ``sglang-args`` emits), with a
    deadline of ``base`` seconds whatever the length."""
    extra = {
        **cluster.extra(i, **settings),
        "prefetch_timeout_base": base,
        "prefetch_timeout_per_ki_token": 0.0,
    }
    engine = Engine(cluster.deployment["models"][i], cluster.deployment["names"][i], extra,
                    prefetch_threshold=PAGE)  # fmt: skip
    cluster.engines.append(engine)
    return engine


def slow_translation(monkeypatch, seconds: float) -> None:
    """Every translation a KVMapStorage worker runs takes ``seconds`` longer (sgl-kvmap's own
    ``translate_run`` wrapped with a sleep: a large pair on a busy machine, in miniature)."""
    import sgl_kvmap.sglang.storage as storage

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return translate_run(*args, **kwargs)

    from sgl_kvmap.sglang.translation import translate_run

    monkeypatch.setattr(storage, "translate_run", slow)


def test_a_translation_the_deadline_cuts_leaves_the_targets_own_pages_storable(
    cluster, monkeypatch
):
    """A translation that misses SGLang's prefetch deadline is not delivered, counts as a
    deadline fallback, and marks nothing: the target prefills the prompt itself and stores its
    own exact pages, which an engine serving exact pages only then reuses."""
    slow_translation(monkeypatch, seconds=2.0)
    prompt = tokens(4 * PAGE + 3, seed=40)
    cluster.engine(0, translate=False).serve(prompt)
    b = timed_engine(cluster, 1, base=0.5)
    served = b.serve(prompt)
    assert served.reused == 0
    assert b.storage.counters["fallback.deadline"] == 1
    assert b.storage.counters["translated_pages_delivered"] == 0
    assert len(cluster.files(1)) == 4
    assert cluster.engine(1, translate=False).serve(prompt).tiers.storage == 4 * PAGE


def test_slow_swaps_translate_side_by_side_and_never_hold_up_a_native_prefetch(
    cluster, monkeypatch
):
    """Two swaps whose translations take 3 s each and a native prefetch arrive together at an
    engine whose deadline is 5 s: the swaps are translated concurrently (a worker each, started
    at the hit query), so both land, and the native prefetch behind them on SGLang's single I/O
    thread is not held past its deadline."""
    slow_translation(monkeypatch, seconds=3.0)
    one, two, mine = (tokens(4 * PAGE + 3, seed=s) for s in (41, 42, 43))
    a = cluster.engine(0, translate=False)
    a.serve(one)
    a.serve(two)
    cluster.engine(1, translate=False).serve(mine)  # the target's own pages of ``mine``
    b = timed_engine(cluster, 1, base=5.0)
    arrivals = [b.arrive(prompt) for prompt in (one, two, mine)]
    served = [b.complete(arrival) for arrival in arrivals]
    assert [s.reused for s in served] == [4 * PAGE] * 3
    assert b.storage.counters["translated_pages_delivered"] == 8
    assert b.storage.counters["native_pages"] == 4
    assert_logits_over_pool(b, served[1], two)


def test_the_transfer_uses_the_peer_whose_run_the_hit_query_promised(cluster, deployment):
    """With two peers, the first holding 2 pages of the prompt and the second 5, the hit query
    promises the second's 5 and the transfer delivers those 5, translated from that peer."""
    prompt = tokens(5 * PAGE + 3, seed=44)
    names, packs = deployment["names"], deployment["packs"]
    short = cluster.engine(0, translate=False)
    short.serve(prompt[: 2 * PAGE + 1])
    twin = Engine(deployment["models"][0], "twin-of-a", cluster.extra(0, translate=False,
                  model_path=names[0]), **UNTIMED)  # fmt: skip
    cluster.engines.append(twin)
    sent = twin.serve(prompt)
    peers = (
        PeerSettings(names[0], packs[0, 1]),
        PeerSettings("twin-of-a", packs[0, 1], model_path=names[0]),
    )
    ours = StorageSettings(
        translate=True,
        interface_v1=True,
        peers=peers,
        tail_pages=0,
        quality_floor=None,
        sinks="translate",
    )
    b = Engine(deployment["models"][1], names[1], sglang_extra_config(ours, str(cluster.store)),
               **UNTIMED)  # fmt: skip
    cluster.engines.append(b)
    served = b.serve(prompt)
    assert served.reused == 5 * PAGE
    assert b.storage.counters["translated_pages_delivered"] == 5
    assert_swap(b, served, twin, sent, cluster.mapper(0, 1), prompt, 0, 5 * PAGE)


def test_a_peer_page_lost_after_the_hit_query_ends_the_run_with_its_reason(cluster, monkeypatch):
    """The peer's store loses page 2 right after the hit query read the run's records (its own
    eviction, say): pages 0-1 are delivered, the shortfall is counted as ``peer_page_lost``."""
    from sgl_kvmap.sglang.storage import Peer

    prompt = tokens(5 * PAGE + 3, seed=45)
    cluster.engine(0, translate=False).serve(prompt)
    name = cluster.deployment["names"][0].replace("/", "-")
    lost = cluster.store / f"{page_keys(prompt)[2]}_{name}_0_1.bin"
    read_records = Peer.records

    def records_then_evict(self, *args):
        found = read_records(self, *args)
        lost.unlink(missing_ok=True)
        return found

    monkeypatch.setattr(Peer, "records", records_then_evict)
    b = cluster.engine(1)
    served = b.serve(prompt)
    assert served.reused == 2 * PAGE
    assert b.storage.counters["fallback.peer_page_lost"] == 1
    assert b.storage.counters["translated_pages_delivered"] == 2


def test_pages_written_without_prefix_keys_are_never_stored(cluster):
    """SGLang's PD decode-side offload writes pages without prefix keys
    (``DecodeKVCacheOffloadManager._trigger_backup`` calls ``cache_controller.write_storage``
    with ``hash_value`` only): what they descend from, possibly a prefill server's translated
    prefix, cannot be checked, so none is stored as this model's own. The call is made here as
    that manager makes it, on the engine's own controller and backup thread."""
    b = cluster.engine(1, translate=False)
    prompt = tokens(3 * PAGE, seed=46)
    controller = b.tree.cache_controller
    slots = controller.mem_pool_host.alloc(3 * PAGE)
    controller.write_storage(slots, prompt, hash_value=page_keys(prompt))
    b._pump_until(lambda: b.storage.counters["pages_withheld"] >= 3, timeout=30)
    assert cluster.files(1) == []
    assert b.storage.counters["fallback.prefix_keys_missing"] == 1


def test_pages_of_a_peer_redeployed_with_other_weights_are_not_translated(
    cluster, deployment, tmp_path
):
    """The peer's served name stays, its weights change (another checkpoint of the same
    configuration): the records name other weights than the ones this engine checked the pack
    against, so nothing is translated (``peer_model_changed``)."""
    from .conftest import tiny_model

    names = deployment["names"]
    other = save_loaded(tiny_model("qwen2", seed=7), tmp_path / "a-retrained")
    prompt = tokens(4 * PAGE + 3, seed=47)
    redeployed = Engine(load_model(other), names[0],
                        cluster.extra(0, translate=False, model_path=other), **UNTIMED)  # fmt: skip
    cluster.engines.append(redeployed)
    redeployed.serve(prompt)
    b = cluster.engine(1)
    served = b.serve(prompt)
    assert served.reused == 0
    assert b.storage.counters["fallback.peer_model_changed"] >= 1
    assert b.storage.counters["translated_pages_delivered"] == 0


def test_an_engine_never_evicts_a_peers_files(cluster, deployment):
    """A free-space watermark on one engine's store (here one no disk can meet) evicts only
    that engine's own files: the peer's pages, which it reads, stay."""
    prompt = tokens(4 * PAGE + 3, seed=48)
    cluster.engine(0, translate=False).serve(prompt)
    before = sorted(cluster.files(0))
    extra = {**cluster.extra(1), "min_free_space": 1 << 60}
    b = Engine(deployment["models"][1], deployment["names"][1], extra, **UNTIMED)
    cluster.engines.append(b)
    assert sorted(cluster.files(0)) == before and len(before) == 4


def test_one_size_bound_covers_an_engines_pages_and_their_records(cluster, deployment):
    """``max_size`` bounds everything an engine stores, its pages and their records together."""
    page_bytes = 2 * PAGE * 4 * 1 * 32 * 2  # K and V, 4 layers x 1 head x 32 dims, bfloat16
    cap = 10 * page_bytes
    extra = {**cluster.extra(1, translate=False), "max_size": cap}
    b = Engine(deployment["models"][1], deployment["names"][1], extra, **UNTIMED)
    cluster.engines.append(b)
    for seed in range(4):
        b.serve(tokens(4 * PAGE + 1, seed=50 + seed))
    name = deployment["names"][1].replace("/", "-")
    own = [f for f in os.listdir(cluster.store) if f.endswith(f"_{name}_0_1.bin")]
    assert len(own) > 10  # pages and records were stored, and some evicted
    assert sum((cluster.store / f).stat().st_size for f in own) <= cap


def test_each_record_is_read_once_per_swap(cluster, monkeypatch):
    """The hit query reads each record of the run once; the transfer reads no record again,
    and each page once."""
    from sgl_kvmap.sglang.records import RECORD_SUFFIX

    prompt = tokens(5 * PAGE + 3, seed=49)
    cluster.engine(0, translate=False).serve(prompt)
    b = cluster.engine(1)
    store = b.storage.peers[0].stores[0]
    reads = []
    original = store.get
    monkeypatch.setattr(
        store, "get", lambda key, *a, **k: reads.append(key) or original(key, *a, **k)
    )
    assert b.serve(prompt).reused == 5 * PAGE
    keys = page_keys(prompt)[:5]
    assert sorted(reads) == sorted([k + RECORD_SUFFIX for k in keys] + keys)


def test_the_provenance_ledger_is_bounded_by_the_host_pool(cluster):
    """The ledger of delivered translations holds at most a few times the host pool's pages."""
    b = cluster.engine(1)
    host = b.tree.cache_controller.mem_pool_host
    assert b.storage.provenance.capacity == 4 * (host.size // host.page_size)


def test_the_counters_reach_the_stats_file_and_audited_pages_equal_the_translation(cluster):
    """With ``stats_path`` the engine's counters are in its JSON file as they change; with
    ``audit_translations`` every translated page it received is in its store under the page's
    key plus ``.translated``, equal to the pack's map of the sender's stored KV."""
    import json

    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    prompt = tokens(4 * PAGE + 3, seed=51)
    a = cluster.engine(0, translate=False)
    sent = a.serve(prompt)
    stats = cluster.store.parent / "stats"
    b = cluster.engine(1, stats_path=str(stats), audit_translations=True)
    b.serve(prompt)
    name = cluster.deployment["names"][1].replace("/", "-")
    written = json.loads((stats / f"{name}_0_1.json").read_text())["counters"]
    assert written["translated_pages_delivered"] == 4
    reader = HiCacheFile(b.storage.storage_config)
    page = b.storage.page
    want = cluster.mapper(0, 1).map(a.pool_kv(sent.slots[: 4 * PAGE]), fast_matmul_dtype("cpu"))
    for i, key in enumerate(page_keys(prompt)[:4]):
        flat = reader.get(key + ".translated", page.empty_page())
        got = page.to_tokens(flat)  # [2, page, layers, heads, dim]
        for layer in range(page.layers):
            torch.testing.assert_close(
                got[0, :, layer], want.keys[layer][i * PAGE : (i + 1) * PAGE], rtol=0, atol=0
            )
            torch.testing.assert_close(
                got[1, :, layer], want.values[layer][i * PAGE : (i + 1) * PAGE], rtol=0, atol=0
            )


def test_a_hit_below_sglangs_prefetch_threshold_starts_no_translation(cluster):
    """SGLang revokes a storage hit below its prefetch threshold: a peer run that short is not
    translated at all (no job holds a worker for pages SGLang will not take)."""
    prompt = tokens(12 * PAGE + 1, seed=52)
    cluster.engine(0, translate=False).serve(prompt[: 3 * PAGE + 1])
    name, extra = cluster.deployment["names"][1], cluster.extra(1)
    b = Engine(cluster.deployment["models"][1], name, extra,
               prefetch_threshold=8 * PAGE, prefetch_policy="wait_complete")  # fmt: skip
    cluster.engines.append(b)
    assert b.serve(prompt).reused == 0
    assert b.storage.jobs.busy() == 0 and not b.storage._staged
    assert b.storage.counters["translated_pages_delivered"] == 0


def test_the_exact_first_layer_is_the_targets_own_and_the_other_layers_the_packs(cluster):
    """With ``first_layer`` "exact" the translated tokens' layer 0 in B's pool is B's model's
    own (its first-layer K/V of the prompt at their positions, in the pool's bfloat16): the
    token ids read back from A's stored layer-0 values; every other layer is the pack's map of
    A's stored KV, bit for bit; every translated token is counted as read back."""
    from sgl_kvmap.models.capture import first_layer_kv

    prompt = tokens(4 * PAGE + 3, seed=61)
    a = cluster.engine(0, translate=False)
    sent = a.serve(prompt)
    b = cluster.engine(1, first_layer="exact")
    served = b.serve(prompt)
    assert served.reused == 4 * PAGE
    assert b.storage.counters["first_layer_exact_tokens"] == 4 * PAGE
    assert b.storage.counters["first_layer_mapped_tokens"] == 0
    want = cluster.mapper(0, 1).map(a.pool_kv(sent.slots[: 4 * PAGE]), fast_matmul_dtype("cpu"))
    got = b.pool_kv(served.slots[: 4 * PAGE])
    own_keys, own_values = first_layer_kv(b.model.model, torch.tensor(prompt[: 4 * PAGE]))
    torch.testing.assert_close(got.keys[0], own_keys.to(got.keys[0].dtype), rtol=0.01, atol=0.01)
    torch.testing.assert_close(
        got.values[0], own_values.to(got.values[0].dtype), rtol=0.01, atol=0.01
    )
    assert not torch.equal(got.keys[0], want.keys[0])
    for layer in range(1, len(got.keys)):
        torch.testing.assert_close(got.keys[layer], want.keys[layer], rtol=0, atol=0)
        torch.testing.assert_close(got.values[layer], want.values[layer], rtol=0, atol=0)
    assert_logits_over_pool(b, served, prompt)
