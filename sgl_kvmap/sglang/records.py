"""Page records: what the writer of a stored page knows about it, stored beside it (pure).

HiCache's page keys are a hash chain over token ids: they say nothing about where a page sits
in its sequence, how its bytes are laid out or which model computed it, and a reader sees only
keys. The writer knows all three: SGLang's write-through passes the page keys of the prefix
before every batch it stores (``hicache_storage_pass_prefix_keys``), so page i of a batch sits
at index ``len(prefix_keys) + i``. KVMapStorage writes one record per page it stores, in the
same store as the page, under the page's store key plus ``RECORD_SUFFIX`` (the store key is the
page's key, or ``derived_key`` of it for a page computed over translated KV):

    {"format": "sgl-kvmap-page", "version": 2, "index": 3, "parent": "<key of page 2>",
     "page": {"layout", "page_size", "layers", "heads", "head_dim", "dtype"},
     "tp_rank": 0, "tp_size": 1, "model": "<the writer's model identity>",
     "crc32": <of the page's bytes>, "checksum": <crc32 of the record's other fields>}

as a fixed-size block of JSON (a page store reads fixed-size values). A reader translates a
peer's page only with its record: positions from ``index`` (chained by ``parent``), the bytes
decoded by ``page`` and checked against ``crc32``, the writer checked by ``model``; ``checksum``
covers the record itself, so no field (the dtype among them) can change unnoticed.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass

import torch

from ..core.errors import KVMapError
from .pages import PageFormat

RECORD_BYTES = 1024
RECORD_FORMAT = "sgl-kvmap-page"
RECORD_VERSION = 2
RECORD_SUFFIX = ".kvmap"  # a page's record lives in the page's store under key + this
DERIVED_SUFFIX = ".derived"  # a page computed over translated KV, stored apart: key + this


@dataclass(frozen=True)
class PageRecord:
    """index: the page's place in its sequence (its first token sits at index * page_size);
    parent: the key of the page before it ("" for the first page); page: how its bytes are
    laid out; tp_rank / tp_size: the writer's shard; model: the writer's model identity
    (``identity.model_identity``); crc32: of the stored bytes."""

    index: int
    parent: str
    page: PageFormat
    tp_rank: int
    tp_size: int
    model: str
    crc32: int

    def __post_init__(self) -> None:
        numbers = (self.index, self.tp_rank, self.tp_size, self.crc32)
        texts = (self.parent, self.model)
        if any(type(n) is not int for n in numbers) or any(type(t) is not str for t in texts):
            raise KVMapError(f"malformed page record {self!r}")
        if self.index < 0 or not 0 <= self.tp_rank < self.tp_size or self.crc32 < 0:
            raise KVMapError(f"page record out of range: {self!r}")
        if (self.index == 0) != (self.parent == ""):
            raise KVMapError("only the first page of a sequence has no parent")

    @property
    def first_token(self) -> int:
        return self.index * self.page.page_size

    def to_tensor(self) -> torch.Tensor:
        """The record as [RECORD_BYTES] uint8: JSON padded with spaces."""
        fields = self._fields()
        text = json.dumps({**fields, "checksum": _checksum(fields)}, sort_keys=True).encode()
        if len(text) > RECORD_BYTES:
            raise KVMapError(f"a page record of {len(text)} bytes exceeds {RECORD_BYTES}")
        return torch.frombuffer(bytearray(text.ljust(RECORD_BYTES)), dtype=torch.uint8)

    @classmethod
    def from_tensor(cls, data: torch.Tensor) -> PageRecord:
        """Parse a stored record; KVMapError for anything that is not a whole, valid record."""
        try:
            fields = json.loads(bytes(data.numpy()).decode())
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
            raise KVMapError(f"unreadable page record ({error})") from None
        if not isinstance(fields, dict):
            raise KVMapError("a page record must be a JSON object")
        if (fields.get("format"), fields.get("version")) != (RECORD_FORMAT, RECORD_VERSION):
            raise KVMapError(f"not a version-{RECORD_VERSION} sgl-kvmap page record")
        checksum = fields.pop("checksum", None)
        if type(checksum) is not int or checksum != _checksum(fields):
            raise KVMapError("a page record whose checksum does not match its fields")
        fields = {k: v for k, v in fields.items() if k not in ("format", "version")}
        try:
            return cls(**{**fields, "page": PageFormat.from_dict(fields.get("page"))})
        except TypeError as error:
            raise KVMapError(f"malformed page record ({error})") from None

    def _fields(self) -> dict:
        return {
            "format": RECORD_FORMAT,
            "version": RECORD_VERSION,
            "index": self.index,
            "parent": self.parent,
            "page": self.page.to_dict(),
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "model": self.model,
            "crc32": self.crc32,
        }


def record_key(key: str) -> str:
    """The store key of page ``key``'s record."""
    return key + RECORD_SUFFIX


def derived_key(key: str) -> str:
    """The store key of page ``key`` when its writer computed it over KV it received
    translated (``StorageSettings.derived``): never read as that model's own page; its
    record lives under ``record_key(derived_key(key))``."""
    return key + DERIVED_SUFFIX


def empty_record() -> torch.Tensor:
    """A buffer [RECORD_BYTES] uint8 to read one record into."""
    return torch.empty(RECORD_BYTES, dtype=torch.uint8)


def stored_record(store, name: str) -> PageRecord | None:
    """The record a HiCache ``store`` holds for the page stored under ``name`` (None: none).
    Raises OSError for a record file of another size and KVMapError for a damaged record."""
    data = store.get(record_key(name), empty_record())
    return None if data is None else PageRecord.from_tensor(data)


def page_crc32(flat: torch.Tensor) -> int:
    """CRC-32 of a flat page's bytes (any dtype)."""
    return zlib.crc32(flat.contiguous().view(torch.uint8).numpy())


def _checksum(fields: dict) -> int:
    return zlib.crc32(json.dumps(fields, sort_keys=True).encode())
