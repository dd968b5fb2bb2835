"""sgl-kvmap's keys in SGLang's ``--hicache-storage-backend-extra-config`` (pure; no sglang).

    {"backend_name": "kvmap", "module_path": "sgl_kvmap.sglang.storage",
     "class_name": "KVMapStorage", "interface_v1": 1, "hicache_storage_pass_prefix_keys": true,
     "inner_backend": "file", "translate": true,
     "peers": [{"model_name": "Qwen/Qwen2.5-Coder-0.5B-Instruct", "pack": "/packs/0.5B_to_1.5B"}]}

Keys SGLang itself reads (file_storage_path, prefetch_threshold, ...) pass through untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from ..errors import KVMapError

BACKEND = {
    "backend_name": "kvmap",
    "module_path": "sgl_kvmap.sglang.storage",
    "class_name": "KVMapStorage",
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class PeerSettings:
    """A peer engine. model_name: its served model name (its identity in the store);
    model_path: where its config and tokenizer are (default: model_name); pack: the mapper
    pack folder, peer -> this model; tp_size, layout, dtype: how the peer stores its pages."""

    model_name: str
    pack: str
    model_path: str = ""
    tp_size: int = 1
    layout: str = "page_first"
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if not self.model_path:
            object.__setattr__(self, "model_path", self.model_name)
        if self.dtype not in DTYPES or self.tp_size < 1:
            raise KVMapError(
                f"peer {self.model_name}: dtype {self.dtype!r} / tp_size {self.tp_size}"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class StorageSettings:
    """inner_backend: the built-in store for this engine's own pages (and the peers').
    translate: serve translated pages at all (off: a transparent wrapper). translate_sinks:
    also translate a prefix's first page (attention sinks; lower fidelity). model_path: this
    engine's model, if its served name is not a path or Hub id. remember_translated: how many
    translated page keys are remembered to withhold them from storage."""

    inner_backend: str = "file"
    translate: bool = False
    translate_sinks: bool = False
    interface_v1: bool = False
    model_path: str = ""
    remember_translated: int = 1 << 20
    peers: tuple[PeerSettings, ...] = ()

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> StorageSettings:
        """Read sgl-kvmap's keys from SGLang's extra config (other keys are SGLang's)."""
        ours = {f.name for f in fields(cls)}
        values = {key: extra[key] for key in ours if key in extra}
        try:
            values["peers"] = tuple(PeerSettings(**peer) for peer in values.get("peers", ()))
        except TypeError as error:
            raise KVMapError(f"bad peer entry in the sgl-kvmap extra config: {error}") from None
        values["interface_v1"] = bool(values.get("interface_v1", False))
        return cls(**values)

    def to_extra_config(self, **sglang_keys: Any) -> dict[str, Any]:
        """The extra-config JSON object for these settings (plus SGLang's own keys)."""
        out: dict[str, Any] = dict(BACKEND)
        out.update(sglang_keys)
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "peers":
                value = [_peer_dict(p) for p in value]
            out[f.name] = value
        out["interface_v1"] = 1 if self.interface_v1 else 0
        return out


def _peer_dict(peer: PeerSettings) -> dict[str, Any]:
    return {f.name: getattr(peer, f.name) for f in fields(peer)}
