"""The CPU test environment of live servers (scripts/sglang_cpu): the stand-in ``sgl_kernel`` and
the import hook in its ``sitecustomize``.

The stand-in's functions are checked against the layouts their CUDA kernels address (item
offsets of sgl-kernel's ``csrc/kvcacheio/transfer.cu``, the Triton slot copy, the token-row
writer); the hook is checked in fresh interpreters started as a live server's processes are
(``PYTHONPATH`` with scripts/sglang_cpu), where SGLang 0.5.23's own MHA host pool, in every
layout and IO backend it offers, writes device KV into its host buffer and loads it back
through the stand-in's transfers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from sgl_kvmap.sglang.launch import CPU_ENGINE_FOLDER

FOLDER = CPU_ENGINE_FOLDER
LAYERS, HEADS, DIM, SLOTS, PAGE = 3, 2, 8, 64, 4


@pytest.fixture(scope="module")
def kernel():
    """The stand-in package, loaded under a private name (this process keeps no
    ``sgl_kernel``)."""
    spec = importlib.util.spec_from_file_location(
        "standin_sgl_kernel",
        FOLDER / "sgl_kernel" / "__init__.py",
        submodule_search_locations=[str(FOLDER / "sgl_kernel")],
    )
    package = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = package
    spec.loader.exec_module(package)
    from standin_sgl_kernel import kvcacheio  # noqa: F401 (a submodule of the loaded package)

    yield package
    for name in [n for n in sys.modules if n.startswith("standin_sgl_kernel")]:
        del sys.modules[name]


def device_layers(seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """K and V per layer as a device pool holds them: [slots, heads, head_dim] float16."""
    g = torch.Generator().manual_seed(seed)
    shape = (SLOTS, HEADS, DIM)
    return (
        [torch.randn(shape, generator=g).half() for _ in range(LAYERS)],
        [torch.randn(shape, generator=g).half() for _ in range(LAYERS)],
    )


def pointers(tensors) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


ITEM = HEADS * DIM * 2  # bytes of one token's K of one layer
DEVICE_SLOTS = torch.tensor([8, 9, 10, 11, 30, 31, 32, 33])
HOST_SLOTS = torch.tensor([20, 21, 22, 23, 4, 5, 6, 7])


def test_page_first_write_back_and_load_back(kernel):
    """Host ``[slots, layers, heads, head_dim]`` per K and V: item (slot p, layer l) at
    ``p * layout_dim + l * item``. A negative index skips its item, as the kernel does."""
    io = kernel.kvcacheio
    k, v = device_layers()
    host = torch.zeros(2, SLOTS, LAYERS, HEADS, DIM, dtype=torch.float16)
    src = torch.cat([DEVICE_SLOTS, torch.tensor([1])])
    dst = torch.cat([HOST_SLOTS, torch.tensor([-1])])
    io.transfer_kv_all_layer_lf_pf(
        pointers(k), host[0], pointers(v), host[1], src, dst, ITEM, LAYERS * ITEM, LAYERS
    )
    for layer in range(LAYERS):
        assert torch.equal(host[0][HOST_SLOTS, layer], k[layer][DEVICE_SLOTS])
        assert torch.equal(host[1][HOST_SLOTS, layer], v[layer][DEVICE_SLOTS])
    assert host.count_nonzero() == 2 * LAYERS * len(HOST_SLOTS) * HEADS * DIM
    for layer in range(LAYERS):
        back_k, back_v = torch.zeros_like(k[layer]), torch.zeros_like(v[layer])
        io.transfer_kv_per_layer_pf_lf(
            host[0], back_k, host[1], back_v, HOST_SLOTS, DEVICE_SLOTS + 1, layer, ITEM,
            LAYERS * ITEM,
        )  # fmt: skip
        assert torch.equal(back_k[DEVICE_SLOTS + 1], k[layer][DEVICE_SLOTS])
        assert torch.equal(back_v[DEVICE_SLOTS + 1], v[layer][DEVICE_SLOTS])
        assert back_k.count_nonzero() == back_k[DEVICE_SLOTS + 1].count_nonzero()


def test_layer_first_transfers(kernel):
    """Host ``[layers, slots, heads, head_dim]`` per K and V, by address tables, by tensors, and
    the direct io backend's page copies."""
    io = kernel.kvcacheio
    k, v = device_layers()
    host = torch.zeros(2, LAYERS, SLOTS, HEADS, DIM, dtype=torch.float16)
    io.transfer_kv_all_layer(
        pointers(k), pointers(host[0]), pointers(v), pointers(host[1]), DEVICE_SLOTS, HOST_SLOTS,
        ITEM, LAYERS,
    )  # fmt: skip
    for layer in range(LAYERS):
        assert torch.equal(host[0, layer][HOST_SLOTS], k[layer][DEVICE_SLOTS])
        assert torch.equal(host[1, layer][HOST_SLOTS], v[layer][DEVICE_SLOTS])
        back_k, back_v = torch.zeros_like(k[layer]), torch.zeros_like(v[layer])
        io.transfer_kv_per_layer(
            host[0, layer], back_k, host[1, layer], back_v, HOST_SLOTS, DEVICE_SLOTS, ITEM
        )
        assert torch.equal(back_k[DEVICE_SLOTS], k[layer][DEVICE_SLOTS])
        written = torch.zeros_like(back_v).index_copy(0, DEVICE_SLOTS, v[layer][DEVICE_SLOTS])
        assert torch.equal(back_v, written)
    direct = torch.zeros_like(host)
    io.transfer_kv_direct([*k, *v], [*direct[0], *direct[1]], DEVICE_SLOTS, HOST_SLOTS, PAGE)
    assert torch.equal(direct, host)
    with pytest.raises(ValueError, match="divisible by page size"):
        io.transfer_kv_direct(k, list(direct[0]), DEVICE_SLOTS[:3], HOST_SLOTS[:3], PAGE)


def test_page_first_direct_copies_whole_pages(kernel):
    """Host ``[pages, layers, page_size, heads, head_dim]`` per K and V; pages are addressed by
    the first index of each page-aligned run."""
    io = kernel.kvcacheio
    k, v = device_layers()
    host = torch.zeros(2, SLOTS // PAGE, LAYERS, PAGE, HEADS, DIM, dtype=torch.float16)
    io.transfer_kv_all_layer_direct_lf_pf([*k, *v], [host[0], host[1]], DEVICE_SLOTS,
                                          HOST_SLOTS, PAGE)  # fmt: skip
    for layer in range(LAYERS):
        for side, layers in enumerate((k, v)):
            got = host[side][HOST_SLOTS // PAGE, layer, HOST_SLOTS % PAGE]
            assert torch.equal(got, layers[layer][DEVICE_SLOTS])
        back = [torch.zeros_like(k[layer]), torch.zeros_like(v[layer])]
        io.transfer_kv_per_layer_direct_pf_lf([host[0], host[1]], back, HOST_SLOTS,
                                              DEVICE_SLOTS, layer, PAGE)  # fmt: skip
        assert torch.equal(back[0][DEVICE_SLOTS], k[layer][DEVICE_SLOTS])
        assert torch.equal(back[1][DEVICE_SLOTS], v[layer][DEVICE_SLOTS])


def test_page_head_transfers(kernel):
    """Host ``[pages, heads, page_size, layers, head_dim]`` per K and V, head by head."""
    io = kernel.kvcacheio
    k, v = device_layers()
    host = torch.zeros(2, SLOTS // PAGE, HEADS, PAGE, LAYERS, DIM, dtype=torch.float16)
    io.transfer_kv_all_layer_lf_ph(
        pointers(k), host[0], pointers(v), host[1], DEVICE_SLOTS, HOST_SLOTS, ITEM,
        LAYERS * ITEM, LAYERS, PAGE, HEADS,
    )  # fmt: skip
    pages, offsets = HOST_SLOTS // PAGE, HOST_SLOTS % PAGE
    for layer in range(LAYERS):
        for head in range(HEADS):
            got = host[0][pages, head, offsets, layer]
            assert torch.equal(got, k[layer][DEVICE_SLOTS, head])
        back_k, back_v = torch.zeros_like(k[layer]), torch.zeros_like(v[layer])
        io.transfer_kv_per_layer_ph_lf(
            host[0], back_k, host[1], back_v, HOST_SLOTS, DEVICE_SLOTS, layer, ITEM,
            LAYERS * ITEM, PAGE, HEADS,
        )  # fmt: skip
        assert torch.equal(back_k[DEVICE_SLOTS], k[layer][DEVICE_SLOTS])
        assert torch.equal(back_v[DEVICE_SLOTS], v[layer][DEVICE_SLOTS])


def test_mla_transfers_move_one_buffer(kernel):
    """MLA: one latent buffer per layer ([slots, 1, width]), page first or layer first."""
    io = kernel.kvcacheio
    latents, _ = device_layers(seed=1)
    item = HEADS * DIM * 2  # the latent width in bytes
    host = torch.zeros(SLOTS, LAYERS, HEADS, DIM, dtype=torch.float16)
    io.transfer_kv_all_layer_mla_lf_pf(pointers(latents), host, DEVICE_SLOTS, HOST_SLOTS, item,
                                       LAYERS * item, LAYERS)  # fmt: skip
    flat = torch.zeros(LAYERS, SLOTS, HEADS, DIM, dtype=torch.float16)
    io.transfer_kv_all_layer_mla(pointers(latents), pointers(flat), DEVICE_SLOTS, HOST_SLOTS,
                                 item, LAYERS)  # fmt: skip
    for layer in range(LAYERS):
        assert torch.equal(host[HOST_SLOTS, layer], latents[layer][DEVICE_SLOTS])
        assert torch.equal(flat[layer][HOST_SLOTS], latents[layer][DEVICE_SLOTS])
        back, again = torch.zeros_like(latents[layer]), torch.zeros_like(latents[layer])
        io.transfer_kv_per_layer_mla_pf_lf(host, back, HOST_SLOTS, DEVICE_SLOTS, layer, item,
                                           LAYERS * item)  # fmt: skip
        io.transfer_kv_per_layer_mla(flat[layer], again, HOST_SLOTS, DEVICE_SLOTS, item)
        assert torch.equal(back, again)
        assert torch.equal(back[DEVICE_SLOTS], latents[layer][DEVICE_SLOTS])


def test_an_index_past_a_buffer_is_refused(kernel):
    k, v = device_layers()
    host = torch.zeros(2, 4, LAYERS, HEADS, DIM, dtype=torch.float16)
    with pytest.raises(IndexError, match="reaches byte"):
        kernel.kvcacheio.transfer_kv_all_layer_lf_pf(
            pointers(k), host[0], pointers(v), host[1], DEVICE_SLOTS, HOST_SLOTS, ITEM,
            LAYERS * ITEM, LAYERS,
        )  # fmt: skip


def test_slot_copy_and_token_rows(kernel):
    """``copy_all_layer_kv_cache_cpu``: in every buffer, rows ``src`` onto rows ``tgt`` (all
    read before any is written); ``assign_req_to_token_pool_cpu``: each request's new slots
    into its row, packed back to back in ``out_cache_loc``."""
    k, v = device_layers()
    before = [t.clone() for t in (*k, *v)]
    strides = torch.tensor([t.stride(0) * t.element_size() for t in (*k, *v)])
    tgt, src = torch.tensor([5, 6, 7]), torch.tensor([6, 7, 40])
    kernel.copy_all_layer_kv_cache_cpu(pointers([*k, *v]), strides, tgt, src)
    for now, old in zip((*k, *v), before):
        assert torch.equal(now[tgt], old[src])
        keep = torch.ones(SLOTS, dtype=torch.bool).index_fill(0, tgt, False)
        assert torch.equal(now[keep], old[keep])
    rows = torch.full((4, 16), -1, dtype=torch.int32)
    kernel.assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]), rows, torch.tensor([3, 0]), torch.tensor([6, 2]),
        torch.arange(10, 15), 16,
    )  # fmt: skip
    assert rows[2, 3:6].tolist() == [10, 11, 12] and rows[0, :2].tolist() == [13, 14]
    assert (rows == -1).sum() == 64 - 5


def test_the_stand_in_registers_no_torch_op(kernel):
    """No ``sgl_kernel::`` op exists, so SGLang's ``cpu_has_amx_support()`` stays False and every
    layer takes ``forward_native``; the speculative names SGLang imports raise when called."""
    assert not [op for op in torch._C._dispatch_get_all_op_names() if op.startswith("sgl_kernel")]
    with pytest.raises(NotImplementedError, match="speculative decoding"):
        kernel.verify_tree_greedy_cpu()


HOST_POOL_SCRIPT = """
import json, os, sys, torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host import base, mha
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

import ast, inspect
imported = sorted({alias.name for node in ast.walk(ast.parse(inspect.getsource(mha)))
                   if isinstance(node, ast.ImportFrom) and node.module == "sgl_kernel.kvcacheio"
                   for alias in node.names})  # what mha.py imports from sgl_kernel.kvcacheio
bound = sorted(n for n in imported
               if getattr(getattr(mha, n, None), "__module__", "") == "sgl_kernel.kvcacheio")
report = {"imported": len(imported), "bound": len(bound) if bound != imported else "all",
          "reserve": base.HICACHE_HOST_MEMORY_RESERVE_BYTES, "pools": {}}
if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    page, layers = 4, 3
    for layout, io in (("page_first", "kernel"), ("layer_first", "kernel"),
                       ("layer_first", "direct"), ("page_first_direct", "direct"),
                       ("page_head", "kernel")):
        device = MHATokenToKVPool(size=64, page_size=page, dtype=torch.float16, head_num=2,
            head_dim=8, layer_num=layers, device="cpu", enable_memory_saver=False,
            start_layer=0, end_layer=layers)
        with host_memory_budget_scope(1 << 30):
            host = mha.MHATokenToKVPoolHost(device._mha_buffer_info(), 2.0, 0, page, layout,
                device="cpu", device_capacity_tokens=64, start_layer=0, end_layer=layers)
        g = torch.Generator().manual_seed(0)
        for buffer in (*device.k_buffer, *device.v_buffer):
            buffer.copy_(torch.randn(buffer.shape, generator=g))
        src, dst = torch.arange(8, 16), torch.arange(20, 28)
        host.backup_from_device_all_layer(device, dst, src, io)
        # the host's own page accessor (what storage reads), in the layout's dimension order
        want = torch.stack([torch.stack([b[8:12] for b in side], 1)
                            for side in (device.k_buffer, device.v_buffer)])  # [2, page, L, H, D]
        order = {"page_first": (0, 1, 2, 3, 4), "page_head": (0, 3, 1, 2, 4)}.get(
            layout, (0, 2, 1, 3, 4))
        stored = torch.equal(host.get_data_page(20), want.permute(order).flatten())
        loaded = []
        for layer in range(layers):
            k, v = device.k_buffer[layer][src].clone(), device.v_buffer[layer][src].clone()
            host.load_to_device_per_layer(device, dst, torch.arange(40, 48), layer, io)
            loaded.append(torch.equal(device.k_buffer[layer][40:48], k)
                          and torch.equal(device.v_buffer[layer][40:48], v))
        report["pools"][f"{layout}/{io}"] = [host.pin_memory, stored, all(loaded)]
print(json.dumps(report))
"""


def run_in_server_environment(**env) -> dict:
    """HOST_POOL_SCRIPT in a fresh interpreter with scripts/sglang_cpu on PYTHONPATH."""
    pytest.importorskip("sglang", reason="the import hook patches SGLang 0.5.23's modules")
    environment = {**os.environ, "PYTHONPATH": str(FOLDER), **env}
    for name in ("SGLANG_USE_CPU_ENGINE", "KVMAP_HICACHE_RESERVE_BYTES"):
        if name not in env:
            environment.pop(name, None)
    ran = subprocess.run(
        [sys.executable, "-c", HOST_POOL_SCRIPT], env=environment, capture_output=True, text=True
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    return json.loads(ran.stdout.strip().splitlines()[-1])


def test_sglang_host_pools_move_kv_through_the_stand_in():
    """Under SGLang's CPU engine the hook makes SGLang's own MHA host pool work in each of its
    layouts and IO backends: unpinned, every transfer function bound to the stand-in's, device
    KV written back into the host buffer where SGLang's page accessor finds it and loaded back
    per layer; the reserve variable sets the host-memory reserve."""
    report = run_in_server_environment(
        SGLANG_USE_CPU_ENGINE="1", KVMAP_HICACHE_RESERVE_BYTES=str(2**28)
    )
    assert (report["imported"], report["bound"], report["reserve"]) == (12, "all", 2**28)
    assert report["pools"] == {
        "page_first/kernel": [False, True, True],
        "layer_first/kernel": [False, True, True],
        "layer_first/direct": [False, True, True],
        "page_first_direct/direct": [False, True, True],
        "page_head/kernel": [False, True, True],
    }


def test_the_hook_leaves_sglang_alone_off_its_cpu_engine():
    """Without ``SGLANG_USE_CPU_ENGINE=1`` nothing is bound and the reserve is SGLang's."""
    report = run_in_server_environment(KVMAP_HICACHE_RESERVE_BYTES=str(2**28))
    assert report == {"imported": 12, "bound": 0, "reserve": 10 * 2**30, "pools": {}}
