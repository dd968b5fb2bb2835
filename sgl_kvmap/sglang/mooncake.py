"""Mooncake as KVMapStorage's inner store: pages and page records in a distributed store, so
engines on different hosts translate each other's pages.

SGLang's own backend (``mooncake_store.MooncakeStore``, built by its StorageBackendFactory)
reads its configuration from the extra config (``master_server_address``, ``metadata_server``,
``global_segment_size``, ``protocol``, ``local_hostname``; else the file
``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH`` names or the ``MOONCAKE_*`` variables), sets up this
process's client, mounts its share of the segment, checks it with a warm-up object and
registers the host pool for its zero-copy calls. Those calls assert buffer pointers
(``target_locations``); KVMapStorage reads and writes values (a flat page, a record), so it keeps
SGLang's client and object names and moves the bytes itself (``Keyspace``):

    page  key -> "{model}_{key}_{rank}_k", "{model}_{key}_{rank}_v"  (SGLang's names: the K and V
                 halves of the flat page, as its MooncakeStore writes a page_first page)
    other key -> "{model}_{key}_{rank}"                 (a record: key + ".kvmap"; soft-pinned)

where ``model`` is SGLang's prefix for the served model name (``/`` -> ``-``, after any
``extra_backend_tag``). A peer's objects are read through the same client under the peer's
prefix and ranks. Eviction, leases and replicas are the master's.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ..core.errors import KVMapError

LIBS_ENV = "KVMAP_MOONCAKE_LIBS"
LIBRARIES = (
    "libnl-3.so.200",
    "libnl-route-3.so.200",
    "libibverbs.so.1",
)  # scripts/setup_mooncake.sh
CONNECT_SECONDS = 2.0  # a master that does not accept a connection by then is down
COOLDOWN_SECONDS = 5.0  # after a store error, calls answer "absent" at once for this long
INSTALL = "bash scripts/setup_mooncake.sh, or pip install mooncake-transfer-engine"


def libraries_folder() -> Path:
    """Where scripts/setup_mooncake.sh unpacks the client's libraries (``KVMAP_MOONCAKE_LIBS``
    overrides it)."""
    default = Path(__file__).resolve().parents[2] / ".mooncake" / "lib"
    return Path(os.environ.get(LIBS_ENV) or default)


def load_client() -> type:
    """Mooncake's client class, its libraries loaded first from ``libraries_folder`` when they
    are there; KVMapError, in one line, when it cannot be imported."""
    folder = libraries_folder()
    try:
        for name in LIBRARIES:
            if (folder / name).exists():
                ctypes.CDLL(str(folder / name), mode=ctypes.RTLD_GLOBAL)
        from mooncake.store import MooncakeDistributedStore
    except (ImportError, OSError) as error:
        raise KVMapError(
            f'inner_backend "mooncake" needs Mooncake\'s client ({INSTALL}): {error}'
        ) from None
    return MooncakeDistributedStore


def check_master(extra: dict) -> None:
    """Refuse, in one line, a master that does not accept a connection (Mooncake's own set-up
    retries for minutes before it fails)."""
    address = extra.get("master_server_address")
    if not address:
        return  # configured through SGLang's file or environment: its own checks apply
    host, _, port = str(address).rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_SECONDS).close()
    except (OSError, ValueError) as error:
        raise KVMapError(
            f"the Mooncake master at {address} does not answer ({error}); start it first "
            "(`sgl-kvmap sglang-args --store mooncake` prints the command)"
        ) from None


def model_prefix(extra: dict, model_name: str) -> str:
    """SGLang's MooncakeStore key prefix for ``model_name`` (``config_prefix``)."""
    parts = [str(extra["extra_backend_tag"])] if extra.get("extra_backend_tag") is not None else []
    parts += ["-".join(model_name.split("/"))] if model_name else []
    return "_".join(parts)


@dataclasses.dataclass
class Keyspace:
    """One engine shard's objects in a Mooncake store with the value semantics KVMapStorage asks
    of an inner store (those of SGLang's file store): ``get`` fills a flat buffer and returns
    it, or None when absent; a stored value of another size raises OSError (a short read).

    client: this process's MooncakeDistributedStore; prefix: ``model_prefix``; rank: the TP rank
    whose objects these are; backend: SGLang's MooncakeStore that set the client up (this
    engine's own keyspace only; None for a peer's)."""

    client: object
    prefix: str
    rank: int
    backend: object = None
    on_error: Callable[[str], None] | None = None  # told of every error the store reports
    health: Health = dataclasses.field(default_factory=lambda: Health())  # shared by one client

    def names(self, key: str) -> list[str]:
        """The objects holding value ``key``: K and V halves for a page, one for the rest."""
        base = f"{self.prefix}_{key}_{self.rank}" if self.prefix else f"{key}_{self.rank}"
        return [base] if "." in key else [f"{base}_k", f"{base}_v"]

    def peer(self, model_name: str, rank: int, extra: dict) -> Keyspace:
        """The keyspace of a peer engine's rank, read through this client."""
        prefix = model_prefix(extra, model_name)
        return Keyspace(self.client, prefix, rank, None, self.on_error, self.health)

    def register_mem_pool_host(self, host) -> None:
        if self.backend is not None:
            self.backend.register_mem_pool_host(host)

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        if self.backend is not None:
            self.backend.register_mem_host_pool_v2(host_pool, host_pool_name)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info=None) -> int:
        """How many leading ``keys`` are stored whole."""
        if not self._reachable():
            return 0
        names = [self.names(key) for key in keys]
        found = self.client.batch_is_exist([n for group in names for n in group])
        self._check(found, "batch_is_exist")
        position = 0
        for count, group in enumerate(names):
            if any(result != 1 for result in found[position : position + len(group)]):
                return count
            position += len(group)
        return len(keys)

    def get(self, key: str, target_location=None, target_sizes=None):
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations=None, target_sizes=None) -> list:
        """Each value into its buffer (flat tensors); None for a value not stored whole."""
        if not self._reachable():
            return [None] * len(keys)
        names = [self.names(key) for key in keys]
        data = self.client.get_batch([n for group in names for n in group])
        out, position = [], 0
        for key, group, buffer in zip(keys, names, target_locations):
            parts = data[position : position + len(group)]
            position += len(group)
            out.append(_fill(buffer, parts, key) if all(parts) else None)
        return out

    def set(self, key: str, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values=None, target_locations=None, target_sizes=None):
        """Store each flat value (its halves for a page), replacing what the key held; True when
        every object was stored. Upserted: Mooncake's ``put`` keeps an existing object's old
        value, so a page stored again beside its new record (or a record beside its new page)
        would read back as damaged."""
        if not self._reachable():
            return False
        codes = []
        for key, value in zip(keys, values):
            group = self.names(key)
            config = _PAGE if len(group) == 2 else _RECORD
            codes += [
                self.client.upsert(n, p, config()) for n, p in zip(group, _split(value, len(group)))
            ]
        self._check(codes, "upsert")
        return all(code == 0 for code in codes)

    def _check(self, codes: list[int], call: str) -> None:
        errors = sorted({code for code in codes if code < 0})
        if errors:
            self.health.down_until = time.monotonic() + COOLDOWN_SECONDS
            self._error(f"Mooncake {call} failed with error code(s) {errors}")

    def _reachable(self) -> bool:
        """False while the store cools down after an error (each call then counts one): a
        master that is down costs one failing call, not one per page or request."""
        if time.monotonic() >= self.health.down_until:
            return True
        self._error(f"the Mooncake store failed less than {COOLDOWN_SECONDS:g} s ago")
        return False

    def _error(self, message: str) -> None:
        if self.on_error is not None:
            self.on_error(message)

    def clear(self) -> None:
        self.client.remove_by_regex(f"^{re.escape(self.prefix)}_", True)

    def close(self) -> None:
        """Close this engine's client (a peer's keyspace shares it and closes nothing)."""
        if self.backend is not None:
            self.backend.store.close()


def _PAGE():
    from mooncake.store import ReplicateConfig

    return ReplicateConfig()


def _RECORD():
    """Records are soft-pinned: the master evicts them after unpinned pages, so a reader finds a
    record whose page was evicted (counted ``peer_page_lost``) rather than nothing."""
    from mooncake.store import ReplicateConfig, SoftPinAction

    config = ReplicateConfig()
    config.soft_pin_action = SoftPinAction.ENABLE
    return config


@dataclasses.dataclass
class Health:
    """Until when (``time.monotonic``) a client's store is treated as unreachable."""

    down_until: float = 0.0


def _split(value: torch.Tensor, count: int) -> list[np.ndarray]:
    """A flat value's bytes in ``count`` equal parts."""
    data = value.contiguous().view(torch.uint8).numpy()
    return np.split(data, count)


def _fill(buffer: torch.Tensor, parts: list[bytes], key: str) -> torch.Tensor:
    """buffer: a flat tensor; the parts' bytes, end to end, into it."""
    out = buffer.view(torch.uint8).numpy()
    if sum(len(part) for part in parts) != out.size:
        raise OSError(f"object {key} holds {sum(map(len, parts))} bytes, expected {out.size}")
    position = 0
    for part in parts:
        out[position : position + len(part)] = np.frombuffer(part, dtype=np.uint8)
        position += len(part)
    return buffer
