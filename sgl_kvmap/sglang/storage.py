"""KVMapStorage: a HiCache storage backend that serves other models' pages, translated.

Loaded by SGLang (0.5.23) as a ``dynamic`` HiCache storage backend. It wraps a built-in store
(``file``, or Mooncake across hosts: module ``mooncake``), through which this engine stores and
reads its own pages as usual, and adds:

- Write side: beside every page it stores as its own, a page record (``records``) under the
  page's key plus ``.kvmap`` in the same store: the page's index in its sequence, its parent
  key, its byte format, the writer's model identity (``identity``) and a CRC. SGLang's
  write-through knows the index (it passes the prefix's page keys with every batch); a reader
  does not.
- Read side: when a prefix's next pages are not stored for THIS model but a peer model of the
  same family (same tokenizer, so the same page keys) stored them with records, the hit query
  (``batch_exists``) promises the longest run a peer holds with valid, chained records and
  starts translating it on a worker thread (``jobs``); the transfer (``batch_get_v1``) waits
  for that job, never past its deadline, and copies the translated pages into this engine's
  host slots, in its own layout and head shard.

Rules (docs/sglang.md):
- Native pages always win; translation is off unless the operator enables it.
- Provenance (``provenance``): no page that is, or descends from, a translation this engine
  holds is ever stored as this model's page: translated KV is never served as exact KV. By
  default none becomes the source of a further translation either; an engine set to share
  them (``StorageSettings.derived``) stores the pages it computed over translated KV apart
  (``records.derived_key``), where only a peer's translation reads them. A write without
  prefix keys (PD decode-side offload) cannot be checked and stores nothing.
- Sinks: by default a prefix's first page is never translated (``StorageSettings.sinks``): the
  engine computes it, so a translated opening never becomes the device KV every later
  request reads; a swap whose first page the engine holds nowhere has it computed first
  (``priming``, in the server's TokenizerManager), and the rest translated.
- Quality floor: a peer's pack is used only when the gap closed it records is above the
  operator's floor (``StorageSettings.quality_floor``; by default, better than staying on the
  source model); otherwise none of that peer's pages is translated (``pack_below_floor``).
- Fallback: a missing, damaged or mismatched pack, a page without a record or whose bytes do
  not match it, a record of another model, a peer with another page size or geometry,
  non-finite values read or translated, a failing peer store, a page lost after the hit query,
  a job past its deadline, every worker busy or any translation error makes the page
  unavailable; SGLang then prefills it as if sgl-kvmap were absent. Every reason is counted
  (``counters``, also written to ``stats_path``) and logged once; nothing is raised into the
  scheduler.
- Time: the wall seconds each stage of the path took are summed per stage (``seconds``, in
  ``stats_path`` beside the counters; ``STAGES``), so a caller can split a swap's time.

This module, SGLang's plugin (``plugin``, with ``priming``) and the in-process harness
``engine`` (which drives SGLang's scheduler calls for the tests and the benchmark) are the only
modules that import sglang.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from ..core.errors import KVMapError, PackError, PairMismatchError
from ..core.files import staged_file
from ..core.mapper import KVMapper
from ..core.spec import ModelSpec, check_models, check_pair, spec_from_pretrained
from ..kernels import fast_matmul_dtype
from ..models.first_layer import ExactFirstLayer, first_layer_table
from .heads import rank_heads, ranks_covering_heads
from .identity import DIGITS, identity_config, local_weights_digest, model_identity, split_identity
from .jobs import Job, JobPool
from .pages import PageFormat
from .plugin import registered
from .priming import Primer
from .provenance import Provenance, Verdict
from .records import PageRecord, derived_key, page_crc32, record_key, stored_record
from .settings import NATIVE_SINKS, PeerSettings, StorageSettings
from .translation import staging, translate_run

log = logging.getLogger(__name__)

AUDIT_SUFFIX = ".translated"  # audit copies of translated pages: key + this, in this engine's store
DEADLINE_SHARE = 0.8  # of SGLang's prefetch deadline a job may take (its clock starts earlier)
LEDGER_PER_HOST_PAGE = 4  # provenance ledger entries per host-pool page
NO_WEIGHTS = "0" * 64  # the weights digest of a model folder without weight files
_NO_EVICTION = {"max_size": 0, "min_free_space": 0}  # a reader never evicts a peer's files
STAGES = {  # KVMapStorage.seconds: the wall seconds of each stage, summed over its calls
    "hit_query": "the hit query (batch_exists): this engine's own pages, the peers' records, "
    "the job's start",
    "read": "a worker reading the peer's pages and checking them against their records",
    "map": "a worker translating them (translation.translate_run)",
    "wait": "the transfer (batch_get_v1) waiting for its job to finish",
    "write": "the transfer copying translated pages into the host pool",
    "native": "the transfer copying this engine's own stored pages into the host pool",
}


class _Skip(Exception):
    """A page that cannot be translated; ``reason`` is counted as ``fallback.<reason>``."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclasses.dataclass
class Translated:
    """A job's result: this engine's pages of the run's leading pages (flat, in its format)
    and their CRC-32s; ``short``: why the run stopped before its last page, if it did."""

    pages: list[torch.Tensor]
    crcs: list[int]
    short: _Skip | None = None


class StoredPage(NamedTuple):
    """A peer's page as a run holds it: name: its store key (the page's key, or its
    ``derived_key`` for a page the peer computed over translated KV); records: its record from
    each of the peer's ranks that hold it."""

    name: str
    records: dict[int, PageRecord]


@dataclasses.dataclass
class Peer:
    """A peer engine whose stored pages this engine translates.

    ranks: the peer's TP ranks whose pages hold each of its KV heads once (head order);
    stores: the store of each of those ranks (its pages and their records); mapper: the pair's
    mapper, restricted to this rank's target heads and moved to ``device``; weights: the digest
    its records must name for the peer's weights (``identity``: from the peer's model folder
    when this host has its weight files, else pinned to the first record read); first_layer:
    the tables that give translated tokens this engine's exact layer 0 (None: mapped);
    derived: also translate the pages the peer computed over translated KV and stored apart."""

    settings: PeerSettings
    spec: ModelSpec
    ranks: list[int]
    stores: dict[int, HiCacheStorage]
    mapper: KVMapper
    device: torch.device
    weights: str | None
    first_layer: ExactFirstLayer | None = None
    derived: bool = False

    @property
    def name(self) -> str:
        return self.settings.model_name

    def expected_format(self, rank: int, page_size: int) -> tuple:
        heads = len(rank_heads(self.spec.num_kv_heads, self.settings.tp_size, rank))
        return (page_size, self.spec.num_layers, heads, self.spec.head_dim)

    def records(self, keys: list[str], page_size: int) -> tuple[list[StoredPage], _Skip | None]:
        """The leading ``keys`` every rank has stored with its record, each record checked
        against what this pair needs, and why they stop before the peer's last page, if they do
        (a _Skip). Asking for the pages leases them in a store with leases (Mooncake, for its
        ``default_kv_lease_ttl``): a page promised here is still there when the job reads it,
        unless the lease runs out first."""
        names = self._stored_names(keys)
        held = len(names)
        paged = self._leading(names)
        found = []
        try:
            for key, name in zip(keys[:paged], names):
                records = {rank: self._record(key, name, rank, page_size) for rank in self.ranks}
                found.append(StoredPage(name, records))
        except _Skip as skip:
            return found, skip
        if paged < held:
            return found, _Skip("peer_page_lost", f"{self.name} lost page {keys[paged]}")
        return found, self._unrecorded(keys, held)

    def _stored_names(self, keys: list[str]) -> list[str]:
        """The store key of each leading page of ``keys`` whose record every rank holds: the
        page's key, else (``derived``) its ``derived_key``."""
        names: list[str] = []
        while True:
            rest = keys[len(names) :]
            names += rest[: self._leading([record_key(key) for key in rest])]
            rest = keys[len(names) :]
            if not rest or not self.derived:
                return names
            apart = self._leading([record_key(derived_key(key)) for key in rest])
            if not apart:
                return names
            names += [derived_key(key) for key in rest[:apart]]

    def _leading(self, names: list[str]) -> int:
        """How many leading ``names`` every rank's store holds."""
        return min(self.stores[rank].batch_exists(names) for rank in self.ranks) if names else 0

    def _unrecorded(self, keys: list[str], held: int) -> _Skip | None:
        """A page the peer stored without its record (lost, evicted or never written), right
        where its records stop: why the run ends there."""
        if held == len(keys) or not all(self.stores[r].exists(keys[held]) for r in self.ranks):
            return None
        return _Skip("record_missing", f"{self.name} stored page {keys[held]} without its record")

    def _record(self, key: str, name: str, rank: int, page_size: int) -> PageRecord:
        """Page ``key``'s record, stored for the page under store key ``name``, from ``rank``."""
        try:
            record = stored_record(self.stores[rank], name)
        except OSError as error:  # a record file of another size (a short read)
            raise _Skip("record_invalid", f"page {key}'s record: {error}") from None
        except KVMapError as error:
            raise _Skip("record_invalid", f"page {key}: {error}") from None
        if record is None:
            raise _Skip("peer_page_missing", f"{self.name} lost the record of page {key}")
        self._check_writer(record, key)
        got = (record.page.page_size, record.page.layers, record.page.heads, record.page.head_dim)
        want, shard = self.expected_format(rank, page_size), (rank, self.settings.tp_size)
        if got != want or (record.tp_rank, record.tp_size) != shard:
            raise _Skip(
                "peer_format",
                f"{self.name} rank {rank} stores pages of (page, layers, heads, dim) {got} at TP "
                f"{record.tp_rank}/{record.tp_size}; this pair needs {want} at TP "
                f"{rank}/{shard[1]}",
            )
        limit = self.spec.config.get("max_position_embeddings")
        if limit and (record.index + 1) * record.page.page_size > limit:
            raise _Skip("record_invalid", f"page {key} sits at index {record.index}, past {limit}")
        return record

    def _check_writer(self, record: PageRecord, key: str) -> None:
        """The record's writer must be the model the pack was fitted for, with the weights
        this peer serves."""
        try:
            config, weights = split_identity(record.model)
        except KVMapError as error:
            raise _Skip("record_invalid", f"page {key}: {error}") from None
        if config != identity_config(self.mapper.source):
            raise _Skip(
                "peer_model_changed",
                f"{self.name} page {key} was written by a model of configuration {config}, not "
                "the one the pack was fitted for",
            )
        if self.weights is None:
            self.weights = weights
        if weights != self.weights:
            raise _Skip(
                "peer_model_changed",
                f"{self.name} page {key} was written with weights {weights}; this engine "
                f"translates pages of weights {self.weights}",
            )

    def tokens(self, keys: list[str], stored: list[StoredPage], job: Job):
        """The leading pages of ``keys`` (stored as ``stored``) that read back as recorded, as
        [2, tokens, layers, heads, dim] (every head: the ranks joined) in this thread's staging
        buffer, and why they stop short, if they do."""
        page = next(iter(stored[0].records.values())).page
        size, heads = page.page_size, self.spec.num_kv_heads
        shape = (2, len(keys) * size, self.spec.num_layers, heads, self.spec.head_dim)
        source = staging("source", shape, page.dtype)
        read = 0
        try:
            for key, entry in zip(keys, stored):
                if job.stopped():
                    raise _Skip("deadline", f"the prefetch deadline passed at page {key}")
                self._read(key, entry, source[:, read * size : (read + 1) * size])
                read += 1
        except _Skip as skip:
            return source[:, : read * size].contiguous(), skip
        return source, None

    def _read(self, key: str, entry: StoredPage, out: torch.Tensor) -> None:
        """Page ``key`` of every rank, checked against its record, into ``out``: [2, page,
        layers, heads, dim]."""
        head = 0
        for rank in self.ranks:
            record = entry.records[rank]
            buffer = staging(("page", rank), (record.page.numel,), record.page.dtype)
            try:
                flat = self.stores[rank].get(entry.name, buffer)
            except OSError as error:  # a page file of another size (a short read)
                raise _Skip("peer_page_damaged", f"page {key}: {error}") from None
            if flat is None:
                raise _Skip("peer_page_lost", f"{self.name} lost page {key} after the hit query")
            if page_crc32(flat) != record.crc32:
                raise _Skip("peer_page_damaged", f"page {key} does not match its record")
            out[:, :, :, head : head + record.page.heads] = record.page.to_tokens(flat)
            head += record.page.heads
        if not out.isfinite().all():
            raise _Skip("peer_page_not_finite", f"page {key} holds NaN or inf")


class KVMapStorage(HiCacheStorage):
    """HiCache storage with page records on the write side and cross-model translation on the
    read side (see the module docstring).

    Constructed by SGLang's StorageBackendFactory as ``cls(storage_config, kwargs)``: the
    sgl-kvmap keys of the extra config are type-checked here (a bad one stops the server with
    its message). The host pool arrives through ``register_mem_pool_host``, which builds the
    inner store and connects the peers; a pool it cannot translate into (MLA, an unknown
    layout) switches translation off with a logged reason, and the server starts.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None):
        self.storage_config = storage_config
        self.settings = StorageSettings.from_extra_config(storage_config.extra_config or {})
        _check_write_positions(self.settings)
        self.counters: Counter[str] = Counter()
        self.seconds: Counter[str] = Counter()  # STAGES
        self.inner: HiCacheStorage | None = None
        self.peers: list[Peer] = []
        self.page: PageFormat | None = None
        self.identity: str | None = None
        self.provenance: Provenance | None = None
        self.jobs: JobPool | None = None
        self._staged: dict[str, Job] = {}  # page key -> the job translating it
        self._timeouts = _prefetch_timeouts()
        self._lock = threading.RLock()  # HiCache reads and writes from different threads
        # a write's verdict and store, and a delivery's look for this engine's own page, are
        # each made whole under it: the one sees the other's outcome, never half of it
        self._own_pages = threading.Lock()
        self._stats_file = _stats_file(self.settings, storage_config)
        self._published: dict = {}

    # -- set-up ---------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.inner = self._inner_store(mem_pool_host)
        self.inner.register_mem_pool_host(mem_pool_host)
        try:
            self.page = _host_page_format(mem_pool_host)
        except (AttributeError, KVMapError) as error:
            self._fallback("pool_unsupported", f"cannot record or translate this pool: {error}")
            return self._publish()
        pages = max(1, mem_pool_host.size // mem_pool_host.page_size)
        self.provenance = Provenance(LEDGER_PER_HOST_PAGE * pages)
        own = self._own_spec()
        if own is not None and self.settings.translate:
            self.peers = [p for s in self.settings.peers if (p := self._connect(s, own))]
        if self.peers:
            self.jobs = JobPool(self.settings.concurrent_translations)
            self._check_priming()
        self._publish()

    def _check_priming(self) -> None:
        """Under ``sinks: "prime"``, a server process that did not load sgl-kvmap's SGLang
        plugin (``SGLANG_PLUGINS`` set without it) computes no first page before a swap:
        counted, so the operator sees why first swaps are prefilled."""
        if self.settings.sinks == "prime" and _plugins_loaded() and not registered():
            self._fallback(
                "priming_not_loaded",
                "the sgl_kvmap SGLang plugin is not loaded (add it to SGLANG_PLUGINS): a swap "
                "whose first page this engine holds nowhere is prefilled",
            )

    def primer(self) -> Primer | None:
        """What decides which prompts this engine computes the first page of before serving
        them (``priming``), or None when it does not (another sinks policy, no peer)."""
        if self.settings.sinks != "prime" or not self.peers:
            return None
        peers = [peer.stores[peer.ranks[0]] for peer in self.peers]
        return Primer.for_engine(
            self.page.page_size,
            self.inner,
            peers,
            threshold=self._timeouts[3],
            tail_pages=self.settings.tail_pages,
        )

    def _inner_store(self, host) -> HiCacheStorage:
        """This engine's own store: SGLang's built-in one (for Mooncake, a ``Keyspace`` over
        the client SGLang's MooncakeStore sets up; a store error is counted as
        ``store_error``)."""
        if self.settings.inner_backend != "mooncake":
            return _built_in(self.settings.inner_backend, self.storage_config, host)
        from . import mooncake

        extra = self.storage_config.extra_config or {}
        mooncake.load_client()
        mooncake.check_master(extra)
        backend = _built_in("mooncake", self.storage_config, host)
        prefix = mooncake.model_prefix(extra, self.storage_config.model_name or "")
        on_error = functools.partial(self._fallback, "store_error")
        return mooncake.Keyspace(
            backend.store, prefix, self.storage_config.tp_rank, backend, on_error
        )

    def register_mem_host_pool_v2(self, host_pool, host_pool_name):
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self.inner.register_mem_host_pool_v2(host_pool, host_pool_name)

    def _own_spec(self) -> ModelSpec | None:
        """This engine's model spec, and its identity for the records it writes."""
        path = self._own_path()
        try:
            own = spec_from_pretrained(path)
        except Exception as error:  # noqa: BLE001 - any failure to read the model means: no translation
            self._fallback("model_unverifiable", f"cannot read this engine's model: {error}")
            return None
        self.identity = model_identity(own, local_weights_digest(path) or NO_WEIGHTS)
        return own

    def _own_path(self) -> str:
        return self.settings.model_path or self.storage_config.model_name

    def _connect(self, settings: PeerSettings, own: ModelSpec) -> Peer | None:
        try:
            mapper = KVMapper.from_pretrained(settings.pack)  # an in-memory copy of what it checked
            peer = spec_from_pretrained(settings.model_path)
            _check_tokenizers(mapper, peer, own)
            check_models(mapper, peer, own)
            metrics = mapper.info.get("metrics", {})
            below = self.settings.floor_refusal(metrics, self.page.page_size)
            if below:
                return self._fallback("pack_below_floor", f"peer {settings.model_name}: {below}")
            mapper = self._this_ranks_mapper(mapper)
            ranks = ranks_covering_heads(peer.num_kv_heads, settings.tp_size)
        except PackError as error:
            return self._fallback("pack_invalid", f"peer {settings.model_name}: {error}")
        except _TokenizerMismatch as error:
            return self._fallback("tokenizer_mismatch", f"peer {settings.model_name}: {error}")
        except PairMismatchError as error:
            return self._fallback("model_mismatch", f"peer {settings.model_name}: {error}")
        except KVMapError as error:
            return self._fallback("geometry_mismatch", f"peer {settings.model_name}: {error}")
        except Exception as error:  # noqa: BLE001 - e.g. the peer model cannot be read
            return self._fallback("peer_unverifiable", f"peer {settings.model_name}: {error}")
        device = _engine_device(self.mem_pool_host)
        log.info("sgl-kvmap: translating pages of %s with %s", settings.model_name, settings.pack)
        connected = Peer(
            settings,
            peer,
            ranks,
            stores={r: self._peer_store(settings, r) for r in ranks},
            mapper=mapper.to(device),
            device=device,
            weights=_short(local_weights_digest(settings.model_path)),
            first_layer=self._first_layer(settings, own),
            derived=self.settings.derived == "share",
        )
        self._warm_up(connected)
        return connected

    def _warm_up(self, peer: Peer) -> None:
        """Translate one page of zeros from ``peer`` now, while the server starts: what a
        process pays on its first translation (kernel choice, rotary tables, first-layer
        tables, allocations) is then paid before it reports healthy, not inside its first
        swap's prefetch deadline."""
        started = time.perf_counter()
        spec, size = peer.spec, self.page.page_size
        shape = (2, size, spec.num_layers, spec.num_kv_heads, spec.head_dim)
        translate_run(peer.mapper, torch.zeros(shape, dtype=self.page.dtype), size, self.page,
                      peer.first_layer)  # fmt: skip
        log.info(
            "sgl-kvmap: first translation from %s warmed up in %.2f s",
            peer.name,
            time.perf_counter() - started,
        )

    def _first_layer(self, settings: PeerSettings, own: ModelSpec) -> ExactFirstLayer | None:
        """The layer-0 tables of the peer and of this engine's rank, when this engine serves
        its own layer 0 for translated tokens (``StorageSettings.first_layer``) and this host
        holds both models' weights; else None (layer 0 mapped, counted)."""
        if self.settings.first_layer != "exact":
            return None
        heads = rank_heads(
            own.num_kv_heads, self.storage_config.tp_size, self.storage_config.tp_rank
        )
        try:
            own_table = first_layer_table(self._own_path())
            return ExactFirstLayer(
                first_layer_table(settings.model_path),
                own_table.for_heads(heads),
                fast_matmul_dtype("cpu"),  # the tables stay on the CPU
            )
        except Exception as error:  # noqa: BLE001 - no weights here: serve layer 0 mapped
            return self._fallback(
                "first_layer_unavailable",
                f"peer {settings.model_name}: layer 0 stays mapped, its tables cannot be built: "
                f"{error}",
            )

    def _peer_store(self, peer: PeerSettings, rank: int) -> HiCacheStorage:
        """The store of one rank of the peer engine (this engine's store, the peer's name),
        read only: it never evicts the peer's files (the peer's own store bounds them). With
        Mooncake, the peer's objects read through this engine's client."""
        own = self.storage_config
        if self.settings.inner_backend == "mooncake":
            return self.inner.peer(peer.model_name, rank, own.extra_config or {})
        extra = {**(own.extra_config or {}), **_NO_EVICTION}
        config = dataclasses.replace(
            own, model_name=peer.model_name, tp_rank=rank, tp_size=peer.tp_size, extra_config=extra
        )
        return _built_in(self.settings.inner_backend, config)

    def _this_ranks_mapper(self, mapper: KVMapper) -> KVMapper:
        """The pair's mapper restricted to the KV heads this TP rank holds (SGLang's rule)."""
        target = mapper.target
        heads = rank_heads(
            target.num_kv_heads, self.storage_config.tp_size, self.storage_config.tp_rank
        )
        want = (target.num_layers, len(heads), target.head_dim)
        got = (self.page.layers, self.page.heads, self.page.head_dim)
        if want != got:
            raise KVMapError(
                f"this engine's host pool has (layers, kv heads, head_dim) {got}; the pack's "
                f"target needs {want} at TP rank {self.storage_config.tp_rank}/"
                f"{self.storage_config.tp_size}"
            )
        return mapper if len(heads) == target.num_kv_heads else mapper.for_target_heads(heads)

    # -- read side: the hit query ---------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info=None) -> int:
        """Leading pages that are stored for this model, then translatable from a peer (whose
        translation starts now, on a worker)."""
        with self._timed("hit_query"):
            return self._hit(keys, extra_info)

    def _hit(self, keys: list[str], extra_info) -> int:
        native = self.inner.batch_exists(keys, extra_info)
        if native == len(keys) or not self.peers:
            return native
        self._expire_jobs()
        if self.provenance is not None and _prefix(extra_info):
            self.provenance.seen(_prefix(extra_info))
        parent = keys[native - 1] if native else None
        promised = native + self._promise(keys[native:], parent, requested=len(keys), held=native)
        self._publish()
        return promised

    def _promise(
        self, keys: list[str], parent: str | None, requested: int, held: int | None = None
    ) -> int:
        """Start translating the longest run of ``keys`` a peer holds (``requested``: pages in
        the whole prefetch, which sets SGLang's deadline); how many pages it covers. For a hit
        query, ``held`` is the pages before ``keys`` the prefetch loads natively, and a hit
        below SGLang's prefetch threshold, which SGLang would revoke, starts nothing."""
        with self._lock:
            job = self._staged.get(keys[0])
        if job is not None:  # a hit query repeated for a run already being translated
            return _covered(job, keys)
        runs = [(peer, self._run(peer, keys, parent)) for peer in self.peers]
        peer, stored = max(runs, key=lambda run: len(run[1]))
        stored = stored[: max(0, len(stored) - self.settings.tail_pages)]
        below = held is not None and (held + len(stored)) * self.page.page_size < self._timeouts[3]
        if not stored or below:
            return 0
        run = keys[: len(stored)]
        job = self.jobs.submit(run, self._deadline(requested), self._work(peer, stored))
        if job is None:
            self._fallback("translation_busy", f"all {self.jobs.slots} translation workers busy")
            return 0
        with self._lock:
            self._staged.update(dict.fromkeys(run, job))
        return len(run)

    def _run(self, peer: Peer, keys: list[str], parent: str | None) -> list[StoredPage]:
        """The leading ``keys`` ``peer`` stored with valid, chained records. ``parent``: the
        key before ``keys[0]``, when known. Why the run ends before the peer's last page, if it
        does, is counted."""
        run: list[StoredPage] = []
        try:
            found, short = peer.records(keys, self.page.page_size)
            for key, entry in zip(keys, found):
                self._check_chain(entry.records, run, parent, key)
                run.append(entry)
                parent = key
            if short is not None:
                raise short
        except _Skip as skip:
            self._fallback(skip.reason, str(skip))
        except Exception as error:  # noqa: BLE001 - a failing peer store hides only the peer
            self._fallback("peer_store_error", f"{peer.name}: {error}")
        return run

    def _check_chain(
        self, records: dict[int, PageRecord], run: list[StoredPage], parent, key: str
    ) -> None:
        first = next(iter(records.values()))
        same = (first.index, first.parent, first.page.dtype)
        if any((r.index, r.parent, r.page.dtype) != same for r in records.values()):
            raise _Skip("record_invalid", f"the peer's ranks disagree on page {key}")
        if run and first.page.dtype != next(iter(run[0].records.values())).page.dtype:
            raise _Skip("record_invalid", f"page {key} changes the run's dtype")
        if parent is not None and first.parent != parent:
            raise _Skip("record_invalid", f"page {key} does not follow page {parent}")
        if run and first.index != next(iter(run[-1].records.values())).index + 1:
            raise _Skip("record_invalid", f"page {key} breaks the recorded positions")
        if first.index == 0 and self.settings.sinks in NATIVE_SINKS:
            raise _Skip("no_native_sink_page", "the prefix's first page is not stored natively")

    def _deadline(self, requested_pages: int) -> float:
        """When a job's transfer stops waiting for it: a share of SGLang's prefetch deadline
        for ``requested_pages`` pages (no limit under SGLang's wait_complete policy)."""
        policy, base, per_ki_token, _ = self._timeouts
        if policy == "wait_complete":
            return math.inf
        seconds = base + per_ki_token * requested_pages * self.page.page_size / 1024
        return time.monotonic() + DEADLINE_SHARE * seconds

    def _work(self, peer: Peer, stored: list[StoredPage]):
        """The job translating ``peer``'s ``stored`` pages (runs on a worker thread)."""

        def work(job: Job) -> Translated:
            with self._timed("read"):
                source, short = peer.tokens(job.keys, stored, job)
            if not source.shape[1]:
                return Translated([], [], short)
            read = zip(stored[: source.shape[1] // self.page.page_size], job.keys)
            self._count("derived_pages_read", sum(entry.name != key for entry, key in read))
            first = next(iter(stored[0].records.values())).first_token
            with self._timed("map"):
                pages, exact = translate_run(
                    peer.mapper, source, first, self.page, peer.first_layer
                )
            if peer.first_layer is not None:
                self._count("first_layer_exact_tokens", exact)
                self._count("first_layer_mapped_tokens", source.shape[1] - exact)
            finite = next((i for i, page in enumerate(pages) if not page.isfinite().all()), None)
            if finite is not None:  # a hostile or broken pack: never NaN/inf into the engine
                pages = pages[:finite]
                short = _Skip("translation_not_finite", f"translated page {finite}: NaN or inf")
            return Translated(pages, [page_crc32(page) for page in pages], short)

        return work

    def _expire_jobs(self) -> None:
        """Drop the jobs whose pages SGLang never asked for (a revoked or trimmed hit)."""
        for job in self.jobs.expire():
            self._unstage(job)
            self._count("translation_unused")

    def _unstage(self, job: Job) -> None:
        with self._lock:
            for key in job.keys:
                if self._staged.get(key) is job:
                    del self._staged[key]

    # -- read side: the transfer ----------------------------------------------------------

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info=None
    ) -> list[bool]:
        """Native pages into the host pool, then the translated run after them.
        host_indices: [len(keys) * page_size] page-aligned host slots."""
        with self._timed("native"):
            native = self._load_native(keys, host_indices)
        done = 0
        if native < len(keys) and self.peers:
            size = self.page.page_size
            done = self._deliver(keys[native:], host_indices[native * size :])
        self._publish()
        return [True] * (native + done) + [False] * (len(keys) - native - done)

    def _load_native(self, keys, host_indices) -> int:
        """Copy the leading pages stored for this model, each checked against its record
        (``_own_page``), into the host pool; how many."""
        count = self.inner.batch_exists(keys)
        if count == 0:
            return 0
        host = self.mem_pool_host
        loaded = 0
        for key, page in zip(keys, self._read_own(keys[:count])):
            if page is None or not self._own_page(key, page):
                break
            host.set_from_flat_data_page(int(host_indices[loaded * host.page_size]), page)
            loaded += 1
        self._count("native_pages", loaded)
        return loaded

    def _read_own(self, keys: list[str]) -> list[torch.Tensor | None]:
        """Pages ``keys`` as stored under this engine's name, in one batch; when the batch fails
        (a page file of another size: another model's under this name), page by page up to the
        first that fails (counted)."""
        host = self.mem_pool_host
        try:
            return list(self.inner.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys]))
        except OSError:
            pages = []
            for key in keys:
                try:
                    pages.append(self.inner.get(key, host.get_dummy_flat_data_page()))
                except OSError as error:
                    self._fallback("own_page_unreadable", f"page {key}: {error}")
                    break
            return pages

    def _own_page(self, key: str, page: torch.Tensor) -> bool:
        """Whether ``page``, read under this engine's own name for ``key``, is what this model
        stored there (``_own_page_refusal``); a refusal is counted."""
        refusal = self._own_page_refusal(key, page)
        if refusal is not None:
            self._fallback(*refusal)
        return refusal is None

    def _own_page_refusal(self, key: str, page: torch.Tensor) -> tuple[str, str] | None:
        """Why ``page`` is not this model's page ``key`` as its record says (None: it is):
        written by this model (its identity: configuration and weights; a name another model,
        or a redeployed one, shares reads none of its pages as native) and its bytes unchanged
        (CRC). An engine that cannot read its own model (no identity) writes no records and
        reads its pages unchecked."""
        if self.identity is None:
            return None
        try:
            record = stored_record(self.inner, key)
        except (OSError, KVMapError) as error:
            return "own_record_invalid", f"page {key}'s record: {error}"
        if record is None:
            return "own_record_missing", f"page {key} is stored under this name without its record"
        if record.model != self.identity:
            return "own_page_foreign", (
                f"page {key} under this engine's name was written by {record.model}, not by "
                f"this engine's model {self.identity}"
            )
        if page_crc32(page) != record.crc32:
            return "own_page_damaged", f"page {key} under this name does not match its record"
        return None

    def _deliver(self, keys: list[str], host_indices: torch.Tensor) -> int:
        """Wait for the job translating ``keys`` (started now if the hit query did not) and
        copy its pages into ``host_indices``; how many pages SGLang received."""
        job = self._job_for(keys)
        if job is None:
            return 0
        try:
            with self._timed("wait"):
                result = job.wait()
        except Exception as error:  # noqa: BLE001 - any failure: SGLang prefills these pages
            log.exception("sgl-kvmap: translation failed")
            result = Translated([], [], _Skip("translation_error", str(error)))
        finally:
            self.jobs.release(job)
            self._unstage(job)
        if result is None:
            self._fallback("deadline", f"translating {len(job.keys)} pages missed the deadline")
            return 0
        offset, wanted = job.keys.index(keys[0]), _covered(job, keys)
        pages, crcs = result.pages[offset : offset + wanted], result.crcs[offset : offset + wanted]
        if result.short is not None and len(pages) < wanted:
            self._fallback(result.short.reason, str(result.short))
        with self._timed("write"):
            translated = self._write_translated(keys, host_indices, pages, crcs)
        self._count("translated_pages_delivered", translated)
        return len(pages)

    def _write_translated(self, keys, host_indices, pages, crcs) -> int:
        """Copy translated ``pages`` into the host slots of ``keys`` (this engine's own page
        instead, where it has stored one since); how many translated pages it copied."""
        size, translated = self.page.page_size, 0
        for i, (key, page, crc) in enumerate(zip(keys, pages, crcs)):
            slot = int(host_indices[i * size])
            with self._own_pages:
                if self._load_own(key, slot):
                    continue
                self.mem_pool_host.set_from_flat_data_page(slot, page)
                self.provenance.delivered(key, crc)
            translated += 1
            if self.settings.audit_translations:
                self.inner.set(key + AUDIT_SUFFIX, page)
        return translated

    def _load_own(self, key: str, slot: int) -> bool:
        """Copy page ``key`` into host slot ``slot`` if this engine has stored it as its own
        since the transfer began (native pages win). That happens when SGLang cut this
        prefetch while its transfer waited for the job and the engine computed the page
        itself: the translation is never used, so it must not enter the provenance ledger,
        where it would withhold every page the engine computes after its own."""
        if not self.inner.exists(key):
            return False
        try:
            page = self.inner.get(key, self.mem_pool_host.get_dummy_flat_data_page())
        except OSError:  # a page file of another size: the translation stands
            return False
        if page is None or not self._own_page(key, page):
            return False
        self.mem_pool_host.set_from_flat_data_page(slot, page)
        self._count("native_pages")
        return True

    def _job_for(self, keys: list[str]) -> Job | None:
        """The job translating ``keys[0]`` onwards; one is started if none is (SGLang may
        transfer a run it proved stored earlier without asking again)."""
        with self._lock:
            job = self._staged.get(keys[0])
        if job is None and self._promise(keys, None, requested=len(keys)):
            with self._lock:
                job = self._staged.get(keys[0])
        return job

    # -- write side -----------------------------------------------------------------------

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info=None
    ) -> list[bool]:
        """Store this model's pages with their records, except translated pages and every page
        after one (``provenance``); of those, the pages this engine computed over translated KV
        are stored apart when it shares them (``StorageSettings.derived``). Withheld pages
        report success, so HiCache does not retry them."""
        host, prefix, keys = self.mem_pool_host, _prefix(extra_info), list(keys)
        pages = [
            host.get_data_page(int(host_indices[i * host.page_size])) for i in range(len(keys))
        ]
        crcs = [page_crc32(page) for page in pages] if self.provenance is not None else []
        with self._own_pages:
            verdict = self._verdict(prefix, keys, crcs)
            keep = verdict.storable
            stored = bool(self.inner.batch_set(keys[:keep], pages[:keep])) if keep else True
        if stored and keep and self.identity is not None:
            self._write_records(prefix, keys, crcs, range(keep), keys[:keep])
        self._count("stored_pages", keep if stored else 0)
        if verdict.derived and self.settings.derived == "share" and self.identity is not None:
            self._store_derived(prefix, keys, pages, crcs, verdict.derived)
        self._publish()
        return [stored] * keep + [True] * (len(keys) - keep)

    def _verdict(self, prefix: list[str] | None, keys: list[str], crcs: list[int]) -> Verdict:
        """Which of ``keys`` (bytes of CRC-32 ``crcs``) this engine computed from its own KV
        (the leading ``storable``) or over translated KV (``derived``); the pages after the
        storable ones are counted as withheld."""
        if prefix is None:  # PD decode-side offload: nothing says what these pages descend from
            self._fallback("prefix_keys_missing", "pages written without prefix keys: not stored")
            verdict = Verdict(0, 0)
        elif self.provenance is None:
            verdict = Verdict(len(keys), 0)
        else:
            verdict = self.provenance.verdict(prefix, keys, crcs)
        self._count("pages_withheld", len(keys) - verdict.storable)
        self._count("translated_pages_discarded", verdict.recomputed)
        return verdict

    def _store_derived(self, prefix, keys, pages, crcs, derived: tuple[int, ...]) -> None:
        """Store pages ``derived`` of a write apart (``derived_key``), with their records, for
        peers to translate."""
        names = [derived_key(keys[i]) for i in derived]
        if self.inner.batch_set(names, [pages[i] for i in derived]):
            self._write_records(prefix, keys, crcs, derived, names)
            self._count("derived_pages_stored", len(derived))

    def _write_records(self, prefix, keys, crcs, indices, names) -> None:
        """The records of pages ``indices`` of a write of ``keys`` (bytes of CRC-32 ``crcs``)
        after pages ``prefix``, stored for the pages under store keys ``names``."""
        config, records = self.storage_config, []
        for i in indices:
            parent = keys[i - 1] if i else (prefix[-1] if prefix else "")
            rank, size = config.tp_rank, config.tp_size
            record = PageRecord(
                len(prefix) + i, parent, self.page, rank, size, self.identity, crcs[i]
            )
            records.append(record.to_tensor())
        if not self.inner.batch_set([record_key(name) for name in names], records):
            self._fallback("record_write_failed", f"no records for pages {names[0]}..")

    # -- the rest of the interface: this model's own pages, as the inner store has them ------

    def get(self, key, target_location=None, target_sizes=None):
        return self.inner.get(key, target_location, target_sizes)

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        return self.inner.batch_get(keys, target_locations, target_sizes)

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        """SGLang's non-v1 write carries no prefix keys: what the pages descend from cannot be
        checked, so none is stored (they report success, so HiCache does not retry)."""
        self._verdict(None, list(keys), [])
        self._publish()
        return True

    def exists(self, key) -> bool:
        return self.inner.exists(key)

    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
        return self.inner.batch_exists_v2(keys, pool_transfers, extra_info)

    def batch_get_v2(self, transfers, extra_info=None):
        return self.inner.batch_get_v2(transfers, extra_info)

    def batch_set_v2(self, transfers, extra_info=None):
        return self.inner.batch_set_v2(transfers, extra_info)

    def clear(self) -> None:
        self.inner.clear()

    def close(self) -> None:
        if self.jobs is not None:
            self.jobs.close()
        stores = [self.inner, *(s for peer in self.peers for s in peer.stores.values())]
        for store in stores:
            if hasattr(store, "close"):
                store.close()
        self._publish()

    # -- counters -------------------------------------------------------------------------

    @contextlib.contextmanager
    def _timed(self, stage: str):
        """Add the wall seconds of the block to ``seconds[stage]`` (``STAGES``)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                self.seconds[stage] += time.perf_counter() - started

    def _count(self, name: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self.counters[name] += n

    def _fallback(self, reason: str, message: str) -> None:
        """Count a reason translation (or a record) did not happen; log it the first time."""
        name = f"fallback.{reason}"
        with self._lock:
            if not self.counters[name]:
                log.warning("sgl-kvmap: %s (%s); SGLang prefills instead", message, reason)
            self.counters[name] += 1
        return None

    def _publish(self) -> None:
        """Rewrite the stats file if the counters changed since it was last written."""
        if self._stats_file is None:
            return
        with self._lock:
            counters = dict(self.counters)
            if counters == self._published:
                return
            self._published = counters
            stats = {
                "counters": counters,
                "seconds": dict(self.seconds),
                "pid": os.getpid(),
                "time": time.time(),
            }
            try:
                with staged_file(self._stats_file) as staged:
                    staged.write_text(json.dumps(stats, sort_keys=True))
            except OSError as error:
                log.warning("sgl-kvmap: cannot write %s: %s", self._stats_file, error)


class _TokenizerMismatch(PairMismatchError):
    pass


def _covered(job: Job, keys: list[str]) -> int:
    """How many of ``keys``, from the first, ``job`` translates in the same order."""
    offset = job.keys.index(keys[0])
    count = 0
    for key, translated in zip(keys, job.keys[offset:]):
        if key != translated:
            break
        count += 1
    return count


def _check_tokenizers(mapper: KVMapper, peer: ModelSpec, own: ModelSpec) -> None:
    """Both engines and the pack must share one tokenizer (page keys are token hashes)."""
    for fitted, given in ((mapper.source, peer), (mapper.target, own)):
        try:
            check_pair(fitted, given)
        except PairMismatchError as error:
            raise _TokenizerMismatch(str(error)) from None


def _check_write_positions(settings: StorageSettings) -> None:
    """A page's position reaches its record only through SGLang's v1 calls with prefix keys."""
    missing = [] if settings.interface_v1 else ['"interface_v1": 1']
    memory = _memory_config()
    if memory is not None and not _prefix_keys_passed(memory):
        missing.append('"hicache_storage_pass_prefix_keys": true')
    if missing:
        raise KVMapError(
            f"KVMapStorage needs {' and '.join(missing)} in the extra config (pages are stored "
            "only with their positions); `sgl-kvmap sglang-args` prints both"
        )


def _memory_config():
    """The server's memory settings as SGLang publishes them in its processes (HiCache's among
    them); None outside one."""
    try:
        from sglang.srt.runtime_context import get_memory

        return get_memory()
    except Exception:  # noqa: BLE001 - not published: a backend built outside a server
        return None


def _plugins_loaded() -> bool:
    """Whether this process loaded SGLang's plugins, as every server process does (the
    in-process engines do not: they prime by themselves)."""
    import sglang.srt.plugins

    return bool(getattr(sglang.srt.plugins, "_plugins_loaded", False))


def _prefix_keys_passed(memory) -> bool:
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    extra = memory.hicache_storage_backend_extra_config
    return HybridCacheController.parse_storage_backend_extra_config(extra)[4]


def _prefetch_timeouts() -> tuple[str, float, float, int]:
    """SGLang's prefetch stop policy, its deadline's two terms and its prefetch threshold
    (tokens), read with SGLang's own parser from the server's arguments (its defaults outside
    a server)."""
    memory = _memory_config()
    if memory is None:
        return "timeout", 1.0, 0.25, 256
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    extra = memory.hicache_storage_backend_extra_config
    parsed = HybridCacheController.parse_storage_backend_extra_config(extra)
    _, threshold, base, per_ki_token, _ = parsed
    return memory.hicache_storage_prefetch_policy, base, per_ki_token, threshold


def _prefix(extra_info) -> list[str] | None:
    return getattr(extra_info, "prefix_keys", None)


def _engine_device(host) -> torch.device:
    """Where the engine's KV pool lives (its GPU), or the CPU: translation runs there."""
    buffers = getattr(host, "device_k_buffers", None)
    device = buffers[0].device if buffers else torch.device("cpu")
    return device if device.type == "cuda" else torch.device("cpu")


def _host_page_format(host) -> PageFormat:
    """The format of this engine's host pages; KVMapError (or AttributeError) for a pool
    sgl-kvmap cannot read, such as MLA's latent pool."""
    if getattr(host, "kv_lora_rank", None) is not None or "MLA" in type(host).__name__:
        raise KVMapError(f"{type(host).__name__} holds MLA latents, not per-head K and V")
    return PageFormat(
        host.layout, host.page_size, host.layer_num, host.head_num, host.head_dim, host.dtype
    )


def _short(digest: str | None) -> str | None:
    return digest[:DIGITS] if digest else None


def _stats_file(settings: StorageSettings, config: HiCacheStorageConfig) -> Path | None:
    if not settings.stats_path:
        return None
    name = (config.model_name or "model").replace("/", "-")
    folder = Path(settings.stats_path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (OSError, ValueError) as error:  # a file there, a NUL in it, no permission
        raise KVMapError(
            f"stats_path {settings.stats_path!r} cannot be a folder of counters ({error}); "
            "give a folder this engine can write, or none"
        ) from None
    return folder / f"{name}_{config.tp_rank}_{config.tp_size}.json"


def _built_in(name: str, config: HiCacheStorageConfig, host=None) -> HiCacheStorage:
    return StorageBackendFactory.create_backend(name, config, host)
