"""KVMapStorage: a HiCache storage backend that serves other models' pages, translated.

Loaded by SGLang (0.5.23) as a ``dynamic`` HiCache storage backend. It wraps a built-in store
(``file``), through which this engine stores and reads its own pages as usual, and adds:

- Write side: beside every page it stores as its own, a page record (``records``): the page's
  index in its sequence, its parent key, its byte format and a CRC. SGLang's write-through
  knows the index (it passes the prefix's page keys with every batch); a reader does not.
- Read side: when a prefix's next pages are not stored for THIS model but a peer model of the
  same family (same tokenizer, so the same page keys) stored them with records, it reads the
  peer's pages, checks them against their records, translates them at their recorded
  positions with the pair's mapper pack (``kernels.translate_pages``; on the engine's GPU when
  it has one) and writes them into this engine's host pool in its own layout and head shard.

Rules (docs/sglang.md):
- Native pages always win; translation is off unless the operator enables it.
- Provenance: every page this process translated is remembered for the life of the process
  (the only time it can sit in this engine's radix tree), and no page whose prefix runs through
  one is ever stored as this model's page: translated KV is never served as exact KV, nor
  becomes the source of a further translation.
- Fallback: a missing, damaged or mismatched pack, a page without a record or whose bytes do
  not match it, a peer with another page size or geometry, non-finite values, a failing peer
  store or any translation error makes the page unavailable; SGLang then prefills it as if
  sgl-kvmap were absent. Every reason is counted (``counters``) and logged once; nothing is
  raised into the scheduler.

This is the only module that imports sglang.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import Counter

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from ..core.errors import KVMapError, PackError, PairMismatchError
from ..core.mapper import KVMapper
from ..core.spec import ModelSpec, check_models, check_pair, spec_from_pretrained
from .heads import rank_heads, ranks_covering_heads
from .pages import PageFormat
from .records import PageRecord, empty_record, page_crc32
from .settings import PeerSettings, StorageSettings
from .translation import translate_tokens

log = logging.getLogger(__name__)

RECORDS_SUFFIX = ".kvmap-records"  # the records' identity in the store: "<model>.kvmap-records"


class _Skip(Exception):
    """A page that cannot be translated; ``reason`` is counted as ``fallback.<reason>``."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclasses.dataclass
class Peer:
    """A peer engine whose stored pages this engine translates.

    ranks: the peer's TP ranks whose pages hold each of its KV heads once (head order);
    pages / records: the page store and the record store of each of those ranks; mapper: the
    pair's mapper, restricted to this rank's target heads and moved to ``device``."""

    settings: PeerSettings
    spec: ModelSpec
    ranks: list[int]
    pages: dict[int, HiCacheStorage]
    records: dict[int, HiCacheStorage]
    mapper: KVMapper
    device: torch.device

    def expected_format(self, rank: int, page_size: int) -> tuple:
        heads = len(rank_heads(self.spec.num_kv_heads, self.settings.tp_size, rank))
        return (page_size, self.spec.num_layers, heads, self.spec.head_dim)

    def record_of(self, key: str, rank: int, page_size: int) -> PageRecord:
        """The record of ``key`` on ``rank``, checked against what this pair needs."""
        if not self.records[rank].exists(key) or not self.pages[rank].exists(key):
            raise _Skip("peer_page_missing", f"{self.settings.model_name} holds no page {key}")
        data = self.records[rank].get(key, empty_record())
        try:
            record = PageRecord.from_tensor(data)
        except KVMapError as error:
            raise _Skip("record_invalid", f"page {key}: {error}") from None
        got = (record.page.page_size, record.page.layers, record.page.heads, record.page.head_dim)
        want, shard = self.expected_format(rank, page_size), (rank, self.settings.tp_size)
        if got != want or (record.tp_rank, record.tp_size) != shard:
            raise _Skip(
                "peer_format",
                f"{self.settings.model_name} rank {rank} stores pages of (page, layers, heads, "
                f"dim) {got} at TP {record.tp_rank}/{record.tp_size}; this pair needs {want} at "
                f"TP {rank}/{shard[1]}",
            )
        return record

    def page_tokens(self, key: str, records: dict[int, PageRecord]) -> torch.Tensor:
        """The peer's page ``key`` as [2, page, layers, heads, dim], every head (ranks joined),
        each rank's bytes checked against its record."""
        shards = []
        for rank in self.ranks:
            record = records[rank]
            buffer = record.page.empty_page(pin=self.device.type == "cuda")
            flat = self.pages[rank].get(key, buffer)
            if flat is None or page_crc32(flat) != record.crc32:
                raise _Skip("peer_page_damaged", f"page {key} does not match its record")
            shards.append(record.page.to_tokens(flat))
        tokens = torch.cat(shards, dim=3)
        if not tokens.isfinite().all():
            raise _Skip("peer_page_not_finite", f"page {key} holds NaN or inf")
        return tokens


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
        self.counters: Counter[str] = Counter()
        self.inner: HiCacheStorage | None = None
        self.own_records: HiCacheStorage | None = None
        self.peers: list[Peer] = []
        self.page: PageFormat | None = None
        self._translated: set[bytes | str] = set()
        self._lock = threading.RLock()  # HiCache reads and writes from different threads

    # -- set-up ---------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.inner = _built_in(self.settings.inner_backend, self.storage_config, mem_pool_host)
        self.inner.register_mem_pool_host(mem_pool_host)
        try:
            self.page = _host_page_format(mem_pool_host)
        except (AttributeError, KVMapError) as error:
            self._fallback("pool_unsupported", f"cannot record or translate this pool: {error}")
            return
        self.own_records = _records_store(self.storage_config)
        self.peers = self._connect_peers() if self.settings.translate else []

    def register_mem_host_pool_v2(self, host_pool, host_pool_name):
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self.inner.register_mem_host_pool_v2(host_pool, host_pool_name)

    def _connect_peers(self) -> list[Peer]:
        if not self.settings.interface_v1:
            self._fallback("interface_v1_off", 'translation needs "interface_v1": 1')
            return []
        try:
            own = spec_from_pretrained(self.settings.model_path or self.storage_config.model_name)
        except Exception as error:  # noqa: BLE001 - any failure to read the model means: no translation
            self._fallback("model_unverifiable", f"cannot read this engine's model: {error}")
            return []
        return [peer for s in self.settings.peers if (peer := self._connect(s, own)) is not None]

    def _connect(self, settings: PeerSettings, own: ModelSpec) -> Peer | None:
        try:
            mapper = KVMapper.from_pretrained(settings.pack)  # an in-memory copy of what it checked
            peer = spec_from_pretrained(settings.model_path)
            _check_tokenizers(mapper, peer, own)
            check_models(mapper, peer, own)
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
        configs = {r: _peer_config(self.storage_config, settings, r) for r in ranks}
        log.info("sgl-kvmap: translating pages of %s with %s", settings.model_name, settings.pack)
        return Peer(
            settings,
            peer,
            ranks,
            pages={r: _built_in(self.settings.inner_backend, c) for r, c in configs.items()},
            records={r: _records_store(c) for r, c in configs.items()},
            mapper=mapper.to(device),
            device=device,
        )

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

    # -- read side ------------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info=None) -> int:
        """Leading pages that are stored for this model, then translatable from a peer."""
        native = self.inner.batch_exists(keys, extra_info)
        if native == len(keys) or not self.peers:
            return native
        parent = keys[native - 1] if native else None
        run = max(len(self._run(peer, keys[native:], parent)[0]) for peer in self.peers)
        return native + max(0, run - self.settings.tail_pages)  # the tail: computed by SGLang

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info=None
    ) -> list[bool]:
        """Native pages into the host pool, then the translated run after them.
        host_indices: [len(keys) * page_size] page-aligned host slots."""
        native = self._load_native(keys, host_indices)
        done = 0
        if native < len(keys) and self.peers:
            size = self.page.page_size
            parent = keys[native - 1] if native else None
            done = self._translate_into_host(keys[native:], host_indices[native * size :], parent)
        return [True] * (native + done) + [False] * (len(keys) - native - done)

    def _load_native(self, keys, host_indices) -> int:
        """Copy the leading pages stored for this model into the host pool; how many."""
        count = self.inner.batch_exists(keys)
        if count == 0:
            return 0
        host = self.mem_pool_host
        buffers = [host.get_dummy_flat_data_page() for _ in range(count)]
        loaded = 0
        for page in self.inner.batch_get(keys[:count], buffers):
            if page is None:
                break
            host.set_from_flat_data_page(int(host_indices[loaded * host.page_size]), page)
            loaded += 1
        self._count("native_pages", loaded)
        return loaded

    def _run(self, peer: Peer, keys: list[str], parent: str | None):
        """The leading keys whose pages ``peer`` stored with valid, chained records: (keys,
        their records per rank). ``parent``: the key before ``keys[0]``, when known."""
        run: list[dict[int, PageRecord]] = []
        try:
            for key in keys:
                records = {r: peer.record_of(key, r, self.page.page_size) for r in peer.ranks}
                self._check_chain(records, run, parent, key)
                run.append(records)
                parent = key
        except _Skip as skip:
            if skip.reason != "peer_page_missing" or not run:
                self._fallback(skip.reason, str(skip))
        except Exception as error:  # noqa: BLE001 - a failing peer store hides only the peer
            self._fallback("peer_store_error", f"{peer.settings.model_name}: {error}")
        return keys[: len(run)], run

    def _check_chain(self, records: dict[int, PageRecord], run: list, parent, key: str) -> None:
        first = next(iter(records.values()))
        if any((r.index, r.parent) != (first.index, first.parent) for r in records.values()):
            raise _Skip("record_invalid", f"the peer's ranks disagree on page {key}")
        if parent is not None and first.parent != parent:
            raise _Skip("record_invalid", f"page {key} does not follow page {parent}")
        if run and first.index != next(iter(run[-1].values())).index + 1:
            raise _Skip("record_invalid", f"page {key} breaks the recorded positions")
        if first.index == 0 and self.settings.sinks == "native":
            raise _Skip("no_native_sink_page", "the prefix's first page is not stored natively")

    def _translate_into_host(self, keys, host_indices, parent) -> int:
        try:
            for peer in self.peers:
                keys, records = self._run(peer, keys, parent)
                if keys:
                    return self._translate_run(peer, keys, records, host_indices)
            return 0
        except _Skip as skip:
            self._fallback(skip.reason, str(skip))
        except Exception as error:  # noqa: BLE001 - any failure: SGLang prefills these pages itself
            log.exception("sgl-kvmap: translation failed")
            self._fallback("translation_error", str(error))
        return 0

    def _translate_run(self, peer: Peer, keys, records, host_indices) -> int:
        """Translate the peer's pages ``keys`` into this engine's host slots; how many."""
        size = self.page.page_size
        pages = self._readable_pages(peer, keys, records)
        if not pages:
            return 0
        keys, source = keys[: len(pages)], torch.cat(pages, dim=1)
        start = next(iter(records[0].values())).first_token
        positions = torch.arange(start, start + source.shape[1])
        target = translate_tokens(peer.mapper, source, positions, self.page.dtype)
        for i, key in enumerate(keys):
            page = self.page.from_tokens(target[:, i * size : (i + 1) * size])
            self.mem_pool_host.set_from_flat_data_page(int(host_indices[i * size]), page)
            self._remember_translated(key)
        self._count("translated_pages", len(keys))
        return len(keys)

    def _readable_pages(self, peer: Peer, keys, records) -> list[torch.Tensor]:
        """The leading pages of ``keys`` that read back as recorded (a damaged page ends them)."""
        pages = []
        try:
            for key, key_records in zip(keys, records):
                pages.append(peer.page_tokens(key, key_records))
        except _Skip as skip:
            self._fallback(skip.reason, str(skip))
        return pages

    # -- write side -----------------------------------------------------------------------

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info=None
    ) -> list[bool]:
        """Store this model's pages with their records, except translated pages and every
        page after one. Withheld pages report success, so HiCache does not retry them."""
        prefix = _prefix(extra_info)
        keep = self._storable(prefix, keys)
        self._count("pages_withheld", len(keys) - keep)
        host = self.mem_pool_host
        size = host.page_size
        pages = [host.get_data_page(int(host_indices[i * size])) for i in range(keep)]
        stored = bool(self.inner.batch_set(list(keys[:keep]), pages)) if keep else True
        if stored and keep and self.own_records is not None:
            self._write_records(prefix, keys[:keep], pages)
        return [stored] * keep + [True] * (len(keys) - keep)

    def _storable(self, prefix: list[str] | None, keys: list[str]) -> int:
        """How many leading ``keys`` this engine computed itself from its own KV."""
        with self._lock:
            if not self._translated:
                return len(keys)
            if prefix is None:  # the chain cannot be checked: store nothing
                self._fallback("prefix_keys_missing", "no prefix_keys on a write")
                return 0
            chain = [*prefix, *keys]
            first = next(
                (i for i, key in enumerate(chain) if _compact(key) in self._translated),
                len(chain),
            )
        return max(0, min(len(keys), first - len(prefix)))

    def _write_records(self, prefix: list[str] | None, keys: list[str], pages) -> None:
        if prefix is None:
            self._fallback("prefix_keys_missing", "pages stored without positions (no records)")
            return
        config = self.storage_config
        for i, (key, page) in enumerate(zip(keys, pages)):
            index = len(prefix) + i
            parent = keys[i - 1] if i else (prefix[-1] if prefix else "")
            record = PageRecord(
                index, parent, self.page, config.tp_rank, config.tp_size, page_crc32(page)
            )
            if not self.own_records.set(key, record.to_tensor()):
                self._fallback("record_write_failed", f"no record for page {key}")

    def _remember_translated(self, key: str) -> None:
        with self._lock:
            self._translated.add(_compact(key))

    # -- the rest of the interface: this model's own pages, as the inner store has them ------

    def get(self, key, target_location=None, target_sizes=None):
        return self.inner.get(key, target_location, target_sizes)

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        return self.inner.batch_get(keys, target_locations, target_sizes)

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        """SGLang's non-v1 write: no prefix keys, so no records; withheld if this process has
        translated anything (the chain cannot be checked)."""
        if self._storable(None, list(keys)) < len(keys):
            self._count("pages_withheld", len(keys))
            return True
        return self.inner.batch_set(keys, values)

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
        stores = [self.inner, self.own_records]
        stores += [s for peer in self.peers for s in (*peer.pages.values(), *peer.records.values())]
        for store in stores:
            if hasattr(store, "close"):
                store.close()

    def _count(self, name: str, n: int = 1) -> None:
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


class _TokenizerMismatch(PairMismatchError):
    pass


def _check_tokenizers(mapper: KVMapper, peer: ModelSpec, own: ModelSpec) -> None:
    """Both engines and the pack must share one tokenizer (page keys are token hashes)."""
    for fitted, given in ((mapper.source, peer), (mapper.target, own)):
        try:
            check_pair(fitted, given)
        except PairMismatchError as error:
            raise _TokenizerMismatch(str(error)) from None


def _prefix(extra_info) -> list[str] | None:
    return getattr(extra_info, "prefix_keys", None)


def _compact(key: str) -> bytes | str:
    """A page key as 32 bytes when it is a hex SHA-256 (half the memory), else as is."""
    try:
        return bytes.fromhex(key) if len(key) == 64 else key
    except ValueError:
        return key


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


def _records_store(config: HiCacheStorageConfig) -> HiCacheStorage:
    """The store of page records written by the engine that ``config`` names."""
    name = (config.model_name or "") + RECORDS_SUFFIX
    return _built_in("file", dataclasses.replace(config, model_name=name))


def _peer_config(own: HiCacheStorageConfig, peer: PeerSettings, rank: int) -> HiCacheStorageConfig:
    """The storage identity of one rank of the peer engine (same store, the peer's name)."""
    return dataclasses.replace(own, model_name=peer.model_name, tp_rank=rank, tp_size=peer.tp_size)


def _built_in(name: str, config: HiCacheStorageConfig, host=None) -> HiCacheStorage:
    return StorageBackendFactory.create_backend(name, config, host)
