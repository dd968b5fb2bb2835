"""Launch flags for SGLang engines that share cached prefixes through sgl-kvmap (no sglang import).

Every engine gets HiCache with the KVMapStorage backend over one shared store; its peers are
the other engines for which a pack translates INTO it. Packs are matched to engines by the
fingerprints recorded in them (config + tokenizer), never by name.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from ..errors import KVMapError
from ..pack import read_config
from ..spec import spec_from_pretrained
from .settings import PeerSettings, StorageSettings


@dataclass(frozen=True)
class EngineSpec:
    """One engine: where its model is, the name it serves under (its identity in the store)."""

    model_path: str
    served_name: str = ""
    port: int = 30000
    tp_size: int = 1

    @property
    def name(self) -> str:
        return self.served_name or self.model_path


def engine_commands(
    engines: list[EngineSpec],
    packs: list[str | Path],
    store: str = "file",
    store_path: str = "/tmp/sgl-kvmap-hicache",
    page_size: int = 64,
) -> list[list[str]]:
    """argv of ``python -m sglang.launch_server`` for every engine (same order).

    store: the built-in HiCache store the engines share ("file" on one node; "mooncake" or
    "hf3fs" across nodes, configured as SGLang documents).
    """
    by_fingerprint = {spec_from_pretrained(e.model_path).fingerprint: e for e in engines}
    peers: dict[str, list[PeerSettings]] = {e.name: [] for e in engines}
    for pack in packs:
        config = read_config(Path(pack))
        source = by_fingerprint.get(config["source_fingerprint"])
        target = by_fingerprint.get(config["target_fingerprint"])
        if source is None or target is None:
            raise KVMapError(
                f"pack {pack} maps {config['source']['model_id']} -> "
                f"{config['target']['model_id']}, which are not both among the engines"
            )
        peers[target.name].append(
            PeerSettings(source.name, str(Path(pack).resolve()), source.model_path, source.tp_size)
        )
    return [_command(e, peers[e.name], store, store_path, page_size) for e in engines]


def sglang_extra_config(settings: StorageSettings, store_path: str) -> dict:
    """One engine's ``--hicache-storage-backend-extra-config`` object: its sgl-kvmap settings
    plus the SGLang keys they rely on (the prefix's page keys with every write, which is how a
    page's position reaches its record; the file store's folder)."""
    return settings.to_extra_config(
        hicache_storage_pass_prefix_keys=True, file_storage_path=store_path
    )


def _command(engine, peers, store, store_path, page_size) -> list[str]:
    settings = StorageSettings(
        inner_backend=store,
        translate=bool(peers),
        interface_v1=True,
        model_path=engine.model_path,
        peers=tuple(peers),
    )
    extra = sglang_extra_config(settings, store_path)
    return [
        "python", "-m", "sglang.launch_server",
        "--model-path", engine.model_path,
        "--served-model-name", engine.name,
        "--port", str(engine.port),
        "--tp-size", str(engine.tp_size),
        "--page-size", str(page_size),
        "--enable-hierarchical-cache",
        "--hicache-mem-layout", "page_first",
        "--hicache-write-policy", "write_through",
        "--hicache-storage-backend", "dynamic",
        "--hicache-storage-backend-extra-config", json.dumps(extra, sort_keys=True),
    ]  # fmt: skip


def shell_line(argv: list[str]) -> str:
    return " ".join(shlex.quote(arg) for arg in argv)
