"""One SGLang 0.5.23 scheduler's KV-cache half on CPU, driven along the route a live server takes
(the extension's tests and the in-process engines of ``sgl-kvmap bench``).

``Engine`` is built by SGLang's own factory (``mem_cache.registry.create_unified_radix_cache``)
under the server arguments ``sgl-kvmap sglang-args`` emits (HiCache, page_first host layout,
write-through, the ``dynamic`` storage backend with its extra config), so it holds what a
server holds: a UnifiedRadixCache (Rust tree core) with its HybridCacheController, the
controller's storage threads (hit query, IO, backup, acks), a page_first
MHATokenToKVPoolHost, an MHATokenToKVPool, the paged allocator, a ReqToTokenPool, and the
storage backend made by StorageBackendFactory from the extra config (KVMapStorage).

``Engine.serve(tokens)`` takes one request through the scheduler's own calls, in order:

1. ``Scheduler._prefetch_kvcache`` (SGLang's function, called on this engine): the request's
   ``init_next_round_input`` (match_prefix), then ``prefetch_from_storage`` with the prefix
   keys and matched tokens the scheduler passes;
2. the scheduler loop's ``check_hicache_events`` until ``check_prefetch_progress`` reports the
   prefetch done: the controller's hit query (``batch_exists``), host allocation, the page
   transfer (``batch_get_v1``) and its acks, ``insert_host``; then ``pop_prefetch_loaded_span``;
3. ``init_next_round_input`` again and the calls PrefillAdder makes for a host hit:
   ``init_load_back(InitLoadBackParams(...))``, the prefix length update, ``tree.lock``;
4. ``ScheduleBatch.init_new`` + ``prepare_for_extend`` (slots and the request's token row),
   then ``ready_to_load_host_cache`` (the host -> device load of the prefix);
5. the forward: the Hugging Face model computes the extend tokens over the prefix KV read from
   the device pool through the request's token row, and writes their KV with
   ``set_kv_buffer`` as SGLang's attention backends do;
6. ``release_kv_cache(req, checkpoint=True)`` for the finished request: checkpoint, insert,
   write-through, ``write_backup_storage`` and the backup thread's ``batch_set_v1``, pumped
   until the backups are acknowledged.

Before step 1, a request whose first page the engine should compute first (``priming``, which a
server runs in its TokenizerManager) has that page served alone, through the same steps.

Substituted, because they need CUDA: the host pool is allocated unpinned (pinning needs a CUDA
driver), and its two device<->host copies (``load_to_device_per_layer`` and
``backup_from_device_all_layer``, sgl_kernel's ``transfer_kv_*`` kernels) are torch indexing
copies with the same effect for the page_first layout. The host pool is sized against a fixed
1 GiB budget (a server keeps 10 GB of the machine's free memory in reserve, which a test
machine running the models beside it may not have). The process's parallel ranks are stamped
(rank 0 of its TP group, or the rank asked for), as a server's launcher publishes them.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import time
from array import array
from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req, ScheduleBatch
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.common import release_kv_cache
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_unified_radix_cache
from sglang.srt.mem_cache.utils import get_hash_str
from sglang.srt.runtime_context import get_context, get_parallel
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from sgl_kvmap.core.cache import KVCache
from sgl_kvmap.models.capture import LoadedModel, run
from sgl_kvmap.sglang.heads import rank_heads
from sgl_kvmap.sglang.settings import prefetch_threshold_keys
from sgl_kvmap.sglang.storage import STAGES

PAGE = 8
SLOTS = 1024
_RANKS = (
    "pp_rank",
    "moe_ep_rank",
    "moe_dp_rank",
    "moe_tp_rank",
    "attn_cp_rank",
    "dcp_rank",
    "attn_dcp_rank",
    "attn_dp_rank",
    "dp_rank",
)


def _unpinned_host_pool():
    original = MHATokenToKVPoolHost.__init__

    def __init__(self, *args, **kwargs):
        kwargs["pin_memory"] = False
        original(self, *args, **kwargs)

    return __init__


def _load_to_device_per_layer(
    self, device_pool, host_indices, device_indices, layer_id, io_backend, *, is_draft=False
):
    device_pool.k_buffer[layer_id][device_indices] = self.kv_buffer[0, host_indices, layer_id]
    device_pool.v_buffer[layer_id][device_indices] = self.kv_buffer[1, host_indices, layer_id]


def _backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend):
    for layer in range(self.layer_num):
        self.kv_buffer[0, host_indices, layer] = device_pool.k_buffer[layer][device_indices]
        self.kv_buffer[1, host_indices, layer] = device_pool.v_buffer[layer][device_indices]


@functools.cache
def _substitute_cuda_copies() -> None:
    """The CPU substitutions of the module docstring, made on SGLang's host pool class once, when
    the first engine is built (not on import: a process that only imports this module, a live
    server among them, keeps SGLang's own transfers)."""
    MHATokenToKVPoolHost.__init__ = _unpinned_host_pool()
    MHATokenToKVPoolHost.load_to_device_per_layer = _load_to_device_per_layer
    MHATokenToKVPoolHost.backup_from_device_all_layer = _backup_from_device_all_layer


def page_keys(tokens: list[int]) -> list[str]:
    """SGLang's storage keys of the full pages of ``tokens``."""
    return get_hash_str(tokens[: len(tokens) // PAGE * PAGE], None, page_size=PAGE)


@dataclass
class Served:
    """One request's outcome. reused: prompt tokens whose KV came from the tree, the host pool
    or storage (not computed); slots: the device slots of every prompt token; logits: the
    model's logits for the computed tokens, [computed, vocab]; tiers: where the reused tokens
    came from (``Tiers``)."""

    reused: int
    slots: torch.Tensor
    logits: torch.Tensor
    tiers: Tiers | None = None


@dataclass
class Tiers:
    """Where a request's reused prompt tokens came from, in the order the scheduler looks:
    device (the radix tree on the device), host (the HiCache host pool), storage (pages this
    model stored), translated (pages another model stored, translated by KVMapStorage);
    fallbacks: the pages KVMapStorage could not translate during this request's prefetch, by
    reason; primed: the first-page tokens the engine computed just before the request
    (``priming``), which its device tier then held (counted there as computed, not reused)."""

    device: int
    host: int
    storage: int
    translated: int
    fallbacks: dict[str, int]
    primed: int = 0


@dataclass(eq=False)
class Arrival:
    """A request whose prefetch has started (``Engine.arrive``): the prefix its device and host
    tiers matched, and the storage's counters before the prefetch."""

    req: Req
    tokens: list[int]
    device: int
    host: int
    counted: Counter
    primed: int = 0
    primed_s: float = 0.0  # serving its first page first (priming)
    started: float = 0.0  # time.perf_counter() when its prefetch started
    seconds: Counter = dataclasses.field(default_factory=Counter)  # the storage's, then


class _Worker:
    def register_hicache_layer_transfer_counter(self, counter) -> None:
        pass


class Engine:
    """A model served under ``name`` with the storage extra config ``extra`` (see module
    docstring); ``tp_rank``/``tp_size``: which shard of a tensor-parallel engine this is.

    The prefetch runs under the settings ``sgl-kvmap sglang-args`` emits: SGLang's ``timeout``
    stop policy with the deadline ``extra`` sets (SGLang's defaults without one) and SGLang's own
    prefetch threshold, unless ``prefetch_threshold`` (tokens) lowers it: the unit tests serve
    prompts of a few 8-token pages, below SGLang's 256 tokens, which changes which prompts
    prefetch at all, not how a prefetch runs."""

    def __init__(
        self,
        model: LoadedModel,
        name: str,
        extra: dict,
        tp_rank=0,
        tp_size=1,
        dtype=torch.bfloat16,
        layout="page_first",
        page_size=PAGE,
        slots=SLOTS,
        prefetch_threshold: int | None = None,
        prefetch_policy: str = "timeout",
    ):
        _substitute_cuda_copies()
        self.model, self.name, self.page_size, self.slots = model, name, page_size, slots
        self.heads = rank_heads(model.spec.num_kv_heads, tp_size, tp_rank)
        get_parallel().override_permanently(tp_rank=tp_rank, **dict.fromkeys(_RANKS, 0))
        self._args = get_context().override_server_args(
            model_path=name,
            served_model_name=name,
            device="cpu",
            page_size=page_size,
            tp_size=tp_size,
            enable_hierarchical_cache=True,
            hicache_ratio=2.0,
            hicache_mem_layout=layout,
            hicache_write_policy="write_through",
            hicache_storage_backend="dynamic",
            hicache_storage_prefetch_policy=prefetch_policy,
            hicache_storage_backend_extra_config=json.dumps(
                {**extra, **prefetch_threshold_keys(prefetch_threshold)}
            ),
        )
        server_args = self._args.install()
        try:
            self._build(server_args, tp_rank, tp_size, dtype)
        except BaseException:
            self._args.restore()
            raise
        self.storage = self.tree.cache_controller.storage_backend
        # what Scheduler._prefetch_kvcache reads from its scheduler
        self.tree_cache, self.enable_hicache_storage, self.enable_lmcache = self.tree, True, False
        self._served = 0
        self._waiting: list[Arrival] = []  # arrived, their prefetch not yet done
        self.last_tiers: Tiers | None = None
        self.last_stages: dict[str, float] = {}  # Engine.stages of the last admitted request
        self.primer = self.storage.primer()
        self.primed = 0  # first pages computed before the request that needed them

    def _build(self, server_args, tp_rank: int, tp_size: int, dtype: torch.dtype) -> None:
        spec = self.model.spec
        self.device = MHATokenToKVPool(
            size=self.slots,
            page_size=self.page_size,
            dtype=dtype,
            head_num=len(self.heads),
            head_dim=spec.head_dim,
            layer_num=spec.num_layers,
            device="cpu",
            enable_memory_saver=False,
            start_layer=0,
            end_layer=spec.num_layers,
        )
        self.allocator = PagedTokenToKVPoolAllocator(
            self.slots, self.page_size, dtype, "cpu", self.device, need_sort=False
        )
        self.requests = ReqToTokenPool(
            size=8, max_context_len=self.slots, device="cpu", enable_memory_saver=False
        )
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=self.requests,
            token_to_kv_pool_allocator=self.allocator,
            page_size=self.page_size,
        )
        with host_memory_budget_scope(1 << 30):
            self.tree = self._tree(server_args, params, tp_rank, tp_size)

    @staticmethod
    def _tree(server_args, params, tp_rank: int, tp_size: int):
        return create_unified_radix_cache(
            TreeCacheBuildContext(
                server_args=server_args,
                params=params,
                is_hybrid_swa=False,
                is_hybrid_ssm=False,
                enable_hierarchical_cache=True,
                disable_radix_cache=False,
                tp_worker=_Worker(),
                model_config=None,
                tp_size=tp_size,
                tp_rank=tp_rank,
                tp_group=None,
            )
        )

    def serve(self, tokens: list[int], prime: bool = True) -> Served:
        """One request of prompt ``tokens`` through the scheduler's steps (module docstring);
        ``prime``: False computes it whole, as a server does a request whose id asks for it
        (``settings.NATIVE_REQUEST_PREFIX``)."""
        return self.complete(self.arrive(tokens, prime))

    def complete(self, arrival: Arrival) -> Served:
        """An arrived request's steps 2-6 (``serve``, after ``arrive``)."""
        req, slots = self.admit(arrival)
        tokens = arrival.tokens
        past = self.pool_kv(slots[: req.prefix_len]) if req.prefix_len else None
        logits = self.compute(tokens, slots, req.prefix_len, past)
        self.finish(req, logits)
        return Served(req.prefix_len, slots, logits, self.last_tiers)

    def begin(self, tokens: list[int]) -> tuple[Req, torch.Tensor]:
        """Steps 1-4: prefetch, admission, allocation and load-back. Returns the request and
        the device slots of its prompt tokens."""
        return self.admit(self.arrive(tokens))

    def arrive(self, tokens: list[int], prime: bool = True) -> Arrival:
        """Step 1 for a request of prompt ``tokens``, as the scheduler does when it arrives: its
        prefetch starts. Requests that arrive before any is admitted prefetch concurrently.
        Before it, as a server's TokenizerManager does, the engine serves the prompt's first
        page alone when the primer says so (``priming``)."""
        page = self.primer.first_page(tokens) if self.primer and prime else None
        primed_s = 0.0
        if page is not None:
            started = time.perf_counter()
            self.serve(page)
            primed_s = time.perf_counter() - started
            self.primed += 1
        self._served += 1
        req = Req(
            f"{self.name}-{self._served}", "", array("q", tokens), SamplingParams(max_new_tokens=1)
        )
        counted, seconds = Counter(self.storage.counters), Counter(self.storage.seconds)
        started = time.perf_counter()
        Scheduler._prefetch_kvcache(self, req)
        primed = len(page) if page else 0
        arrival = Arrival(
            req, list(tokens), req.prefix_len, req.host_hit_length, counted, primed, primed_s,
            started, seconds,
        )  # fmt: skip
        self._waiting.append(arrival)
        return arrival

    def admit(self, arrival: Arrival) -> tuple[Req, torch.Tensor]:
        """Steps 2-4 for an arrived request: the scheduler loop until its prefetch is done (or
        cut), then admission, allocation and load-back. Returns the request and the device
        slots of its prompt tokens."""
        req, tokens, device, host = arrival.req, arrival.tokens, arrival.device, arrival.host
        counted = arrival.counted
        self._pump_until(lambda: arrival not in self._waiting)
        prefetched = time.perf_counter()
        self.tree.pop_prefetch_loaded_span(req.cache_request_handle)
        req.init_next_round_input(self.tree)
        self._admit(req)
        self.last_tiers = self._tiers(req.prefix_len, device, host, counted, arrival.primed)
        batch = ScheduleBatch.init_new(
            [req],
            self.requests,
            self.allocator,
            self.tree,
            SimpleNamespace(
                vocab_size=self.model.spec.config["vocab_size"], is_encoder_decoder=False
            ),
            False,
            SpeculativeAlgorithm.NONE,
        )
        batch.prepare_for_extend()
        self.tree.ready_to_load_host_cache()
        self.last_stages = self._stages(arrival, prefetched)
        return req, self.requests.req_to_token[req.kv.req_pool_idx, : len(tokens)].clone()

    def _stages(self, arrival: Arrival, prefetched: float) -> dict[str, float]:
        """Where an admitted request's time went before its forward, in seconds: ``primed``
        (its first page served first), ``prefetch`` (from the prefetch's start until the
        scheduler loop saw it done), ``load`` (admission, allocation and the host -> device
        load) and the storage's stages meanwhile (``storage.STAGES``; its workers' ``read``
        and ``map`` overlap the prefetch)."""
        seconds = Counter(self.storage.seconds)
        seconds.subtract(arrival.seconds)
        return {
            "primed": arrival.primed_s,
            "prefetch": prefetched - arrival.started,
            "load": time.perf_counter() - prefetched,
            **{stage: seconds[stage] for stage in STAGES},
        }

    def _tiers(
        self, reused: int, device: int, host: int, counted: Counter, primed: int = 0
    ) -> Tiers:
        """Split ``reused`` tokens by tier; ``counted``: the storage's counters before the
        prefetch. KVMapStorage hands SGLang this model's own pages first, then translated
        ones, and SGLang keeps a leading part of them, so what it kept beyond the native pages
        loaded since the request arrived is translated (exact for requests served one at a
        time; requests prefetching at once share the counters)."""
        new = Counter(self.storage.counters)
        new.subtract(counted)
        from_storage = reused - device - host
        native = min(from_storage, new["native_pages"] * self.page_size)
        translated = from_storage - native
        fallbacks = {
            name.removeprefix("fallback."): n
            for name, n in new.items()
            if name.startswith("fallback.") and n > 0
        }
        primed = min(primed, device)
        return Tiers(device - primed, host, native, translated, fallbacks, primed)

    def compute(
        self, tokens, slots, prefix: int, past: KVCache | None, logits: int | None = None
    ) -> torch.Tensor:
        """Step 5: the model over tokens[prefix:] after ``past`` (every KV head), writing this
        rank's heads of their KV at their slots. Returns the logits of the last ``logits`` of
        them (None: all), [logits, vocab]."""
        rest = torch.tensor(tokens[prefix:])
        keep = rest.numel() if logits is None else logits
        out = run(self.model.model, rest, past=past, logits_to_keep=keep)
        for layer, (k, v) in enumerate(zip(out.cache.keys, out.cache.values)):
            self.device.set_kv_buffer(
                None,
                slots[prefix:],
                k[prefix:, self.heads],
                v[prefix:, self.heads],
                layer_id_override=layer,
            )
        return out.logits

    def finish(self, req: Req, logits: torch.Tensor) -> None:
        """Step 6: the finished request's KV into the tree, the host pool and storage."""
        req.output_ids.append(int(logits[-1].argmax()))
        req.finished_reason = FINISH_LENGTH(1)
        release_kv_cache(req, self.tree, checkpoint=True)
        tree = self.tree
        self._pump_until(lambda: not tree.ongoing_backup and not tree.ongoing_write_through)

    def cached_slots(self, tokens: list[int]) -> torch.Tensor:
        """The device slots of the longest prefix of ``tokens`` this engine's tree holds on the
        device (what it computed or loaded for them, as it stored them)."""
        found = self.tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))
        return self.tree.path_device_indices(found.last_device_node)[: found.device_prefix_len]

    def pool_kv(self, slots: torch.Tensor) -> KVCache:
        """What this engine's device pool holds at ``slots``: L x [tokens, heads, dim]."""
        layers = range(self.model.spec.num_layers)
        return KVCache(
            [self.device.k_buffer[layer][slots].clone() for layer in layers],
            [self.device.v_buffer[layer][slots].clone() for layer in layers],
            torch.arange(len(slots)),
        )

    def close(self) -> None:
        """Stop the storage threads and let the pools go (SGLang's tree registers its shutdown
        with atexit, which would otherwise keep every engine alive until the process ends)."""
        self.tree.shutdown()
        atexit.unregister(self.tree.shutdown)
        self._args.restore()

    def _admit(self, req: Req) -> None:
        """PrefillAdder.add_one_req's calls for a request with a host hit, and its commit."""
        if req.needs_host_load_back():
            loaded = self.tree.init_load_back(
                InitLoadBackParams(
                    best_match_node=req.best_match_node,
                    host_hit_length=req.host_hit_length,
                    req=req,
                )
            )
            req.host_loaded_length, req.last_node = loaded
            req.prefix_len += req.host_loaded_length
            if self.tree.load_back_is_cache_owned():
                req.kv.cache_protected_len = req.prefix_len
        req.extend_end = len(req.full_untruncated_fill_ids)
        req.lock = self.tree.lock(req.last_node)

    def _pump_until(self, done, timeout: float = 60.0) -> None:
        """The scheduler loop's per-step HiCache polling, until ``done()``: its events, then the
        prefetch progress of every waiting request (as admission polls its waiting queue)."""
        started = time.monotonic()
        while True:
            self.tree.check_hicache_events()
            self._waiting = [
                arrival
                for arrival in self._waiting
                if not self.tree.check_prefetch_progress(arrival.req.cache_request_handle)
            ]
            if done():
                return
            if time.monotonic() - started > timeout:
                raise TimeoutError("HiCache did not settle")
            time.sleep(0.005)


class TPGroup:
    """The ranks of one tensor-parallel engine, each an ``Engine`` holding its KV heads (SGLang's
    rule, ``heads.rank_heads``); a request runs every rank's steps in lockstep, and the forward
    reads the prefix from the ranks' pools, every head once."""

    def __init__(self, model: LoadedModel, name: str, extra: dict, tp_size: int, **engine):
        self.ranks = [
            Engine(model, name, extra, rank, tp_size, **engine) for rank in range(tp_size)
        ]

    def serve(self, tokens: list[int]) -> list[Served]:
        begun = [rank.begin(tokens) for rank in self.ranks]
        prefixes = {req.prefix_len for req, _ in begun}
        assert len(prefixes) == 1, f"the ranks disagree on the cached prefix: {prefixes}"
        prefix = prefixes.pop()
        past = self.pool_kv([slots[:prefix] for _, slots in begun]) if prefix else None
        logits = [
            rank.compute(tokens, slots, prefix, past) for rank, (_, slots) in zip(self.ranks, begun)
        ][0]
        for rank, (req, _) in zip(self.ranks, begun):
            rank.finish(req, logits)
        return [Served(prefix, slots, logits) for _, slots in begun]

    def pool_kv(self, slots: list[torch.Tensor]) -> KVCache:
        """Every KV head once, from the ranks' pools (rank r's pool at ``slots[r]``)."""
        heads: dict[int, tuple[int, int]] = {}
        for r, rank in enumerate(self.ranks):
            for i, head in enumerate(rank.heads):
                heads.setdefault(head, (r, i))
        caches = [rank.pool_kv(s) for rank, s in zip(self.ranks, slots)]
        pick = [heads[h] for h in sorted(heads)]
        layers = range(len(caches[0].keys))
        return KVCache(
            [torch.stack([caches[r].keys[layer][:, i] for r, i in pick], 1) for layer in layers],
            [torch.stack([caches[r].values[layer][:, i] for r, i in pick], 1) for layer in layers],
            caches[0].positions,
        )

    def close(self) -> None:
        for rank in self.ranks:
            rank.close()
