"""The engine's own first page for every swap: compute a prompt's first page before the prompt.

An engine never translates a prefix's first page, its attention sinks (``StorageSettings.sinks``
"native" or "prime"): it translates only after a first page it holds as its own. A request whose
first page this engine holds nowhere would then be prefilled whole, however much of it a peer
stored; sessions that share no opening (per-user system prompts, a retrieved document first)
hit that on every first swap into an engine. Under ``sinks: "prime"`` (the default) the
``Primer`` finds such a request before it reaches the scheduler, and the engine computes the
request's first page first, as a request of that page alone with no new tokens: SGLang's own
way of caching the prefix that parallel samples share (``TokenizerManager._handle_batch_request``).
The request itself then matches that page on the device, and the pages after it are translated
from the peer as usual. The cost: one page of prefill and one pass through the scheduler.

Which requests are primed (``Primer.first_page``): a prompt long enough for a translated run
after its first page (SGLang's prefetch threshold, plus the tail the engine recomputes) whose
first page this engine has not stored, and whose first pages up to that length a peer stored
with their records. A first page this engine holds on its device but has not stored yet is
primed anyway (the priming request is then a one-page cache hit). Requests whose page keys the
scheduler seeds (an extra key or cache salt, a LoRA adapter) or that carry embeddings or images
are not primed, nor those whose id starts with ``NATIVE_REQUEST_PREFIX``: ``sgl-kvmap warm``
serves the opening every session shares so, and each engine computes all of it.

Where it runs: a live server primes in its TokenizerManager, through SGLang's plugin hooks
(``register``: the ``sgl_kvmap`` entry point of the group ``sglang.srt.plugins``, which SGLang
loads in each of its processes; it acts only in servers whose storage backend is KVMapStorage
with ``sinks: "prime"``, on a ``file`` store). The in-process engines (``engine.Engine``) call
``Primer.first_page`` before a request's prefetch and serve the page the same way.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
from array import array
from collections.abc import Sequence

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str

from .records import derived_key, record_key
from .settings import BACKEND, NATIVE_REQUEST_PREFIX, StorageSettings

log = logging.getLogger(__name__)

TOKENIZER_MANAGER = "sglang.srt.managers.tokenizer_manager.TokenizerManager._send_one_request"
READ_ONLY = {"max_size": 0, "min_free_space": 0}  # a store opened to look never evicts
_registered = False


@dataclasses.dataclass
class Primer:
    """Decides which prompts an engine computes the first page of before serving them.

    page_size: the engine's tokens per page; own: this engine's store (its TP rank 0);
    peers: each peer's store (its rank 0), where the peer's pages and their records are;
    pages_needed: the first pages a peer must hold for a priming to pay (page 0, the pages a
    prefetch needs to pass SGLang's threshold, the engine's recomputed tail)."""

    page_size: int
    own: HiCacheStorage
    peers: list[HiCacheStorage]
    pages_needed: int

    @classmethod
    def for_engine(
        cls, page_size: int, own: HiCacheStorage, peers: list[HiCacheStorage], *, threshold: int,
        tail_pages: int,
    ) -> Primer:  # fmt: skip
        """A primer for an engine whose prefetches need ``threshold`` tokens and that recomputes
        ``tail_pages`` pages of every translated run."""
        translated = max(1, math.ceil(threshold / page_size))
        return cls(page_size, own, peers, 1 + translated + tail_pages)

    def first_page(self, tokens: Sequence[int]) -> list[int] | None:
        """The first page of prompt ``tokens`` when the engine should compute it before the
        prompt (module docstring), else None."""
        # a prefetch covers every full page but the one holding the prompt's last token
        if (len(tokens) - 1) // self.page_size < self.pages_needed:
            return None
        keys = get_hash_str(
            list(tokens[: self.pages_needed * self.page_size]), None, page_size=self.page_size
        )
        if self.own.exists(keys[0]):
            return None
        if not any(_holds(peer, keys) for peer in self.peers):
            return None
        return list(tokens[: self.page_size])


def _holds(store: HiCacheStorage, keys: list[str]) -> bool:
    """Whether ``store`` holds every page of ``keys`` with its record (a page a peer computed
    over translated KV and stored apart counts too)."""
    return all(
        store.exists(record_key(key)) or store.exists(record_key(derived_key(key))) for key in keys
    )


# -- a live server: the TokenizerManager's hook ------------------------------------------------


def register() -> None:
    """SGLang's plugin entry point (group ``sglang.srt.plugins``, name ``sgl_kvmap``): hook the
    TokenizerManager's dispatch of a request to the scheduler."""
    global _registered
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TOKENIZER_MANAGER, _dispatch_after_first_page, HookType.AROUND)
    _registered = True


def registered() -> bool:
    """Whether this process loaded the plugin (SGLang loads it in each of a server's
    processes, unless ``SGLANG_PLUGINS`` leaves it out)."""
    return _registered


async def _dispatch_after_first_page(original, manager, tokenized) -> None:
    """TokenizerManager._send_one_request, after the engine computed the request's first page
    when it should (``Primer.first_page``)."""
    primer = _server_primer(manager)
    wanted = primer is not None and _plain(tokenized) and not _native(tokenized)
    page = primer.first_page(tokenized.input_ids) if wanted else None
    if page is not None:
        try:
            await _serve_first_page(original, manager, tokenized, page)
        except Exception as error:  # noqa: BLE001 - the request goes on; SGLang prefills it
            log.warning("sgl-kvmap: priming request %s failed: %s", tokenized.rid, error)
    return await original(manager, tokenized)


async def _serve_first_page(original, manager, tokenized, page: list[int]) -> None:
    """Serve ``page`` alone with no new tokens and wait for it, as SGLang caches the prefix of
    parallel samples (``TokenizerManager._handle_batch_request``)."""
    request = copy.copy(manager.rid_to_state[tokenized.rid].obj)
    request.regenerate_rid()
    request.stream, request.return_logprob = False, False
    first = copy.copy(tokenized)
    ids = tokenized.input_ids
    first.rid, first.input_ids = request.rid, array("q", page) if isinstance(ids, array) else page
    first.sampling_params = copy.copy(tokenized.sampling_params)
    first.sampling_params.max_new_tokens = 0
    first.stream, first.return_logprob = False, False
    manager._init_req_state(request)
    await original(manager, first)
    await manager._wait_one_response(request, None).__anext__()


def _native(tokenized) -> bool:
    """Whether the client asked for the request to be computed whole (``sgl-kvmap warm``)."""
    return str(tokenized.rid).startswith(NATIVE_REQUEST_PREFIX)


def _plain(tokenized) -> bool:
    """Whether the request's page keys are its tokens' alone and it is made of tokens only."""
    seeded = getattr(tokenized, "extra_key", None) or getattr(tokenized, "lora_id", None)
    other = tokenized.input_embeds is not None or tokenized.mm_inputs is not None
    return tokenized.input_ids is not None and not seeded and not other


def _server_primer(manager) -> Primer | None:
    """The primer of the server ``manager`` runs in (built on its first request), or None when
    the server does not prime."""
    if not hasattr(manager, "_kvmap_primer"):
        try:
            manager._kvmap_primer = _build_server_primer(manager.server_args)
        except Exception:  # noqa: BLE001 - serving goes on, swaps translate only after a first
            # page the engine holds
            log.exception("sgl-kvmap: cannot prime first pages on this server")
            manager._kvmap_primer = None
    return manager._kvmap_primer


def _build_server_primer(server_args) -> Primer | None:
    extra = _kvmap_extra_config(server_args)
    if extra is None:
        return None
    settings = StorageSettings.from_extra_config(extra)
    if settings.sinks != "prime" or not settings.translate or not settings.peers:
        return None
    if settings.inner_backend != "file" or getattr(server_args, "pp_size", 1) != 1:
        log.warning(
            "sgl-kvmap: first pages are primed only on a file store without pipeline "
            "parallelism; this server's swaps translate only after a first page it holds"
        )
        return None
    config = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=server_args.tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name=server_args.served_model_name,
        extra_config={**extra, **READ_ONLY},
    )
    own = StorageBackendFactory.create_backend("file", config, None)
    peers = [
        StorageBackendFactory.create_backend(
            "file", dataclasses.replace(config, model_name=p.model_name, tp_size=p.tp_size), None
        )
        for p in settings.peers
    ]
    threshold = _prefetch_threshold(server_args.hicache_storage_backend_extra_config)
    primer = Primer.for_engine(
        server_args.page_size, own, peers, threshold=threshold, tail_pages=settings.tail_pages
    )
    log.info("sgl-kvmap: priming first pages of at least %d pages", primer.pages_needed)
    return primer


def _kvmap_extra_config(server_args) -> dict | None:
    """The server's KVMapStorage extra config, or None when its storage backend is another."""
    if getattr(server_args, "hicache_storage_backend", None) != "dynamic":
        return None
    try:
        extra = json.loads(server_args.hicache_storage_backend_extra_config or "{}")
    except (TypeError, ValueError):
        return None
    if not isinstance(extra, dict):
        return None
    mine = all(extra.get(key) == value for key, value in BACKEND.items() if key != "backend_name")
    return extra if mine else None


def _prefetch_threshold(extra: str | None) -> int:
    """SGLang's prefetch threshold (tokens) under this extra config, read by its own parser."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    return HybridCacheController.parse_storage_backend_extra_config(extra)[1]
