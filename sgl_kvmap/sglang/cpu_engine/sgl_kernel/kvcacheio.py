"""Torch versions of ``sgl_kernel.kvcacheio``: HiCache's host <-> device KV copies, for a CPU
engine whose "device" pool is host memory too (CPU test environment only; see the package).

Same names, arguments and effect as sgl-kernel's CUDA kernels (``csrc/kvcacheio/transfer.cu``)
as ``sglang/srt/mem_cache/pool_host/mha.py`` calls them. Indices are token slots (int64); an item
is one token's K (or V) of one layer, ``item_size`` bytes. Layouts, by byte offset of item
(slot ``p``, layer ``l``) from the buffer's start:

- ``lf`` (layer first, one buffer per layer or one table of per-layer addresses):
  ``p * item_size`` within layer ``l``'s buffer;
- ``pf`` (page first, the host pool's ``[slots, layers, heads, head_dim]``):
  ``p * layout_dim + l * item_size`` (``layout_dim = layers * item_size``);
- ``ph`` (page head, ``[pages, heads, page_size, layers, head_dim]``): per head, as the kernel's
  ``get_global_offset_ph``.

The ``*_direct*`` functions take tensors and copy whole pages, as the C++ host code does. The
kernels skip an item whose source or destination index is negative; so do these. Pointer
tables (``*_layers``) hold host addresses (the CPU engine's device pool is in host memory).
"""

from __future__ import annotations

import torch

from . import host_bytes


def _address(buffer: torch.Tensor | int) -> int:
    return buffer.data_ptr() if isinstance(buffer, torch.Tensor) else int(buffer)


def _copy_rows(src, src_rows: torch.Tensor, dst, dst_rows: torch.Tensor, row_bytes: int) -> None:
    """dst's rows ``dst_rows`` = src's rows ``src_rows``, rows of ``row_bytes`` bytes counted from
    each buffer's start (a tensor or an address). Every source row is read before any is
    written."""
    if src_rows.numel() == 0:
        return
    src_view = _rows(src, int(src_rows.max()) + 1, row_bytes)
    dst_view = _rows(dst, int(dst_rows.max()) + 1, row_bytes)
    dst_view[dst_rows] = src_view[src_rows]


def _rows(buffer, count: int, row_bytes: int) -> torch.Tensor:
    """The first ``count`` rows of ``row_bytes`` bytes of ``buffer``, as a uint8 [count, row_bytes]
    view; a tensor is checked to hold them."""
    if isinstance(buffer, torch.Tensor):
        storage = buffer.untyped_storage()
        room = storage.nbytes() - (buffer.data_ptr() - storage.data_ptr())
        if count * row_bytes > room:
            raise IndexError(
                f"an index reaches byte {count * row_bytes} of a buffer with {room} bytes"
            )
    return host_bytes(_address(buffer), count * row_bytes).view(count, row_bytes)


def _pairs(src_indices: torch.Tensor, dst_indices: torch.Tensor):
    if src_indices.numel() != dst_indices.numel():
        raise ValueError("Source and destination indices must have the same length")
    src, dst = src_indices.long().cpu(), dst_indices.long().cpu()
    keep = (src >= 0) & (dst >= 0)
    return src[keep], dst[keep]


def _check_item(item_size: int, divisor: int = 1) -> None:
    if item_size % 8 or item_size % divisor:
        raise ValueError(f"item size {item_size} must be divisible by 8 and by {divisor}")


def _copy_items(pairs, src_indices, dst_indices, item_size, src_pf=None, dst_pf=None) -> None:
    """Copy every (slot, layer) item of ``pairs``, [(src buffer, dst buffer, layer id)]: a side
    with a layout_dim (``src_pf`` / ``dst_pf``) is page first (item rows ``p * layout_dim /
    item_size + layer``), a side without one is layer first (rows ``p`` of that layer's buffer)."""
    _check_item(item_size)
    src_slots, dst_slots = _pairs(src_indices, dst_indices)
    for src_buffer, dst_buffer, layer in pairs:
        src_rows = _page_first_rows(src_slots, layer, item_size, src_pf)
        dst_rows = _page_first_rows(dst_slots, layer, item_size, dst_pf)
        _copy_rows(src_buffer, src_rows, dst_buffer, dst_rows, item_size)


def _page_first_rows(slots, layer, item_size, layout_dim):
    if layout_dim is None:
        return slots
    if layout_dim % item_size:
        raise ValueError(f"layout dim {layout_dim} is not a multiple of item size {item_size}")
    return slots * (layout_dim // item_size) + layer


# -- layer first <-> layer first ---------------------------------------------------------------


def transfer_kv_per_layer(
    src_k, dst_k, src_v, dst_v, src_indices, dst_indices, item_size,
    block_quota=2, num_warps_per_block=32,
) -> None:  # fmt: skip
    """One layer, layer-first on both sides: dst_k[dst_indices] = src_k[src_indices] (and V)."""
    pairs = [(src_k, dst_k, 0), (src_v, dst_v, 0)]
    _copy_items(pairs, src_indices, dst_indices, item_size)


def transfer_kv_all_layer(
    src_k_layers, dst_k_layers, src_v_layers, dst_v_layers, src_indices, dst_indices, item_size,
    num_layers, block_quota=2, num_warps_per_block=32,
) -> None:  # fmt: skip
    """Every layer, layer-first on both sides, through tables of per-layer addresses [layers]."""
    _check_layers(num_layers, src_k_layers)
    tables = [t.tolist() for t in (src_k_layers, dst_k_layers, src_v_layers, dst_v_layers)]
    pairs = [(s, d, 0) for s, d in zip(tables[0] + tables[2], tables[1] + tables[3])]
    _copy_items(pairs, src_indices, dst_indices, item_size)


def transfer_kv_per_layer_mla(
    src, dst, src_indices, dst_indices, item_size, block_quota=2, num_warps_per_block=32
) -> None:
    """``transfer_kv_per_layer`` for one latent buffer (MLA: no V)."""
    _copy_items([(src, dst, 0)], src_indices, dst_indices, item_size)


def transfer_kv_all_layer_mla(
    src_layers, dst_layers, src_indices, dst_indices, item_size, num_layers,
    block_quota=2, num_warps_per_block=32,
) -> None:  # fmt: skip
    """``transfer_kv_all_layer`` for one latent buffer per layer (MLA: no V)."""
    _check_layers(num_layers, src_layers)
    pairs = [(s, d, 0) for s, d in zip(src_layers.tolist(), dst_layers.tolist())]
    _copy_items(pairs, src_indices, dst_indices, item_size)


def _check_layers(num_layers: int, table: torch.Tensor) -> None:
    if num_layers != table.size(0):
        raise ValueError("Number of layers in source k tensor does not match num_layers")


# -- page first <-> layer first (the host pool's page_first layout) ---------------------------


def transfer_kv_per_layer_pf_lf(
    src_k, dst_k, src_v, dst_v, src_indices, dst_indices, layer_id, item_size, src_layout_dim,
    block_quota=2, num_warps_per_block=32,
) -> None:  # fmt: skip
    """Host (page first) -> device (layer first), layer ``layer_id``: the load-back."""
    pairs = [(src_k, dst_k, layer_id), (src_v, dst_v, layer_id)]
    _copy_items(pairs, src_indices, dst_indices, item_size, src_pf=src_layout_dim)


def transfer_kv_all_layer_lf_pf(
    src_k_layers, dst_k, src_v_layers, dst_v, src_indices, dst_indices, item_size, dst_layout_dim,
    num_layers, block_quota=2, num_warps_per_block=32,
) -> None:  # fmt: skip
    """Device (per-layer address table) -> host (page first), every layer: the write-back."""
    _check_layers(num_layers, src_k_layers)
    pairs = [(a, dst_k, layer) for layer, a in enumerate(src_k_layers.tolist())]
    pairs += [(a, dst_v, layer) for layer, a in enumerate(src_v_layers.tolist())]
    _copy_items(pairs, src_indices, dst_indices, item_size, dst_pf=dst_layout_dim)


def transfer_kv_per_layer_mla_pf_lf(
    src, dst, src_indices, dst_indices, layer_id, item_size, src_layout_dim,
    block_quota=2, num_warps_per_block=32,
) -> None:  # fmt: skip
    """``transfer_kv_per_layer_pf_lf`` for one latent buffer (MLA: no V)."""
    pairs = [(src, dst, layer_id)]
    _copy_items(pairs, src_indices, dst_indices, item_size, src_pf=src_layout_dim)


def transfer_kv_all_layer_mla_lf_pf(
    src_layers, dst, src_indices, dst_indices, item_size, dst_layout_dim, num_layers,
    block_quota=2, num_warps_per_block=32,
) -> None:  # fmt: skip
    """``transfer_kv_all_layer_lf_pf`` for one latent buffer per layer (MLA: no V)."""
    _check_layers(num_layers, src_layers)
    pairs = [(a, dst, layer) for layer, a in enumerate(src_layers.tolist())]
    _copy_items(pairs, src_indices, dst_indices, item_size, dst_pf=dst_layout_dim)


# -- page head <-> layer first (the host pool's page_head layout) -----------------------------


def transfer_kv_per_layer_ph_lf(
    src_k, dst_k, src_v, dst_v, src_indices, dst_indices, layer_id, item_size, src_layout_dim,
    page_size, head_num, block_quota=2, num_warps_per_block=32,
) -> None:  # fmt: skip
    """Host (page head) -> device (layer first), layer ``layer_id``, head by head."""
    _check_item(item_size, head_num)
    src_slots, dst_slots = _pairs(src_indices, dst_indices)
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        for head in range(head_num):
            src_rows = _page_head_rows(src_slots, layer_id, head, src_layout_dim, item_size,
                                       page_size, head_num)  # fmt: skip
            dst_rows = dst_slots * head_num + head
            _copy_rows(src, src_rows, dst, dst_rows, item_size // head_num)


def transfer_kv_all_layer_lf_ph(
    src_k_layers, dst_k, src_v_layers, dst_v, src_indices, dst_indices, item_size, dst_layout_dim,
    num_layers, page_size, head_num, block_quota=2, num_warps_per_block=32,
) -> None:  # fmt: skip
    """Device (per-layer address table) -> host (page head), every layer, head by head."""
    _check_item(item_size, head_num)
    _check_layers(num_layers, src_k_layers)
    src_slots, dst_slots = _pairs(src_indices, dst_indices)
    for table, dst in ((src_k_layers, dst_k), (src_v_layers, dst_v)):
        for layer, address in enumerate(table.tolist()):
            for head in range(head_num):
                src_rows = src_slots * head_num + head
                dst_rows = _page_head_rows(dst_slots, layer, head, dst_layout_dim, item_size,
                                           page_size, head_num)  # fmt: skip
                _copy_rows(address, src_rows, dst, dst_rows, item_size // head_num)


def _page_head_rows(slots, layer, head, layout_dim, item_size, page_size, head_num):
    """Rows of head_size bytes of item (slot, layer, head) in the page-head layout: the byte
    offset ``get_global_offset_ph`` computes, divided by head_size (= item_size / head_num)."""
    head_size = item_size // head_num
    if layout_dim % head_size:
        raise ValueError(f"layout dim {layout_dim} is not a multiple of head size {head_size}")
    per_head_token = layout_dim // head_num // head_size  # = layers
    page_rows = page_size * layout_dim // head_size
    return (
        slots // page_size * page_rows
        + head * page_size * per_head_token
        + slots % page_size * per_head_token
        + layer
    )


# -- direct: whole pages, tensors on both sides --------------------------------------------------


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size) -> None:
    """For every layer j: dst_layers[j][dst_indices] = src_layers[j][src_indices] (the C++ code
    copies runs of consecutive indices; the effect is the same). Tensors [slots, ...]."""
    _check_pages(src_layers, dst_layers, src_indices, dst_indices, page_size)
    src, dst = src_indices.long().cpu(), dst_indices.long().cpu()
    for src_layer, dst_layer in zip(src_layers, dst_layers):
        dst_layer[dst] = src_layer[src].to(dst_layer.device)


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size
) -> None:
    """Host (page_first_direct: [pages, layers, page_size, ...] per K and V) -> device layers
    ``dst_ptrs`` ([K layers..., V layers...], or one list of latents for MLA), starting at host
    layer ``layer_id``; page by page, from the first index of each page."""
    _check_indices(src_indices, dst_indices, page_size)
    is_mla = len(src_ptrs) == 1
    layers = len(dst_ptrs) if is_mla else len(dst_ptrs) // 2
    src_pages, dst_rows = _page_runs(src_indices, dst_indices, page_size)
    for j in range(layers):
        for side in range(1 if is_mla else 2):
            dst = dst_ptrs[j + side * layers]
            dst[dst_rows] = src_ptrs[side][src_pages, layer_id + j].to(dst.device)


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs, dst_ptrs, src_indices, dst_indices, page_size
) -> None:
    """Device layers ``src_ptrs`` ([K layers..., V layers...], or latents for MLA) -> host
    (page_first_direct), every layer; page by page, from the first index of each page."""
    _check_indices(src_indices, dst_indices, page_size)
    is_mla = len(dst_ptrs) == 1
    layers = len(src_ptrs) if is_mla else len(src_ptrs) // 2
    dst_pages, src_rows = _page_runs(dst_indices, src_indices, page_size)
    for j in range(layers):
        for side in range(1 if is_mla else 2):
            dst = dst_ptrs[side]
            dst[dst_pages, j] = src_ptrs[j + side * layers][src_rows].to(dst.device)


def _page_runs(paged_indices, token_indices, page_size):
    """(page numbers of the page-first side, [pages, page_size] token rows of the other side),
    both from the first index of every page, as the C++ code reads them."""
    firsts = slice(0, None, page_size)
    pages = paged_indices.long().cpu()[firsts] // page_size
    starts = token_indices.long().cpu()[firsts]
    return pages, starts[:, None] + torch.arange(page_size)


def _check_indices(src_indices, dst_indices, page_size) -> None:
    if src_indices.numel() != dst_indices.numel():
        raise ValueError("Source and destination indices must have the same length")
    if page_size <= 0:
        raise ValueError("Page size must be positive")
    if src_indices.numel() % page_size:
        raise ValueError("Source indices size must be divisible by page size")


def _check_pages(src_layers, dst_layers, src_indices, dst_indices, page_size) -> None:
    if len(src_layers) != len(dst_layers):
        raise ValueError("Source and destination layers must have the same number of layers")
    _check_indices(src_indices, dst_indices, page_size)
