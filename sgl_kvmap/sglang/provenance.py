"""Which pages an engine holds as translations, so none is ever stored as its own (pure).

Translated KV must never be served as exact KV: not to this engine after a restart, not to a
peer, and never as the source of a further translation. So KVMapStorage stores a page as this
model's own only if neither the page nor any page before it in its sequence is a translation
this engine holds. Three facts make that decidable from the write alone:

- SGLang writes to storage only pages its device computed or holds (``write_backup_storage``
  after a device->host write-through), each write with the keys of every page before it
  (``prefix_keys``, which sgl-kvmap's launch flags turn on).
- A page SGLang received translated and kept holds exactly the bytes KVMapStorage delivered;
  a translated page SGLang threw away (its prefetch deadline, a cross-rank cut, a page already
  in its tree) is computed by the engine itself if the request needs it, so if it is ever
  written it holds other bytes.
- The ledger below keeps, for every delivered page, its key and the CRC-32 of the bytes
  delivered. A written page whose key is in the ledger and whose bytes match is a translation
  being written back (withheld, with everything after it); one whose bytes differ was
  recomputed (the translation was discarded: it leaves the ledger, counted). A write whose
  prefix holds a ledger key descends from a translation (withheld).

A withheld page the ledger does not hold as a translation is one this engine computed over
translated KV (derived); the verdict names them, so an engine may keep them apart for its
peers to translate (``StorageSettings.derived``), never as its own.

Only what SGLang kept therefore counts: a translation it cut never withholds the engine's own
recomputed pages. The ledger is bounded (``capacity`` pages, least recently seen dropped first;
every write and every prefetch that names a key refreshes it): KVMapStorage sizes it to a
multiple of the engine's host pool, and pages enter an engine only through that pool, so a
dropped entry is a page the engine evicted unless it has stayed cached, unseen by storage,
while that many newer translations came and went.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import NamedTuple


class Verdict(NamedTuple):
    """What a write may store. storable: its leading pages this model computed from its own
    KV; recomputed: pages the ledger held as delivered translations that the engine has since
    computed itself (SGLang discarded the translation); derived: the indices, after
    ``storable``, of the pages this engine computed over translated KV (the rest after it are
    translations being written back)."""

    storable: int
    recomputed: int
    derived: tuple[int, ...] = ()


class Provenance:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._delivered: OrderedDict[str, int] = OrderedDict()  # key -> CRC-32 delivered
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._delivered)

    def delivered(self, key: str, crc: int) -> None:
        """SGLang received page ``key`` translated, with bytes of CRC-32 ``crc``."""
        with self._lock:
            self._delivered[key] = crc
            self._delivered.move_to_end(key)
            while len(self._delivered) > self.capacity:
                self._delivered.popitem(last=False)

    def seen(self, keys: Iterable[str]) -> None:
        """Keys SGLang named (a prefetch's prefix): refresh those the ledger holds."""
        with self._lock:
            self._refresh(keys)

    def verdict(self, prefix: list[str], keys: list[str], crcs: list[int]) -> Verdict:
        """For a write of pages ``keys`` (bytes of CRC-32 ``crcs``) after pages ``prefix``."""
        with self._lock:
            self._refresh(prefix)
            self._refresh(keys)
            descends = any(key in self._delivered for key in prefix)
            storable, recomputed, derived = 0 if descends else None, 0, []
            for i, (key, crc) in enumerate(zip(keys, crcs)):
                held = self._delivered.get(key)
                if held is not None and held != crc:
                    del self._delivered[key]
                    recomputed += 1
                    held = None
                if held is not None and storable is None:
                    storable = i
                elif held is None and storable is not None:
                    derived.append(i)
            storable = len(keys) if storable is None else storable
            return Verdict(storable, recomputed, tuple(derived))

    def _refresh(self, keys: Iterable[str]) -> None:
        for key in keys:
            if key in self._delivered:
                self._delivered.move_to_end(key)
