"""Serve a deployment's shared opening on every engine once (``sgl-kvmap warm``; no sglang import).

A swap translates the pages the receiving engine lacks from the first one it lacks on, and
once loaded they are device pages of its radix tree: every later request sharing that prefix
reuses them, whoever computed them (SGLang matches a prefix by its tokens). Under the default
sinks policy (``StorageSettings.sinks``) an engine never translates a prefix's first page, so
it computes the opening every session shares (a system prompt, the chat template's first turn)
itself, even when a peer has stored it; a swap whose opening the engine has never served is
prefilled. Warming serves the opening on each engine once, so that from the first swap on a
swap translates only the session's pages after it and requests that share only the opening
read exact KV. Warm each engine once it is healthy, and again after it restarts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from ..core.errors import KVMapError
from .client import LiveClient
from .servers import healthy

HEALTH_POLL_S = 1.0


@dataclass(frozen=True)
class Warmed:
    """One engine after warming: its URL, the opening's length in its tokens, how many of them
    a second read of the opening found cached on its device (whole pages), and its page
    size."""

    url: str
    prompt_tokens: int
    cached: int
    page_size: int = 1

    @property
    def partial(self) -> int:
        """The opening's tokens after its last whole page: no engine keeps them as a page."""
        return self.prompt_tokens % self.page_size

    def line(self) -> str:
        line = (
            f"{self.url}: served the opening ({self.prompt_tokens} tokens); "
            f"{self.cached} of them are now cached on its device"
        )
        if not self.partial:
            return line
        whole = self.prompt_tokens - self.partial
        return line + (
            f"; its last {self.partial} tokens ({whole}..{self.prompt_tokens - 1}) end a partial "
            f"{self.page_size}-token page that no engine keeps as its own: where sessions share "
            "them and the tokens after them up to the next page boundary, a swap translates that "
            "page and later sessions read the translation. An opening of "
            f"{whole} or {whole + self.page_size} tokens keeps every page it shares this engine's "
            "own"
        )


def warm(urls: Sequence[str], opening: str | Sequence[int], timeout: float) -> list[Warmed]:
    """Serve ``opening`` (text, or token ids) on each server of ``urls`` (base URLs such as
    ``http://127.0.0.1:30000``), one answer token, each once ``GET /health`` answers (within
    ``timeout`` seconds); then read it again to see what the server holds of it.

    KVMapError if a server is not healthy in time, answers with an error, or holds none of
    the opening afterwards (an opening shorter than a page is never cached)."""
    servers = {url.rstrip("/"): url.rstrip("/") for url in urls}
    with LiveClient(servers, timeout=max(timeout, 60.0)) as client:
        return [_warm_one(client, url, opening, timeout) for url in servers]


def _warm_one(client: LiveClient, url: str, opening: str | Sequence[int], timeout: float) -> Warmed:
    _wait_healthy(url, timeout)
    client.generate(url, opening, 1, native=True)
    again = client.generate(url, opening, 1, native=True)
    page_size = client.page_size(url)
    if again.cached["device"] == 0:
        raise KVMapError(
            f"{url} holds none of the {again.prompt_tokens}-token opening after serving it: "
            "is the opening shorter than one page (--page-size), or the server's radix cache "
            "disabled?"
        )
    return Warmed(url, again.prompt_tokens, again.cached["device"], page_size)


def _wait_healthy(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not healthy(url):
        if time.monotonic() > deadline:
            raise KVMapError(f"{url} did not answer GET /health with 200 within {timeout:g} s")
        time.sleep(HEALTH_POLL_S)
