"""KVMapStorage against records it must refuse and translations SGLang never used (issue 34),
on the engines of tests/test_sglang_storage.py (SGLang's own radix tree, cache controller and
storage threads, driven through the scheduler's calls)."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch

from sgl_kvmap.sglang.engine import PAGE, page_keys
from sgl_kvmap.sglang.records import RECORD_BYTES, PageRecord

from .test_sglang_storage import Cluster, exact_logits, slow_translation, timed_engine, tokens


@pytest.fixture
def cluster(served_pair, tmp_path):
    """Engines of "a" and "b" over one fresh store (tests/test_sglang_storage.py), closed
    afterwards."""
    cluster = Cluster(served_pair, tmp_path / "store")
    yield cluster
    for engine in cluster.engines:
        engine.close()


def record_file(cluster, prompt: list[int], page: int):
    """The file of the record engine "a" stored beside page ``page`` of ``prompt``."""
    name = cluster.deployment["names"][0].replace("/", "-")
    return cluster.store / f"{page_keys(prompt)[page]}.kvmap_{name}_0_1.bin"


def read_record(path) -> PageRecord:
    return PageRecord.from_tensor(torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8))


def with_fields_changed(path, **fields) -> None:
    """Rewrite the record at ``path`` with JSON ``fields`` changed and its checksum as it was
    (what a writer of another version, or a flipped byte, leaves behind)."""
    parsed = json.loads(path.read_bytes().decode())
    parsed.update(fields)
    path.write_bytes(json.dumps(parsed, sort_keys=True).encode().ljust(RECORD_BYTES))


def assert_refused_and_prefilled(engine, served, prompt, reused: int, reason: str, caplog):
    """The run stopped before the refused record: ``reused`` tokens came translated, the
    reason was counted (never as a translation error, never logged with a traceback) and the
    rest was computed: the logits are the model's own over what it holds."""
    assert served.reused == reused
    assert engine.storage.counters[f"fallback.{reason}"] >= 1
    assert engine.storage.counters["translated_pages_delivered"] == reused // PAGE
    assert engine.storage.counters["fallback.translation_error"] == 0
    assert not any(r.exc_info for r in caplog.records if r.name.startswith("sgl_kvmap"))
    if reused == 0:
        torch.testing.assert_close(served.logits, exact_logits(engine, prompt))


def test_a_record_whose_dtype_was_changed_is_refused_not_read_as_float16(cluster, caplog):
    """Page 2's record says float16 over bfloat16 bytes (its checksum left as it was): the
    record is integrity-checked as a whole, so the page is not read as float16; pages 0-1 are
    translated, the rest computed."""
    prompt = tokens(4 * PAGE + 3, seed=60)
    a, b = cluster.engine(0, translate=False), cluster.engine(1)
    a.serve(prompt)
    path = record_file(cluster, prompt, 2)
    page = read_record(path).page.to_dict()
    assert page["dtype"] == "bfloat16"
    with_fields_changed(path, page={**page, "dtype": "float16"})
    served = b.serve(prompt)
    assert_refused_and_prefilled(b, served, prompt, 2 * PAGE, "record_invalid", caplog)


def test_a_run_recorded_at_index_10_15_is_refused_past_the_models_positions(cluster, caplog):
    """A run whose first record names index 10**15 (a whole, valid record: its checksum is its
    own) sits far past the peer model's 512 positions: refused, counted, nothing translated,
    the prompt computed exactly."""
    prompt = tokens(3 * PAGE + 3, seed=61)
    a, b = cluster.engine(0, translate=False), cluster.engine(1)
    a.serve(prompt)
    path = record_file(cluster, prompt, 0)
    far = dataclasses.replace(read_record(path), index=10**15, parent="f" * 64)
    path.write_bytes(far.to_tensor().numpy().tobytes())
    served = b.serve(prompt)
    assert_refused_and_prefilled(b, served, prompt, 0, "record_invalid", caplog)
    assert f"index {10**15}" in " ".join(r.getMessage() for r in caplog.records)


def records_slowly(monkeypatch, seconds: float) -> None:
    """Every hit query reads the peer's records ``seconds`` later (a slow peer store: the hit
    query, and with it the job's deadline, starts well after SGLang's prefetch clock)."""
    from sgl_kvmap.sglang.storage import Peer

    read = Peer.records

    def slow(self, *args, **kwargs):
        time.sleep(seconds)
        return read(self, *args, **kwargs)

    monkeypatch.setattr(Peer, "records", slow)


def wait_for(condition, timeout: float = 20.0) -> None:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize(
    "case, hit_query_s, translation_s, transfers",
    [
        # SGLang's 2 s deadline passes while its transfer waits for the job; the job finishes
        # within its own deadline (0.8 x 2 s from the late hit query) and is delivered after
        # SGLang cut the prefetch and the engine stored its own pages
        ("delivered after SGLang cut the prefetch", 1.2, 1.2, 1),
        # the deadline passes before the hit query returns: SGLang revokes the prefetch, the
        # job it started is never transferred
        ("revoked before the transfer", 2.4, 0.1, 0),
    ],
)
def test_a_translation_sglang_never_used_withholds_none_of_the_engines_own_pages(
    cluster, monkeypatch, case, hit_query_s, translation_s, transfers
):
    """Issue 34: a translation prepared for a prefetch SGLang cut or revoked is never taken
    into the engine. The engine computes the prompt itself and backs its pages up: they are
    stored as its own, and so is every page the session computes on top of them later; an
    engine that serves exact pages only then finds all of them in storage."""
    records_slowly(monkeypatch, hit_query_s)
    slow_translation(monkeypatch, translation_s)
    prompt = tokens(4 * PAGE + 3, seed=62)
    cluster.engine(0, translate=False).serve(prompt)
    b = timed_engine(cluster, 1, base=2.0)
    transferred, transfer = [], b.storage.batch_get_v1
    b.storage.batch_get_v1 = lambda *args: transferred.append(transfer(*args)) or transferred[-1]
    assert b.serve(prompt).reused == 0
    assert len(cluster.files(1)) == 4  # the engine's own pages, backed up
    wait_for(lambda: b.storage._staged or transferred)  # the hit query has started the job
    wait_for(lambda: all(job.future.done() for job in b.storage._staged.values()))
    wait_for(lambda: len(transferred) == transfers)  # SGLang's transfer has returned, if any
    b._pump_until(lambda: True)
    monkeypatch.undo()  # the next turn's hit query and translations at full speed
    longer = prompt[: 4 * PAGE] + tokens(3 * PAGE + 1, seed=63)
    assert b.serve(longer).reused == 4 * PAGE  # its own pages, from its device tree
    assert b.storage.counters["pages_withheld"] == 0
    assert len(cluster.files(1)) == 7
    exact_only = cluster.engine(1, translate=False)
    assert exact_only.serve(longer).tiers.storage == 7 * PAGE


def page_file(cluster, i: int, prompt: list[int], page: int):
    """The file of page ``page`` of ``prompt`` as engine ``i``'s model stored it."""
    name = cluster.deployment["names"][i].replace("/", "-")
    return cluster.store / f"{page_keys(prompt)[page]}_{name}_0_1.bin"


def test_a_restarted_engine_refuses_its_own_damaged_page_and_computes_from_there(cluster, caplog):
    """Engine "a" stored a prompt; a byte of page 2's file flipped (its record untouched). The
    restarted engine (a fresh Engine of the same model and name over the store, as a server
    restarts) reads pages 0-1 as its own, refuses page 2 by its record's CRC (counted, logged
    once without a traceback) and computes from there, as it does for the prompt's tail."""
    prompt = tokens(4 * PAGE + 3, seed=62)
    cluster.engine(0, translate=False).serve(prompt)
    path = page_file(cluster, 0, prompt, 2)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    restarted = cluster.engine(0, translate=False)
    served = restarted.serve(prompt)
    assert served.reused == 2 * PAGE and served.tiers.storage == 2 * PAGE
    assert restarted.storage.counters["fallback.own_page_damaged"] == 1
    assert restarted.storage.counters["native_pages"] == 2
    assert not any(r.exc_info for r in caplog.records if r.name.startswith("sgl_kvmap"))


def test_a_name_redeployed_with_another_model_reads_none_of_the_old_models_pages(
    cluster, tmp_path, caplog
):
    """Engine "a" stored a prompt; its served name is then redeployed with another checkpoint of
    the same configuration (the same page geometry). The new engine reads none of the old
    model's pages as its own (their records name the old weights) and computes the prompt
    itself, exactly."""
    from sgl_kvmap.models.capture import load_model

    from .conftest import tiny_model
    from .test_sglang_storage import UNTIMED, Engine, save_loaded

    prompt = tokens(3 * PAGE + 3, seed=63)
    cluster.engine(0, translate=False).serve(prompt)
    other = save_loaded(tiny_model("qwen2", seed=7), tmp_path / "a-retrained")
    name = cluster.deployment["names"][0]
    extra = cluster.extra(0, translate=False, model_path=other)
    redeployed = Engine(load_model(other), name, extra, **UNTIMED)
    cluster.engines.append(redeployed)
    served = redeployed.serve(prompt)
    assert served.reused == 0 and redeployed.storage.counters["native_pages"] == 0
    assert redeployed.storage.counters["fallback.own_page_foreign"] == 1
    torch.testing.assert_close(served.logits, exact_logits(redeployed, prompt))
    assert not any(r.exc_info for r in caplog.records if r.name.startswith("sgl_kvmap"))


def test_pages_of_another_geometry_under_an_engines_name_are_refused_not_raised(cluster, caplog):
    """Engine "a"'s page files and records copied under engine "b"'s name (two served names the
    store maps to one, with models of other geometry): "b"'s read of them fails on their size;
    it is counted and "b" computes the prompt itself, exactly, with no error in SGLang's
    transfer."""
    prompt = tokens(3 * PAGE + 3, seed=64)
    cluster.engine(0, translate=False).serve(prompt)
    a_name, b_name = (name.replace("/", "-") for name in cluster.deployment["names"])
    for key in page_keys(prompt)[:3]:
        for suffix in ("", ".kvmap"):
            copied = (cluster.store / f"{key}{suffix}_{a_name}_0_1.bin").read_bytes()
            (cluster.store / f"{key}{suffix}_{b_name}_0_1.bin").write_bytes(copied)
    b = cluster.engine(1, translate=False)
    with caplog.at_level("ERROR"):
        served = b.serve(prompt)
    assert served.reused == 0 and b.storage.counters["native_pages"] == 0
    assert b.storage.counters["fallback.own_page_unreadable"] == 1
    torch.testing.assert_close(served.logits, exact_logits(b, prompt))
    assert not any(r.exc_info for r in caplog.records)
