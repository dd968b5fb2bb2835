"""A CPU stand-in for ``sgl_kernel``: live SGLang 0.5.23 servers in the CPU test environment.

No compiled ``sgl_kernel`` for CPU exists on the package index, and SGLang's CPU engine
(``SGLANG_USE_CPU_ENGINE=1``) imports two of its functions unconditionally:
``copy_all_layer_kv_cache_cpu`` (``sglang/kernels/ops/kvcache/cache_move.py``) and
``assign_req_to_token_pool_cpu`` (``sglang/srt/mem_cache/allocation.py``). Both are here in plain
torch, with the semantics of their call sites; ``kvcacheio`` holds the host <-> device KV
transfers of HiCache's host pools. The scheduler's imports also reach SGLang's speculative
decoding kernels, which import seven more CPU names at module level: they are here as functions
that raise NotImplementedError (speculative decoding is not served by this stand-in). Nothing is
registered under ``torch.ops.sgl_kernel``, so ``sglang.srt.utils.cpu_has_amx_support()`` stays
False and every layer takes its ``forward_native`` path.

It is importable only where ``sgl_kvmap/sglang/cpu_engine`` is on ``PYTHONPATH`` (the lines
``sgl-kvmap sglang-args --device cpu`` prints put it there); a GPU engine's lines never do.
"""

from __future__ import annotations

import ctypes

import torch

__version__ = "0.0.0+sgl-kvmap-cpu-stand-in"


def host_bytes(address: int, nbytes: int) -> torch.Tensor:
    """The ``nbytes`` bytes of this process's memory at ``address``, as a writable uint8 view
    (SGLang hands these kernels raw pointers; on the CPU they are host addresses)."""
    if nbytes <= 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer((ctypes.c_ubyte * nbytes).from_address(address), dtype=torch.uint8)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """For every KV buffer i (``data_ptrs[i]``: its address, ``strides[i]``: bytes per token
    slot), copy the slot rows ``src_loc`` onto the rows ``tgt_loc`` (all rows are read before
    any is written, as the Triton kernel does within one launch).
    data_ptrs, strides: [buffers]; tgt_loc, src_loc: [locs] int64 slot indices."""
    if tgt_loc.numel() == 0:
        return
    tgt, src = tgt_loc.long().cpu(), src_loc.long().cpu()
    rows = int(torch.maximum(tgt.max(), src.max())) + 1
    for address, stride in zip(data_ptrs.tolist(), strides.tolist()):
        buffer = host_bytes(int(address), rows * int(stride)).view(rows, int(stride))
        buffer[tgt] = buffer[src]


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new slots into its row of the token pool: request i's row
    ``req_pool_indices[i]`` gets, at columns ``start_offset[i]:end_offset[i]``, the next
    ``end - start`` entries of ``out_cache_loc`` (requests in order, packed back to back).
    req_to_token: [requests, pool_len]; the other tensors: [batch]; out_cache_loc: [slots]."""
    taken = 0
    rows = zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist())
    for row, start, end in rows:
        if not 0 <= start <= end <= pool_len:
            raise ValueError(f"columns {start}:{end} outside a token row of {pool_len}")
        req_to_token[row, start:end] = out_cache_loc[taken : taken + end - start]
        taken += end - start


def _not_implemented(name: str):
    def kernel(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not implemented by sgl-kvmap's CPU stand-in "
            "(sgl_kvmap/sglang/cpu_engine; speculative decoding is not supported there)"
        )

    kernel.__name__ = name
    return kernel


# imported at module level by sglang/kernels/ops/speculative/{spec_tree,cache_locs,eagle,
# multi_layer_eagle}.py under the CPU engine; called only by speculative decoding
for _name in (
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu",
):
    globals()[_name] = _not_implemented(_name)
