"""The engine's own first page for every swap: compute a prompt's first page before the prompt.

An engine never translates a prefix's first page, its attention sinks (``StorageSettings.sinks``
"native" or "prime"): it translates only after a first page it holds as its own. A request whose
first page this engine holds nowhere would then be prefilled whole, however much of it a peer
stored; sessions that share no opening (per-user system prompts, a retrieved document first)
hit that on every first swap into an engine. Under ``sinks: "prime"`` (the default) the
``Primer`` finds such a request before it reaches the scheduler, and the engine computes the
request's first page first, as a request of that page alone with no new tokens: SGLang's own
way of caching the prefix that parallel samples share (``TokenizerManager._handle_batch_request``).
The request itself then matches that page on the device, and the pages after it are translated
from the peer as usual. The cost: one page of prefill and one pass through the scheduler.

Which requests are primed (``Primer.first_page``): a prompt long enough for a translated run
after its first page (SGLang's prefetch threshold, plus the tail the engine recomputes) whose
first page this engine has not stored, and whose first pages up to that length a peer stored
with their records. A first page this engine holds on its device but has not stored yet is
primed anyway (the priming request is then a one-page cache hit). Requests whose page keys the
scheduler seeds (an extra key or cache salt, a LoRA adapter) or that carry embeddings or images
are not primed, nor those whose id starts with ``settings.NATIVE_REQUEST_PREFIX``: ``sgl-kvmap
warm`` serves the opening every session shares so, and each engine computes all of it.

Where it runs: a live server primes in its TokenizerManager, through SGLang's plugin hooks
(``plugin``); the in-process engines (``engine.Engine``) call ``Primer.first_page`` before a
request's prefetch and serve the page the same way.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
from sglang.srt.mem_cache.utils import get_hash_str

from .records import derived_key, record_key


@dataclasses.dataclass
class Primer:
    """Decides which prompts an engine computes the first page of before serving them.

    page_size: the engine's tokens per page; own: this engine's store (its TP rank 0);
    peers: each peer's store (its rank 0), where the peer's pages and their records are;
    pages_needed: the first pages a peer must hold for a priming to pay (page 0, the pages a
    prefetch needs to pass SGLang's threshold, the engine's recomputed tail)."""

    page_size: int
    own: HiCacheStorage
    peers: list[HiCacheStorage]
    pages_needed: int

    def page_keys(self, tokens: Sequence[int], pages: int) -> list[str]:
        """SGLang's storage keys of the first ``pages`` full pages of ``tokens``."""
        whole = min(pages, len(tokens) // self.page_size) * self.page_size
        return get_hash_str(list(tokens[:whole]), None, page_size=self.page_size) if whole else []

    @classmethod
    def for_engine(
        cls, page_size: int, own: HiCacheStorage, peers: list[HiCacheStorage], *, threshold: int,
        tail_pages: int,
    ) -> Primer:  # fmt: skip
        """A primer for an engine whose prefetches need ``threshold`` tokens and that recomputes
        ``tail_pages`` pages of every translated run."""
        translated = max(1, math.ceil(threshold / page_size))
        return cls(page_size, own, peers, 1 + translated + tail_pages)

    def first_page(self, tokens: Sequence[int]) -> list[int] | None:
        """The first page of prompt ``tokens`` when the engine should compute it before the
        prompt (module docstring), else None."""
        # a prefetch covers every full page but the one holding the prompt's last token
        if (len(tokens) - 1) // self.page_size < self.pages_needed:
            return None
        keys = self.page_keys(tokens, self.pages_needed)
        if self.own.exists(keys[0]):
            return None
        if not any(_holds(peer, keys) for peer in self.peers):
            return None
        return list(tokens[: self.page_size])


def _holds(store: HiCacheStorage, keys: list[str]) -> bool:
    """Whether ``store`` holds every page of ``keys`` with its record (a page a peer computed
    over translated KV and stored apart counts too)."""
    return all(
        store.exists(record_key(key)) or store.exists(record_key(derived_key(key))) for key in keys
    )
