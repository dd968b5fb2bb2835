"""sgl-kvmap's SGLang plugin: what a server's TokenizerManager does for KVMapStorage.

SGLang loads it in each of a server's processes (the ``sgl_kvmap`` entry point of the group
``sglang.srt.plugins``; ``SGLANG_PLUGINS``, when set, must name it). In a server whose storage
backend is KVMapStorage translating from peers over a ``file`` store it hooks two of the
TokenizerManager's steps; in any other server it does nothing:

- the dispatch of a request to the scheduler (``_send_one_request``): under ``sinks: "prime"``
  the engine first computes the request's first page when it should (``priming``);
- the responses of a request (``_wait_one_response``): ``meta_info["kvmap"]`` tells the client
  what sgl-kvmap did for it: ``translated_tokens`` (of SGLang's ``storage`` tokens, those another
  model stored, translated: the pages in that span this engine has not stored as its own),
  ``primed_tokens`` (its first page, computed apart just before it), ``primed_seconds`` (the
  time that took, round trip included) and ``status``:
  "translated", or "not translated" (its prefix was the engine's own, or computed).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import time
from array import array
from pathlib import Path

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from ..core.pack import read_config
from .priming import Primer
from .settings import BACKEND, NATIVE_REQUEST_PREFIX, PeerSettings, StorageSettings

log = logging.getLogger(__name__)

MANAGER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
READ_ONLY = {"max_size": 0, "min_free_space": 0}  # a store opened to look never evicts
MAX_REQUESTS_KEPT = 4096  # prompts kept for reports; the oldest go first (a response never read)
_registered = False


@dataclasses.dataclass
class ServerView:
    """What the TokenizerManager of a KVMapStorage server knows of sgl-kvmap: the stores it
    reads (``primer.own``, ``primer.peers``), whether it primes, and each request in flight:
    rid -> (its prompt's token ids, the tokens primed for it, the seconds that took)."""

    primer: Primer
    prime: bool
    requests: dict[str, tuple[list[int], int, float]] = dataclasses.field(default_factory=dict)

    def keep(self, rid: str, tokens: list[int], primed: int, seconds: float = 0.0) -> None:
        """Remember request ``rid``'s prompt for its report (at most ``MAX_REQUESTS_KEPT``)."""
        self.requests[rid] = (tokens, primed, seconds)
        while len(self.requests) > MAX_REQUESTS_KEPT:
            del self.requests[next(iter(self.requests))]

    def report(self, rid: str, details: dict) -> dict | None:
        """``meta_info["kvmap"]`` of request ``rid``, whose prompt SGLang reported cached as
        ``details`` (``cached_tokens_details``); None for a request this server did not see."""
        if rid not in self.requests:
            return None
        tokens, primed, seconds = self.requests[rid]
        start = int(details.get("device", 0)) + int(details.get("host", 0))
        stored = int(details.get("storage", 0))
        size = self.primer.page_size
        keys = self.primer.page_keys(tokens, (start + stored) // size)[start // size :]
        translated = sum(not self.primer.own.exists(key) for key in keys) * size
        status = "translated" if translated else "not translated"
        return {
            "translated_tokens": translated,
            "primed_tokens": primed,
            "primed_seconds": round(seconds, 6),
            "status": status,
        }


def register() -> None:
    """SGLang's plugin entry point: hook the TokenizerManager (module docstring)."""
    global _registered
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{MANAGER}._send_one_request", _send, HookType.AROUND)
    HookRegistry.register(f"{MANAGER}._wait_one_response", _responses, HookType.AROUND)
    _registered = True


def registered() -> bool:
    """Whether this process loaded the plugin."""
    return _registered


async def _send(original, manager, tokenized) -> None:
    """TokenizerManager._send_one_request, after the engine computed the request's first page
    when it should (``Primer.first_page``)."""
    view = _server_view(manager)
    if view is None or tokenized.input_ids is None:
        return await original(manager, tokenized)
    primed, seconds = 0, 0.0
    if view.prime and _plain(tokenized) and not _native(tokenized):
        page = view.primer.first_page(tokenized.input_ids)
        if page is not None:
            started = time.perf_counter()
            try:
                await _serve_first_page(original, manager, tokenized, page)
                primed = len(page)
            except Exception as error:  # noqa: BLE001 - the request goes on; SGLang prefills it
                log.warning("sgl-kvmap: priming request %s failed: %s", tokenized.rid, error)
            seconds = time.perf_counter() - started
    view.keep(tokenized.rid, list(tokenized.input_ids), primed, seconds)
    return await original(manager, tokenized)


def _responses(original, manager, obj, request=None):
    """TokenizerManager._wait_one_response, each response's ``meta_info`` with sgl-kvmap's
    report of the request (module docstring)."""
    view = _server_view(manager)
    responses = original(manager, obj, request)
    return responses if view is None else _reported(responses, view, obj.rid)


async def _reported(responses, view: ServerView, rid: str):
    try:
        report = None
        async for response in responses:
            meta = response.get("meta_info") if isinstance(response, dict) else None
            details = meta.get("cached_tokens_details") if isinstance(meta, dict) else None
            if report is None and isinstance(details, dict):
                report = view.report(rid, details)
            if report is not None:
                meta["kvmap"] = report
            yield response
    finally:
        view.requests.pop(rid, None)


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
    return not seeded and not other


def _server_view(manager) -> ServerView | None:
    """What the server ``manager`` runs in knows of sgl-kvmap (built on its first request: the
    server's own warm-up, before it reports healthy), or None when sgl-kvmap has nothing to do
    there."""
    if not hasattr(manager, "_kvmap_view"):
        try:
            manager._kvmap_view = _build_view(manager.server_args)
        except Exception:  # noqa: BLE001 - serving goes on without priming and reports
            log.exception("sgl-kvmap: cannot read this server's stores; no priming, no reports")
            manager._kvmap_view = None
    return manager._kvmap_view


def _build_view(server_args) -> ServerView | None:
    extra = _kvmap_extra_config(server_args)
    if extra is None:
        return None
    settings = StorageSettings.from_extra_config(extra)
    peers = [p for p in settings.peers if _clears_floor(p, settings, server_args.page_size)]
    if not settings.translate or not peers:
        return None
    if settings.inner_backend != "file" or getattr(server_args, "pp_size", 1) != 1:
        log.warning(
            "sgl-kvmap: first pages are primed and requests reported only on a file store "
            "without pipeline parallelism; this server's swaps translate only after a first "
            "page it holds"
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
    stores = [
        _file_store(dataclasses.replace(config, model_name=p.model_name, tp_size=p.tp_size))
        for p in peers
    ]
    threshold = _prefetch_threshold(server_args.hicache_storage_backend_extra_config)
    primer = Primer.for_engine(
        server_args.page_size,
        _file_store(config),
        stores,
        threshold=threshold,
        tail_pages=settings.tail_pages,
    )
    prime = settings.sinks == "prime"
    if prime:
        log.info("sgl-kvmap: priming the first page of prompts of %d pages", primer.pages_needed)
    return ServerView(primer, prime)


def _clears_floor(peer: PeerSettings, settings: StorageSettings, page_size: int) -> bool:
    """Whether the engine's storage backend will translate ``peer``'s pages: its pack clears
    the quality floor, as KVMapStorage checks it when it connects (a pack it cannot read is
    not used either)."""
    try:
        metrics = read_config(Path(peer.pack)).get("metrics", {})
    except Exception:  # noqa: BLE001 - KVMapStorage refuses it too, counted there
        return False
    return settings.floor_refusal(metrics, page_size) is None


def _file_store(config: HiCacheStorageConfig) -> HiCacheStorage:
    return StorageBackendFactory.create_backend("file", config, None)


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
