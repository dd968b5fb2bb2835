"""Two engines' worth of real SGLang 0.5.23 objects on CPU, for the extension's tests.

Each ``Engine`` has what one SGLang server holds for its KV cache: a device pool, a paged
allocator, a UnifiedRadixCache, a page_first host pool and a HiCache storage backend built by
SGLang's own StorageBackendFactory. Moving rows between device and host is done by hand
(SGLang's kernels for it need CUDA); everything the extension touches is SGLang's code.
"""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass

import torch
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.mem_cache.utils import get_hash_str

from sgl_kvmap.capture import KVCache, LoadedModel, capture_kv, run

PAGE = 8
SLOTS = 512


def storage_config(model_name: str, extra: dict) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name=model_name, extra_config=json.loads(json.dumps(extra)),
    )  # fmt: skip


def page_keys(tokens: list[int]) -> list[str]:
    """SGLang's storage keys of the full pages of ``tokens``."""
    return get_hash_str(tokens[: len(tokens) // PAGE * PAGE], None, page_size=PAGE)


def info(prefix_keys):
    return HiCacheStorageExtraInfo(prefix_keys=prefix_keys)


@dataclass
class Engine:
    model: LoadedModel
    model_name: str  # the served model name = the folder the model was saved to
    device: MHATokenToKVPool
    allocator: PagedTokenToKVPoolAllocator
    tree: UnifiedRadixCache
    host: MHATokenToKVPoolHost
    storage: object

    @classmethod
    def build(cls, model: LoadedModel, model_name: str, extra: dict, dtype=torch.bfloat16):
        """An engine serving ``model`` under ``model_name`` with the storage extra config."""
        spec = model.spec
        device = MHATokenToKVPool(
            size=SLOTS, page_size=PAGE, dtype=dtype, head_num=spec.num_kv_heads,
            head_dim=spec.head_dim, layer_num=spec.num_layers, device="cpu",
            enable_memory_saver=False, start_layer=0, end_layer=spec.num_layers,
        )  # fmt: skip
        allocator = PagedTokenToKVPoolAllocator(SLOTS, PAGE, dtype, "cpu", device, need_sort=False)
        requests = ReqToTokenPool(
            size=4, max_context_len=SLOTS, device="cpu", enable_memory_saver=False
        )
        tree = UnifiedRadixCache(
            CacheInitParams(
                disable=False, req_to_token_pool=requests, token_to_kv_pool_allocator=allocator,
                page_size=PAGE, tree_components=(ComponentType.FULL,),
            )
        )  # fmt: skip
        with host_memory_budget_scope(1 << 28):
            host = MHATokenToKVPoolHost(
                device.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, "page_first",
                pin_memory=False, device="cpu", device_capacity_tokens=device.size,
                start_layer=0, end_layer=spec.num_layers,
            )  # fmt: skip
        storage = StorageBackendFactory.create_backend(
            "dynamic", storage_config(model_name, extra), mem_pool_host=None
        )
        storage.register_mem_pool_host(host)
        return cls(model, model_name, device, allocator, tree, host, storage)

    def prefill(self, tokens: list[int]) -> torch.Tensor:
        """Compute the KV of ``tokens`` with the model, put it in the pool and the tree.
        Returns the device slots [len(tokens)]."""
        assert len(tokens) % PAGE == 0, "whole pages only"
        cache = capture_kv(self.model.model, torch.tensor(tokens))
        slots = self.allocator.alloc(len(tokens))
        for layer, (k, v) in enumerate(zip(cache.keys, cache.values)):
            self.device.set_kv_buffer(None, slots, k, v, layer_id_override=layer)
        self.tree.insert(InsertParams(key=RadixKey(array("q", tokens)), value=slots))
        return slots

    def extend(self, tokens: list[int]) -> torch.Tensor:
        """Prefill ``tokens`` on top of the longest cached prefix, as the scheduler does;
        put the new KV in the pool and the tree. Returns the device slots of all tokens."""
        cached = self.cached(tokens)
        rest = torch.tensor(tokens[len(cached) :])
        full = run(self.model.model, rest, past=cached if len(cached) else None).cache
        slots = self.allocator.alloc(rest.numel())
        for layer, (k, v) in enumerate(zip(full.keys, full.values)):
            self.device.set_kv_buffer(
                None, slots, k[len(cached) :], v[len(cached) :], layer_id_override=layer
            )
        slots = torch.cat([self.cached_slots(tokens), slots])
        self.tree.insert(InsertParams(key=RadixKey(array("q", tokens)), value=slots))
        return slots

    def back_up(self, tokens: list[int], slots: torch.Tensor) -> list[bool]:
        """Write the full pages of ``tokens`` (at device ``slots``) to storage, as HiCache's
        write-through does: device -> host pool -> storage backend (v1 interface)."""
        keys = page_keys(tokens)
        host_slots = self.host.alloc(len(keys) * PAGE)
        for layer in range(self.model.spec.num_layers):
            self.host.kv_buffer[0, host_slots, layer] = self.device.k_buffer[layer][
                slots[: len(host_slots)]
            ]
            self.host.kv_buffer[1, host_slots, layer] = self.device.v_buffer[layer][
                slots[: len(host_slots)]
            ]
        return self.storage.batch_set_v1(keys, host_slots, info([]))

    def fetch(self, tokens: list[int]) -> int:
        """HiCache's prefetch of ``tokens`` from storage: batch_exists, then batch_get_v1 into
        the host pool, then host -> device and into the radix tree. Returns tokens fetched."""
        keys = page_keys(tokens)
        hits = self.storage.batch_exists(keys, info(None))
        if hits == 0:
            return 0
        host_slots = self.host.alloc(hits * PAGE)
        ok = self.storage.batch_get_v1(keys[:hits], host_slots, info([]))
        done = (ok + [False]).index(False)
        slots = self.allocator.alloc(done * PAGE)
        for layer in range(self.model.spec.num_layers):
            self.device.k_buffer[layer][slots] = self.host.kv_buffer[
                0, host_slots[: done * PAGE], layer
            ]
            self.device.v_buffer[layer][slots] = self.host.kv_buffer[
                1, host_slots[: done * PAGE], layer
            ]
        if done:
            self.tree.insert(
                InsertParams(key=RadixKey(array("q", tokens[: done * PAGE])), value=slots)
            )
        return done * PAGE

    def cached_slots(self, tokens: list[int]) -> torch.Tensor:
        """Device slots of the longest prefix of ``tokens`` the radix tree has (match_prefix)."""
        match = self.tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))
        path = self.tree.path_device_indices(match.last_device_node)
        return path[: match.device_prefix_len]

    def cached(self, tokens: list[int]) -> KVCache:
        """The KV the radix tree serves for the longest cached prefix of ``tokens``."""
        slots = self.cached_slots(tokens)
        layers = range(self.model.spec.num_layers)
        return KVCache(
            [self.device.k_buffer[layer][slots] for layer in layers],
            [self.device.v_buffer[layer][slots] for layer in layers],
            torch.arange(len(slots)),
        )
