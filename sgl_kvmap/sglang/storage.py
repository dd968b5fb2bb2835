"""KVMapStorage: a HiCache storage backend that serves other models' pages, translated.

Loaded by SGLang (0.5.23) as a ``dynamic`` HiCache storage backend. It wraps a built-in
backend (``file`` by default; Mooncake or 3FS for clusters), through which this engine stores
and reads its own pages as usual, and adds translation on the read side: when a prefix's next
pages are not stored for THIS model but are stored by a peer model of the same family (same
tokenizer, so the same page keys), it reads the peer's pages, translates them with the pair's
mapper pack (``kernels.translate_pages``) and writes them into this engine's host pool.

Rules (see the README, "Serving with SGLang"):
- Native pages always win; translation is off unless the operator enables it.
- Provenance: translated pages, and every later page of a prefix that runs through one, are
  never stored as this model's pages, so they are never served as exact pages and never
  become the source of a further translation (no compounding drift).
- Fallback: a missing, damaged or mismatched pack, unknown positions, a missing attention-sink
  page, a missing peer page or any translation error makes the page unavailable; SGLang then
  prefills it as if sgl-kvmap were absent. Every reason is counted (``counters``) and logged.

This is the only module that imports sglang (plus the launch helper, which does not).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import Counter, OrderedDict

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from ..errors import KVMapError, PackError, PairMismatchError
from ..kernels import PagedKV, translate_pages
from ..mapper import KVMapper
from ..pack import check_models
from ..spec import ModelSpec, check_pair, spec_from_pretrained
from .pages import PageFormat
from .settings import PeerSettings, StorageSettings

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Peer:
    """A peer engine whose stored pages this engine can translate: its stores (one per TP rank
    of the peer), its page format (full heads after joining ranks) and the pair's mapper."""

    settings: PeerSettings
    stores: list[HiCacheStorage]
    page: PageFormat
    mapper: KVMapper

    def count(self, keys: list[str]) -> int:
        """Leading keys whose pages every rank of the peer holds."""
        return min(store.batch_exists(keys) for store in self.stores)

    def fetch(self, keys: list[str]) -> list[torch.Tensor]:
        """Leading available pages, each [2, page, layers, heads, dim] with all of the peer's
        heads (ranks joined on the head axis)."""
        keys = keys[: self.count(keys)]
        per_rank = [
            store.batch_get(keys, [self.page.empty_page() for _ in keys]) for store in self.stores
        ]
        pages = []
        for shards in zip(*per_rank):
            if any(shard is None for shard in shards):
                break
            pages.append(torch.cat([self.page.to_tokens(s) for s in shards], dim=3))
        return pages


class KVMapStorage(HiCacheStorage):
    """HiCache storage with cross-model translation on the read side (see module docstring).

    Constructed by SGLang's StorageBackendFactory as ``cls(storage_config, kwargs)``; the host
    pool arrives later through ``register_mem_pool_host``, which builds the inner store and
    connects the peers. Needs ``"interface_v1": 1`` in the extra config (positions and
    provenance come with the v1 calls' ``extra_info``) and SGLang's
    ``"hicache_storage_pass_prefix_keys": true``.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None):
        self.storage_config = storage_config
        self.settings = StorageSettings.from_extra_config(storage_config.extra_config or {})
        self.counters: Counter[str] = Counter()
        self.translated = _RecentKeys(self.settings.remember_translated)
        self.inner: HiCacheStorage | None = None
        self.peers: list[Peer] = []
        self.page: PageFormat | None = None

    # -- set-up ---------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.page = _host_page_format(mem_pool_host)
        self.inner = _built_in(self.settings.inner_backend, self.storage_config, mem_pool_host)
        self.inner.register_mem_pool_host(mem_pool_host)
        self.peers = self._connect_peers() if self.settings.translate else []

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
            mapper = KVMapper.from_pretrained(settings.pack)
            peer = spec_from_pretrained(settings.model_path)
            _check_tokenizers(mapper, peer, own)
            check_models(mapper, peer, own)
            _check_geometry(mapper.target, self.page, self.storage_config.tp_size)
            page = _peer_page_format(settings, mapper.source, self.page.page_size)
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
        stores = [
            _built_in(self.settings.inner_backend, _peer_config(self.storage_config, settings, r))
            for r in range(settings.tp_size)
        ]
        log.info("sgl-kvmap: translating pages of %s with %s", settings.model_name, settings.pack)
        return Peer(settings, stores, page, mapper)

    # -- read side ------------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info=None) -> int:
        """Leading pages that are stored for this model, then translatable from a peer."""
        native = self.inner.batch_exists(keys, extra_info)
        if native == len(keys) or not self.peers:
            return native
        # SGLang passes prefix_keys=None both at a sequence start and when it passes none;
        # counting from position 0 is safe here because batch_get_v1 (which gets exact prefix
        # keys) checks again and refuses pages whose positions it cannot know.
        start = len(_prefix(extra_info) or []) + native
        if not self._may_translate_from(start):
            return native
        return native + max((peer.count(keys[native:]) for peer in self.peers), default=0)

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info=None
    ) -> list[bool]:
        """Native pages into the host pool, then the translated run after them.
        host_indices: [len(keys) * page_size] page-aligned host slots."""
        native = self._load_native(keys, host_indices, extra_info)
        ok = [True] * native + [False] * (len(keys) - native)
        if native < len(keys) and self.peers:
            size = self.page.page_size
            done = self._translate_into_host(
                keys[native:], host_indices[native * size :], extra_info, native
            )
            ok[native : native + done] = [True] * done
        return ok

    def _load_native(self, keys, host_indices, extra_info) -> int:
        """Copy the leading pages stored for this model into the host pool; how many."""
        count = self.inner.batch_exists(keys, extra_info)
        if count == 0:
            return 0
        host = self.mem_pool_host
        buffers = [host.get_dummy_flat_data_page() for _ in range(count)]
        loaded = 0
        for page in self.inner.batch_get(keys[:count], buffers):
            if page is None:
                break
            host.set_from_flat_data_page(int(host_indices[loaded * self.page.page_size]), page)
            loaded += 1
        self.counters["native_pages"] += loaded
        return loaded

    def _translate_into_host(self, keys, host_indices, extra_info, offset: int) -> int:
        prefix = _prefix(extra_info)
        if prefix is None:
            self._fallback(
                "positions_unknown", "no prefix_keys: set hicache_storage_pass_prefix_keys"
            )
            return 0
        start = len(prefix) + offset
        if not self._may_translate_from(start):
            return 0
        try:
            return self._translate_run(keys, host_indices, start)
        except Exception as error:  # noqa: BLE001 - any failure: SGLang prefills these pages itself
            log.exception("sgl-kvmap: translation failed")
            self._fallback("translation_error", str(error))
            return 0

    def _translate_run(self, keys, host_indices, start_page: int) -> int:
        for peer in self.peers:
            pages = peer.fetch(keys)
            if pages:
                break
        else:
            self._fallback("peer_page_missing", "no peer holds the next page")
            return 0
        size = self.page.page_size
        tokens = len(pages) * size
        source = torch.cat(pages, dim=1)  # [2, tokens, layers, heads, dim]
        spec = peer.mapper.target
        target = torch.empty(
            2, tokens, spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype=self.page.dtype
        )
        slots = torch.arange(tokens)
        positions = torch.arange(start_page * size, start_page * size + tokens)
        translate_pages(peer.mapper, _paged(source), slots, _paged(target), slots, positions)
        shard = _head_shard(target, self.page.heads, self.storage_config.tp_rank, spec.num_kv_heads)
        for i, key in enumerate(keys[: len(pages)]):
            page = self.page.from_tokens(shard[:, i * size : (i + 1) * size])
            self.mem_pool_host.set_from_flat_data_page(int(host_indices[i * size]), page)
            self.translated.add(key)
        self.counters["translated_pages"] += len(pages)
        return len(pages)

    def _may_translate_from(self, start_page: int) -> bool:
        """Attention sinks: the first sink tokens must be this model's own KV."""
        sinks = max(peer.mapper.sink_tokens for peer in self.peers)
        if start_page * self.page.page_size < sinks and not self.settings.translate_sinks:
            self._fallback("no_native_sink_page", "the prefix's first page is not stored natively")
            return False
        return True

    # -- write side -----------------------------------------------------------------------

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info=None
    ) -> list[bool]:
        """Store this model's pages, except translated ones and every page after one."""
        chain = (_prefix(extra_info) or []) + list(keys)
        first = next((i for i, key in enumerate(chain) if key in self.translated), len(chain))
        keep = max(0, first - (len(chain) - len(keys)))
        self.counters["pages_withheld"] += len(keys) - keep
        size = self.page.page_size
        pages = [self.mem_pool_host.get_data_page(int(host_indices[i * size])) for i in range(keep)]
        stored = self.inner.batch_set(list(keys[:keep]), pages) if keep else True
        return [bool(stored)] * keep + [True] * (len(keys) - keep)

    # -- the rest of the interface: this model's own pages, as the inner store has them ------

    def get(self, key, target_location=None, target_sizes=None):
        return self.inner.get(key, target_location, target_sizes)

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        return self.inner.batch_get(keys, target_locations, target_sizes)

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        if key in self.translated:
            return True
        return self.inner.set(key, value, target_location, target_sizes)

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        keep = [i for i, key in enumerate(keys) if key not in self.translated]
        return (
            self.inner.batch_set([keys[i] for i in keep], [values[i] for i in keep])
            if keep
            else True
        )

    def exists(self, key) -> bool:
        return self.inner.exists(key)

    def clear(self) -> None:
        self.inner.clear()

    def close(self) -> None:
        for store in [self.inner, *(s for peer in self.peers for s in peer.stores)]:
            if hasattr(store, "close"):
                store.close()

    def _fallback(self, reason: str, message: str) -> None:
        """Count a reason translation did not happen; log it the first time."""
        if not self.counters[f"fallback.{reason}"]:
            log.warning("sgl-kvmap: %s (%s); SGLang prefills instead", message, reason)
        self.counters[f"fallback.{reason}"] += 1
        return None


class _RecentKeys:
    """The most recent ``capacity`` page keys (an LRU set)."""

    def __init__(self, capacity: int):
        self.capacity, self._keys, self._lock = capacity, OrderedDict(), threading.Lock()

    def add(self, key: str) -> None:
        with self._lock:  # HiCache reads and writes from different threads
            self._keys[key] = None
            self._keys.move_to_end(key)
            if len(self._keys) > self.capacity:
                self._keys.popitem(last=False)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._keys


def _prefix(extra_info) -> list[str] | None:
    return getattr(extra_info, "prefix_keys", None)


def _paged(kv: torch.Tensor) -> PagedKV:
    """[2, tokens, layers, heads, dim] -> per-layer views [tokens, heads, dim]."""
    return PagedKV(list(kv[0].unbind(1)), list(kv[1].unbind(1)))


def _head_shard(kv: torch.Tensor, heads: int, tp_rank: int, total_heads: int) -> torch.Tensor:
    """This TP rank's KV heads of [2, tokens, layers, total_heads, dim] (replicated when the
    model has fewer KV heads than ranks, as SGLang does)."""
    if heads == total_heads:
        return kv
    first = tp_rank * heads if total_heads > heads else 0
    return kv[:, :, :, first : first + heads]


class _TokenizerMismatch(PairMismatchError):
    pass


def _check_tokenizers(mapper: KVMapper, peer: ModelSpec, own: ModelSpec) -> None:
    """Both engines and the pack must share one tokenizer (page keys are token hashes)."""
    for fitted, given in ((mapper.source, peer), (mapper.target, own)):
        try:
            check_pair(fitted, given)
        except PairMismatchError as error:
            raise _TokenizerMismatch(str(error)) from None


def _host_page_format(host) -> PageFormat:
    return PageFormat(
        host.layout, host.page_size, host.layer_num, host.head_num, host.head_dim, host.dtype
    )


def _peer_page_format(settings: PeerSettings, source: ModelSpec, page_size: int) -> PageFormat:
    if source.num_kv_heads % settings.tp_size:
        raise KVMapError(
            f"{source.num_kv_heads} KV heads do not split over {settings.tp_size} ranks"
        )
    heads = source.num_kv_heads // settings.tp_size
    return PageFormat(
        settings.layout, page_size, source.num_layers, heads, source.head_dim, settings.torch_dtype
    )


def _check_geometry(target: ModelSpec, page: PageFormat, tp_size: int) -> None:
    heads = max(1, target.num_kv_heads // tp_size)
    want = (target.num_layers, heads, target.head_dim)
    got = (page.layers, page.heads, page.head_dim)
    if want != got:
        raise KVMapError(
            f"this engine's host pool has (layers, kv heads, head_dim) {got}; the pack's target "
            f"needs {want} at tp_size {tp_size}"
        )


def _peer_config(own: HiCacheStorageConfig, peer: PeerSettings, rank: int) -> HiCacheStorageConfig:
    """The storage identity of one rank of the peer engine (same store, the peer's name)."""
    return dataclasses.replace(own, model_name=peer.model_name, tp_rank=rank, tp_size=peer.tp_size)


def _built_in(name: str, config: HiCacheStorageConfig, host=None) -> HiCacheStorage:
    if name == "dynamic":
        raise KVMapError("inner_backend must be a built-in backend (file, mooncake, hf3fs, ...)")
    return StorageBackendFactory.create_backend(name, config, host)
