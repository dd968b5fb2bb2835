"""SGLang 0.5.23's two CPU HiCache fixes, for live servers on SGLang's CPU engine only.

Python imports this module at start-up in every process whose ``PYTHONPATH`` holds
``sgl_kvmap/sglang/cpu_engine`` (the lines ``sgl-kvmap sglang-args --device cpu`` prints;
SGLang's scheduler and detokenizer processes inherit it). It changes no file: a
``sys.meta_path`` finder wraps the loader of two SGLang modules and, right after each has
executed, and only when ``sglang.__version__`` is 0.5.23 and the engine is SGLang's CPU engine
(``SGLANG_USE_CPU_ENGINE=1``), makes one change to it:

1. ``sglang.srt.mem_cache.pool_host.base``: ``HostKVCache`` keeps ``pin_memory=True`` on a CPU
   engine, and pinning needs a CUDA driver ("Found no NVIDIA driver" when the host pool
   registers its memory). The host pool is built with ``pin_memory and
   is_pin_memory_available()`` instead.
2. ``sglang.srt.mem_cache.pool_host.mha``: the host <-> device transfer functions are imported
   from ``sgl_kernel.kvcacheio`` only under CUDA/HIP, so every HiCache copy of a CPU engine
   raises NameError. The torch versions of the stand-in ``sgl_kernel.kvcacheio`` (beside this
   file) are bound into the module.

And one opt-in substitution for a small test machine: with ``KVMAP_HICACHE_RESERVE_BYTES``
set, ``pool_host.base.HICACHE_HOST_MEMORY_RESERVE_BYTES`` (the host memory a HiCache server
leaves free, 10 GiB) takes its value, so a server sizes its host pool on a machine with less
than 10 GiB free.

Anything else (another SGLang version, a GPU engine) is left exactly as SGLang ships it.
"""

from __future__ import annotations

import importlib.abc
import os
import sys

SGLANG_VERSION = "0.5.23"
RESERVE_VARIABLE = "KVMAP_HICACHE_RESERVE_BYTES"
KVCACHEIO_NAMES = (
    "transfer_kv_all_layer",
    "transfer_kv_all_layer_direct_lf_pf",
    "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_lf_ph",
    "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_direct",
    "transfer_kv_per_layer",
    "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_per_layer_mla",
    "transfer_kv_per_layer_mla_pf_lf",
    "transfer_kv_per_layer_pf_lf",
    "transfer_kv_per_layer_ph_lf",
)


def applies() -> bool:
    """SGLang 0.5.23 running its CPU engine (read when the first patched module executes)."""
    from sglang.version import __version__

    return __version__ == SGLANG_VERSION and os.environ.get("SGLANG_USE_CPU_ENGINE") == "1"


def unpinned_on_cpu(base) -> None:
    """Fix 1: the host pool pins its memory only where pinning is available."""
    from sglang.srt.utils.common import is_pin_memory_available

    original = base.HostKVCache.__init__

    def __init__(self, *args, pin_memory: bool, **kwargs):
        pin_memory = pin_memory and is_pin_memory_available()
        original(self, *args, pin_memory=pin_memory, **kwargs)

    base.HostKVCache.__init__ = __init__


def smaller_reserve(base) -> None:
    """The opt-in substitution: the host memory reserve from the environment, when set."""
    reserve = os.environ.get(RESERVE_VARIABLE)
    if reserve:
        base.HICACHE_HOST_MEMORY_RESERVE_BYTES = int(reserve)


def cpu_transfers(mha) -> None:
    """Fix 2: the module's transfer functions are the stand-in's torch versions."""
    if mha._is_cuda or mha._is_hip or mha._is_xpu:
        return
    from sgl_kernel import kvcacheio

    for name in KVCACHEIO_NAMES:
        setattr(mha, name, getattr(kvcacheio, name))


FIXES = {
    "sglang.srt.mem_cache.pool_host.base": (unpinned_on_cpu, smaller_reserve),
    "sglang.srt.mem_cache.pool_host.mha": (cpu_transfers,),
}


class AfterExec(importlib.abc.Loader):
    """Runs the wrapped loader, then each of ``fixes`` on the module when ``applies()``."""

    def __init__(self, loader, fixes):
        self.loader, self.fixes = loader, fixes

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        if applies():
            for fix in self.fixes:
                fix(module)

    def __getattr__(self, name):  # get_code, get_source, is_package, ... of the real loader
        return getattr(self.loader, name)


class FixFinder(importlib.abc.MetaPathFinder):
    """Finds the modules of ``FIXES`` through the other finders and wraps their loaders."""

    def find_spec(self, name, path, target=None):
        fixes = FIXES.get(name)
        if fixes is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = AfterExec(spec.loader, fixes)
                return spec
        return None


if not any(isinstance(finder, FixFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, FixFinder())
