"""The Triton body of ``translate_pages``: every layer's gather, RoPE and scatter in one launch.

The map itself is matrix products (``KVMapper.content_products``, cuBLAS on a GPU); around
them the reference path costs a gather, an unrope, a concatenation, a rope and a scatter per
layer and kind, each a separate kernel over the whole prefix. Here two kernels do all of it:

- ``_gather_content``: source pool slots -> the layer-major feature matrix ``[t, Ls * ws]``
  in the products' dtype, keys unroped on the way (grid: token blocks x source layers).
- ``_scatter_content``: the products' outputs -> target pool slots, keys roped on the way,
  cast as the reference casts (grid: token blocks x target layers).

Layers are reached through tables of their buffers' addresses (SGLang's KV pools keep one
tensor per layer), so neither kernel is launched per layer. The arithmetic is the
reference's, operation for operation (``rope.rope`` / ``rope.unrope`` in float32), so the
interpreter (``TRITON_INTERPRET=1``, the CPU tests) reproduces it exactly.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ..core.errors import KVMapError
from ..core.mapper import default_matmul_dtype
from ..core.spec import tables_for_spec

TOKENS_PER_PROGRAM = 16
_TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _rotate(
    x,
    row,
    rows,
    cols,
    mask,
    cos,
    sin,
    n_pairs,
    HEAD_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    INVERSE: tl.constexpr,
):
    """RoPE (or its inverse) of a [BLOCK_T, BLOCK_W] tile whose row pointers are ``row``: pair
    (a, b) -> (a c - b s, b c + a s); the inverse divides by c^2 + s^2 as ``rope.unrope``."""
    j = cols % HEAD_DIM
    if INTERLEAVED:
        first = j % 2 == 0
        pair = j // 2
        partner = tl.where(first, cols + 1, cols - 1)
    else:
        first = j < n_pairs
        pair = tl.where(first, j, j - n_pairs)
        partner = tl.where(first, cols + n_pairs, cols - n_pairs)
    rotary = mask & (j < 2 * n_pairs)[None, :]
    other = tl.load(row + partner[None, :], mask=rotary, other=0.0).to(tl.float32)
    table = rows[:, None] * n_pairs + pair[None, :]
    c = tl.load(cos + table, mask=rotary, other=1.0)
    s = tl.load(sin + table, mask=rotary, other=0.0)
    sign = tl.where(first, 1.0, -1.0)[None, :]
    if INVERSE:
        rotated = (x * c + sign * other * s) / (c * c + s * s)
    else:
        rotated = x * c - sign * other * s
    return tl.where(rotary, rotated, x)


@triton.jit
def _gather_content(
    layer_ptrs,
    slots,
    cos,
    sin,
    out,
    tokens,
    slot_stride,
    n_pairs,
    WIDTH: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    POOL: tl.constexpr,
    ROTATE: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """out[:, layer * WIDTH : (layer + 1) * WIDTH] = pool[layer][slots] (unroped if ROTATE)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    layer = tl.program_id(1)
    cols = tl.arange(0, BLOCK_W)
    mask = (rows < tokens)[:, None] & (cols < WIDTH)[None, :]
    slot = tl.load(slots + rows, mask=rows < tokens, other=0).to(tl.int64)
    pool = tl.load(layer_ptrs + layer).to(tl.pointer_type(POOL))
    row = pool + slot[:, None] * slot_stride
    x = tl.load(row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if ROTATE:
        x = _rotate(x, row, rows, cols, mask, cos, sin, n_pairs, HEAD_DIM, INTERLEAVED, True)
    out_row = out + rows[:, None].to(tl.int64) * (tl.num_programs(1) * WIDTH) + layer * WIDTH
    tl.store(out_row + cols[None, :], x.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _scatter_content(
    y_ptrs,
    y_strides,
    slots,
    cos,
    sin,
    layer_ptrs,
    tokens,
    slot_stride,
    n_pairs,
    WIDTH: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    Y: tl.constexpr,
    ROUND: tl.constexpr,
    POOL: tl.constexpr,
    ROTATE: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """pool[layer][slots] = y[layer] (roped if ROTATE), rounded to ROUND, then stored as POOL."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    layer = tl.program_id(1)
    cols = tl.arange(0, BLOCK_W)
    mask = (rows < tokens)[:, None] & (cols < WIDTH)[None, :]
    y_base = tl.load(y_ptrs + layer).to(tl.pointer_type(Y))
    row = y_base + rows[:, None].to(tl.int64) * tl.load(y_strides + layer)
    y = tl.load(row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if ROTATE:
        y = _rotate(y, row, rows, cols, mask, cos, sin, n_pairs, HEAD_DIM, INTERLEAVED, False)
    slot = tl.load(slots + rows, mask=rows < tokens, other=0).to(tl.int64)
    pool = tl.load(layer_ptrs + layer).to(tl.pointer_type(POOL))
    tl.store(pool + slot[:, None] * slot_stride + cols[None, :], y.to(ROUND).to(POOL), mask=mask)


def supports(pool) -> bool:
    """Whether these kernels can address ``pool`` (a ``PagedKV``): one dtype they know, one
    device, every layer's [slots, heads, dim] rows dense and equally strided."""
    layers = pool.keys + pool.values
    first = layers[0]
    return all(
        layer.dtype == first.dtype in _TRITON_DTYPES
        and layer.device == first.device
        and layer.stride(2) == 1
        and layer.stride(1) == layer.shape[2]
        and layer.stride(0) == first.stride(0)
        for layer in layers
    )


def translate(
    mapper, source, source_slots, target, target_slots, positions, matmul_dtype=None
) -> None:
    """``translate_pages`` on Triton (arguments as there, already checked, both pools
    ``supports``-ed)."""
    if not source.keys[0].is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise KVMapError("Triton runs CUDA pools, or CPU tensors under TRITON_INTERPRET=1")
    tokens = positions.numel()
    if tokens == 0:
        return
    pool_dtype = source.keys[0].dtype
    matmul_dtype = matmul_dtype or default_matmul_dtype(pool_dtype)
    device = source.keys[0].device
    src_tables, tgt_tables = (
        [table.contiguous() for table in tables_for_spec(spec, positions.to(device))]
        for spec in (mapper.source, mapper.target)
    )  # [t, rotary_dim // 2] each, rows dense
    grid = lambda layers: (triton.cdiv(tokens, TOKENS_PER_PROGRAM), layers)  # noqa: E731
    for kind, src_layers, dst_layers in (
        ("k", source.keys, target.keys),
        ("v", source.values, target.values),
    ):
        rotate = kind == "k"
        features = torch.empty(
            tokens, len(src_layers) * mapper.source.kv_width, dtype=matmul_dtype, device=device
        )
        _gather_content[grid(len(src_layers))](
            _addresses(src_layers),
            source_slots,
            *src_tables,
            features,
            tokens,
            src_layers[0].stride(0),
            src_tables[0].shape[1],
            WIDTH=mapper.source.kv_width,
            HEAD_DIM=mapper.source.head_dim,
            POOL=_TRITON_DTYPES[pool_dtype],
            ROTATE=rotate,
            INTERLEAVED=mapper.source.rope_style == "interleaved",
            BLOCK_T=TOKENS_PER_PROGRAM,
            BLOCK_W=triton.next_power_of_2(mapper.source.kv_width),
        )
        products = mapper.content_products(kind, features)
        y_ptrs, y_strides = _output_tables(products, mapper.target.kv_width, device)
        _scatter_content[grid(len(dst_layers))](
            y_ptrs,
            y_strides,
            target_slots,
            *tgt_tables,
            _addresses(dst_layers),
            tokens,
            dst_layers[0].stride(0),
            tgt_tables[0].shape[1],
            WIDTH=mapper.target.kv_width,
            HEAD_DIM=mapper.target.head_dim,
            Y=_TRITON_DTYPES[matmul_dtype],
            ROUND=_TRITON_DTYPES[pool_dtype],
            POOL=_TRITON_DTYPES[dst_layers[0].dtype],
            ROTATE=rotate,
            INTERLEAVED=mapper.target.rope_style == "interleaved",
            BLOCK_T=TOKENS_PER_PROGRAM,
            BLOCK_W=triton.next_power_of_2(mapper.target.kv_width),
        )


def _addresses(layers: list[torch.Tensor]) -> torch.Tensor:
    """[layers] int64 on the layers' device: each layer buffer's address.

    An engine's pools keep their buffers for the server's life, so the table of a pool is
    built and copied to the device once (cached by the addresses themselves, which is all it
    holds; a pool reallocated elsewhere gets a new entry)."""
    return _device_table(tuple(layer.data_ptr() for layer in layers), layers[0].device)


@functools.lru_cache(maxsize=64)
def _device_table(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(device)


def _output_tables(products, width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per target layer, the address of its [t, width] block in its group's product and that
    product's row stride: ([Lt] int64, [Lt] int64), one host-to-device copy for both."""
    layers = sum(len(group) for group, _ in products)
    table = [[0] * layers, [0] * layers]  # addresses, row strides
    for group, y in products:
        for i, layer in enumerate(group):
            table[0][layer] = y.data_ptr() + i * width * y.element_size()
            table[1][layer] = y.stride(0)
    ptrs, strides = torch.tensor(table, dtype=torch.int64).to(device)
    return ptrs, strides
