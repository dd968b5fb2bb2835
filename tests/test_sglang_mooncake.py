"""KVMapStorage over a real Mooncake store (issue 32): a ``mooncake_master`` with its HTTP metadata
server on free ports of 127.0.0.1, and the source and target engines as separate OS processes
(as on two hosts), each with its own Mooncake client (tests/mooncake_servers.py). Each engine is
sgl_kvmap.sglang.engine.Engine: SGLang's radix tree, cache controller and storage threads, driven
through the scheduler's calls; its substitutions (CUDA copies, unpinned host pool) are listed
there. Nothing of Mooncake is substituted; the pages and records are put and got over TCP.

The swap is checked against the file store path (tests/test_sglang_storage.py's engines, in this
process): the target's device pool holds the same KV, bit for bit. Faults are real: the master is
killed and restarted, a segment too small for the trace evicts pages, objects are removed through
a third client (also once a lease has run out), a master that does not answer refuses the engine
at start-up.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from safetensors.torch import load_file

from sgl_kvmap.core.cache import KVCache
from sgl_kvmap.core.errors import KVMapError
from sgl_kvmap.core.mapper import KVMapper
from sgl_kvmap.kernels import fast_matmul_dtype
from sgl_kvmap.sglang import PeerSettings, StorageSettings
from sgl_kvmap.sglang.engine import PAGE, page_keys
from sgl_kvmap.sglang.launch import sglang_extra_config
from sgl_kvmap.sglang.mooncake import COOLDOWN_SECONDS
from sgl_kvmap.sglang.mooncake_master import Master, library_env, unavailable

from .mooncake_servers import SEGMENT, EngineProcess
from .test_sglang_storage import UNTIMED, Cluster, tokens
from .test_sglang_storage import two_head_pair as _two_head_pair  # noqa: F401 (a fixture)

needs_mooncake = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

# SGLang's timeout policy (its deadline: 1 s base + 0.25 s per 1K tokens), and prefetches of a
# few pages (SGLang's threshold is 256 tokens).
TIMED = {"prefetch_threshold": PAGE, "prefetch_policy": "timeout"}
DEADLINE = 1.0 + 0.25 * 8 * PAGE / 1024


@pytest.fixture
def master(tmp_path):
    master = Master(tmp_path / "master.log")
    yield master
    master.kill()


class Hosts:
    """Engines of ``served_pair``'s "a" and "b" in processes of their own over ``master``. They
    may translate a prefix's first page (``sinks: translate``): the scenarios swap into fresh
    engines, as tests/test_sglang_storage.py's do."""

    def __init__(self, deployment, master: Master, tmp_path):
        self.deployment, self.master, self.tmp, self.engines = deployment, master, tmp_path, []

    def extra(self, i: int, translate: bool, segment: int | None = None) -> dict:
        names, other = self.deployment["names"], 1 - i
        peer = PeerSettings(names[other], str(self.deployment["packs"][other, i]))
        settings = StorageSettings(
            inner_backend="mooncake",
            translate=translate,
            peers=(peer,),
            interface_v1=True,
            tail_pages=0,
            quality_floor=None,
            sinks="translate",
        )
        keys = self.master.extra(segment or SEGMENT)
        return sglang_extra_config(settings, "", store_keys=keys)

    def engine(
        self, i: int, translate: bool = True, timed=False, segment=None, read_pause=None
    ) -> EngineProcess:
        spec = {
            "model_path": self.deployment["names"][i],
            "name": self.deployment["names"][i],
            "extra": self.extra(i, translate, segment),
            "engine": TIMED if timed else UNTIMED,
            "read_pause": read_pause,
        }
        engine = EngineProcess(spec, self.tmp / f"engine{len(self.engines)}.log")
        self.engines.append(engine)
        return engine

    def mapper(self, source: int, target: int) -> KVMapper:
        return KVMapper.from_pretrained(self.deployment["packs"][source, target])


@pytest.fixture
def hosts(served_pair, master, tmp_path):
    hosts = Hosts(served_pair, master, tmp_path)
    yield hosts
    for engine in hosts.engines:
        engine.close()


def read_kv(path) -> KVCache:
    tensors = load_file(path)
    layers = len(tensors) // 2
    keys = [tensors[f"k{i}"] for i in range(layers)]
    values = [tensors[f"v{i}"] for i in range(layers)]
    return KVCache(keys, values, torch.arange(keys[0].shape[0]))


def assert_same_kv(got: KVCache, want: KVCache) -> None:
    for g, w in zip(got.keys + got.values, want.keys + want.values, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@needs_mooncake
def test_a_swap_across_processes_translates_the_same_kv_as_the_file_store(
    hosts, served_pair, tmp_path
):
    """Engine "a" stores a session's pages and records in Mooncake from its process; engine "b",
    in another process with its own client, translates every full page at its true position:
    its pool holds the pack's translation of what "a" stored, and exactly the KV the file store
    path gives (no file is written)."""
    prompt = tokens(5 * PAGE + 3, seed=1)
    a, b = hosts.engine(0, translate=False), hosts.engine(1)
    sent = a.serve(prompt, tmp_path / "a.safetensors")
    served = b.serve(prompt, tmp_path / "b.safetensors")
    assert sent["counters"]["stored_pages"] == 5 and sent["reused"] == 0
    assert served["reused"] == 5 * PAGE and served["tiers"]["translated"] == 5 * PAGE
    assert served["counters"]["translated_pages_delivered"] == 5
    assert not any(k.startswith("fallback.") for k in served["counters"])
    source = read_kv(tmp_path / "a.safetensors")
    got = read_kv(tmp_path / "b.safetensors")
    window = slice(0, 5 * PAGE)
    sent_kv = KVCache(
        [k[window] for k in source.keys], [v[window] for v in source.values], torch.arange(5 * PAGE)
    )
    want = hosts.mapper(0, 1).map(sent_kv, fast_matmul_dtype("cpu"))
    assert_same_kv(
        KVCache([k[window] for k in got.keys], [v[window] for v in got.values], want.positions),
        want,
    )
    shifted = hosts.mapper(0, 1).map(dataclasses.replace(sent_kv, positions=sent_kv.positions + 1))
    assert not torch.equal(shifted.keys[0], want.keys[0])  # so the positions were checked
    assert not list(tmp_path.glob("**/*.bin"))  # pages and records live in Mooncake only
    assert_same_kv(got, file_store_swap(served_pair, tmp_path / "files", prompt))


def file_store_swap(deployment, store, prompt) -> KVCache:
    """Target "b"'s pool KV of ``prompt`` after the same swap over the file store, in-process."""
    cluster = Cluster(deployment, store)
    try:
        cluster.engine(0, translate=False).serve(prompt)
        b = cluster.engine(1)
        return b.pool_kv(b.serve(prompt).slots)
    finally:
        for engine in cluster.engines:
            engine.close()


@needs_mooncake
def test_the_master_killed_mid_run_is_a_counted_fallback_and_its_restart_translates_again(
    hosts, master
):
    """With the master killed, the target's requests are admitted within SGLang's prefetch
    deadline plus one failing store call (then the client cools down), prefilled and counted;
    once it is restarted (empty), the engines' clients reconnect and a newly stored session is
    translated again."""
    a, b = hosts.engine(0, translate=False, timed=True), hosts.engine(1, timed=True)
    first, second, third = tokens(3 * PAGE, 11), tokens(3 * PAGE, 12), tokens(3 * PAGE, 13)
    a.serve(first)
    assert b.serve(first)["tiers"]["translated"] > 0  # (the deadline may cut a cold process's)
    a.serve(second)
    master.kill()
    down = b.serve(second)
    assert down["reused"] == 0
    assert down["counters"].get("fallback.store_error", 0) >= 1
    assert down["seconds"] < DEADLINE + STORE_ERROR_SECONDS
    master.start()
    time.sleep(RECONNECT_SECONDS + COOLDOWN_SECONDS)
    stored = a.serve(third)["counters"]["stored_pages"]
    back = b.serve(third)
    assert stored >= 6 and back["tiers"]["translated"] > 0, back


STORE_ERROR_SECONDS = 6.0  # Mooncake's client retries a dead master's RPC a few seconds
RECONNECT_SECONDS = 3.0  # the clients find a restarted master on their next heartbeat


@needs_mooncake
def test_a_segment_too_small_for_the_trace_evicts_pages_and_the_swap_falls_back_counted(
    served_pair, tmp_path
):
    """A master whose objects' leases end after 100 ms and which evicts once its segments are 4 %
    full (Mooncake's smallest segment, 16 MiB, holds more than these tiny models store): storing
    a trace of sessions evicts pages (before their soft-pinned records); the target's swap of a
    session that lost a page before any record prefills from there, counted, and completes.
    Which objects Mooncake evicts is its choice: a third client finds such a session."""
    master = Master(
        tmp_path / "master.log",
        "--default_kv_lease_ttl=100",
        "--eviction_ratio=0.5",
        "--eviction_high_watermark_ratio=0.04",
    )
    hosts = Hosts(served_pair, master, tmp_path)
    try:
        a = hosts.engine(0, translate=False, segment=SMALL_SEGMENT)
        b = hosts.engine(1, segment=SMALL_SEGMENT)
        trace = [tokens(SESSION, 100 + i) for i in range(TRACE_SESSIONS)]
        for prompt in trace:
            a.serve(prompt)
        client = remover(master)
        prompt, page = session_that_lost_a_page(client, served_pair, trace)
        client.close()
        served = b.serve(prompt)
        assert served["tiers"]["translated"] == page * PAGE
        assert served["counters"]["fallback.peer_page_lost"] >= 1
    finally:
        for engine in hosts.engines:
            engine.close()
        master.kill()


def session_that_lost_a_page(client, deployment, trace) -> tuple[list[int], int]:
    """A session of ``trace`` and its first page lost (``first_page_lost``), waiting for the
    master's eviction thread, which runs in the background."""
    deadline = time.monotonic() + EVICTION_SECONDS
    while True:
        for prompt in trace:
            page = first_page_lost(client, deployment, prompt)
            if page is not None:
                return prompt, page
        assert time.monotonic() < deadline, "the master evicted no page before its record"
        time.sleep(0.5)


EVICTION_SECONDS = 20.0


def first_page_lost(client, deployment, prompt) -> int | None:
    """The first page of ``prompt`` whose K or V half is gone while its record and every
    earlier page and record are there (None: no such page)."""
    for page in range(SESSION // PAGE - 1):  # SGLang asks for all but the last page
        names = [object_name(deployment, prompt, page, s) for s in ("_0_k", "_0_v", ".kvmap_0")]
        k, v, record = client.batch_is_exist(names)
        if record != 1:
            return None
        if k != 1 or v != 1:
            return page
    return None


SMALL_SEGMENT = 16 << 20  # bytes: Mooncake refuses to mount less
SESSION, TRACE_SESSIONS = 8 * PAGE, 60  # 1,440 objects of ~1.5 KiB: past 4 % of two segments


def remover(master: Master, segment: int = 0):
    """A third Mooncake client, in this process, to remove objects as an operator (or Mooncake's
    eviction) would; mounting ``segment`` bytes of the store."""
    import os

    from sgl_kvmap.sglang.mooncake import load_client

    os.environ.update(library_env())
    client = load_client()()
    setup = ("127.0.0.1", master.metadata, segment, 16 << 20, "tcp", "", master.address)
    assert client.setup(*setup) == 0
    return client


def object_name(deployment, prompt, page: int, suffix: str) -> str:
    prefix = "-".join(deployment["names"][0].split("/"))
    return f"{prefix}_{page_keys(prompt)[page]}{suffix}"


@needs_mooncake
def test_a_page_without_its_record_and_a_record_without_its_page_end_the_run_counted(
    hosts, master, served_pair
):
    """In one session page 2's record, in another page 2's K half, removed from the store: the
    pages before it are translated, the rest prefilled, each reason counted."""
    a, b = hosts.engine(0, translate=False), hosts.engine(1)
    cases = [(".kvmap_0", "record_missing", 21), ("_0_k", "peer_page_lost", 22)]
    prompts = [tokens(4 * PAGE, seed) for _, _, seed in cases]
    for prompt in prompts:
        a.serve(prompt)
    client = remover(master)
    for (removed, _, _), prompt in zip(cases, prompts):
        assert client.remove(object_name(served_pair, prompt, 2, removed), True) == 0
    client.close()
    for (_, reason, _), prompt in zip(cases, prompts):
        served = b.serve(prompt)
        assert served["reused"] == 2 * PAGE
        assert served["counters"].get(f"fallback.{reason}", 0) >= 1, served["counters"]


@needs_mooncake
def test_a_lease_that_runs_out_between_the_hit_query_and_the_read_is_a_counted_fallback(
    served_pair, tmp_path
):
    """The target's hit query asks for the source's pages, which leases them: on a master whose
    leases last 1 s, an operator's remove of page 2 (not forced: like the master's eviction, it
    takes only objects without a lease) is refused right after the hit query and succeeds once
    the lease has run out, while the target's job waits to read the pages (a slow transfer).
    The job then finds page 2 gone: pages 0-1 are translated, the rest prefilled, counted, and
    the request completes."""
    master = Master(tmp_path / "master.log", f"--default_kv_lease_ttl={LEASE_MS}")
    hosts = Hosts(served_pair, master, tmp_path)
    try:
        a = hosts.engine(0, translate=False)
        b = hosts.engine(1, read_pause=READ_PAUSE_SECONDS)
        prompt = tokens(4 * PAGE, seed=31)
        a.serve(prompt)
        client = remover(master)
        page = object_name(served_pair, prompt, 2, "_0_k")
        b.send(prompt)
        b.paused()
        assert client.remove(page, False) == OBJECT_HAS_LEASE
        assert removed_once_unleased(client, page, within=READ_PAUSE_SECONDS / 2)
        client.close()
        served = b.answer()
        assert served["reused"] == 2 * PAGE and served["tiers"]["translated"] == 2 * PAGE
        assert served["counters"]["fallback.peer_page_lost"] == 1
        assert served["counters"]["translated_pages_delivered"] == 2
    finally:
        for engine in hosts.engines:
            engine.close()
        master.kill()


LEASE_MS = 1000
READ_PAUSE_SECONDS = 4.0
OBJECT_HAS_LEASE = -706  # Mooncake's error code for removing a leased object


def removed_once_unleased(client, name: str, within: float) -> bool:
    """Remove ``name`` (not forced) as soon as its lease lets the master do it."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if client.remove(name, False) == 0:
            return True
        time.sleep(0.05)
    return False


@needs_mooncake
def test_a_page_and_a_record_stored_again_read_back_as_the_new_values(master):
    """Mooncake's put keeps an existing object's old value; a page stored again (recomputed
    after its first copy was evicted, say) beside its new record would then read as damaged.
    The keyspace upserts: the second value of a page (both halves) and of a record is read."""
    from sgl_kvmap.sglang.mooncake import Keyspace

    keyspace = Keyspace(remover(master, SMALL_SEGMENT), "model", 0)
    first, second = torch.arange(64, dtype=torch.bfloat16), -torch.arange(64, dtype=torch.bfloat16)
    try:
        for key in ("page", "page.kvmap"):
            assert keyspace.batch_set([key], [first]) and keyspace.batch_set([key], [second])
            assert torch.equal(keyspace.get(key, torch.empty_like(second)), second)
    finally:
        keyspace.client.close()


@needs_mooncake
def test_a_master_that_does_not_answer_refuses_the_engine_in_one_line(hosts, master):
    master.kill()
    with pytest.raises(RuntimeError) as refused:
        hosts.engine(1)
    message = str(refused.value)
    assert "does not answer" in message and master.address in message and "\n" not in message


def test_3fs_stays_refused_with_a_clear_line():
    with pytest.raises(KVMapError, match="not supported by sgl-kvmap"):
        StorageSettings(inner_backend="hf3fs")


def test_without_mooncake_an_engine_asking_for_it_gets_one_line(monkeypatch):
    """Mooncake's client not importable (as on a machine without it): one line, what to install."""
    import sys

    from sgl_kvmap.sglang.mooncake import load_client

    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(KVMapError) as refused:
        load_client()
    assert "needs Mooncake's client" in str(refused.value) and "\n" not in str(refused.value)


@needs_mooncake
def test_tensor_parallel_ranks_translate_their_own_heads_over_mooncake(_two_head_pair, master):  # noqa: F811
    """TP 2 on both sides over 2 KV heads: each source rank stores its head's pages and records
    under its rank, each target rank reads the source's heads from the ranks that hold them and
    its pool holds the reference's columns of its own head. The ranks of each engine run in this
    process (a server runs one process per rank), each rank with its own Mooncake client."""
    from sgl_kvmap.sglang.engine import TPGroup
    from sgl_kvmap.sglang.heads import rank_heads

    names, models, pack = _two_head_pair
    keys = master.extra(2 * SEGMENT_PER_RANK)  # SGLang splits it among the ranks

    def extra(settings: StorageSettings) -> dict:
        return sglang_extra_config(settings, "", store_keys=keys)

    off = extra(StorageSettings(inner_backend="mooncake", interface_v1=True))
    peer = PeerSettings(names[0], pack, tp_size=2)
    on = extra(
        StorageSettings(
            inner_backend="mooncake",
            translate=True,
            interface_v1=True,
            peers=(peer,),
            tail_pages=0,
            quality_floor=None,
            sinks="translate",
        )
    )
    prompt = tokens(4 * PAGE + 3, seed=30)
    source, target = TPGroup(models[0], names[0], off, 2, **UNTIMED), None
    try:
        sent = source.serve(prompt)
        target = TPGroup(models[1], names[1], on, 2, **UNTIMED)
        served = target.serve(prompt)
        source_kv = source.pool_kv([s.slots[: 4 * PAGE] for s in sent])
        want = KVMapper.from_pretrained(pack).map(source_kv, fast_matmul_dtype("cpu"))
        for rank, (engine, got) in enumerate(zip(target.ranks, served)):
            heads = rank_heads(2, 2, rank)
            assert got.reused == 4 * PAGE
            assert engine.storage.counters["translated_pages_delivered"] == 4
            pool = engine.pool_kv(got.slots[: 4 * PAGE])
            for g, w in zip(pool.keys + pool.values, want.keys + want.values):
                torch.testing.assert_close(g, w[:, heads], rtol=0, atol=0)
    finally:
        for group in (source, target):
            if group is not None:
                group.close()


SEGMENT_PER_RANK = 16 << 20  # Mooncake refuses to mount less
