"""An HTTP client for live SGLang servers (no sglang import): greedy ``/generate`` calls by
model name, the prompt tokens each server reports cached per tier, teacher-forced
log-probabilities, and KVMapStorage's counters from its stats file.

SGLang 0.5.23's native ``/generate`` endpoint is used: ``meta_info.cached_tokens_details``
(``{"device", "host", "storage", ...}``) is always returned when any prompt token was cached
(``managers/tokenizer_manager.py:2569-2576``); a streamed ``{"error": ...}`` arrives with HTTP
200 (``entrypoints/http_server.py:957-974``). The benchmark's live replay (``bench.live``) and
``sgl-kvmap warm`` use it.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import KVMapError
from .settings import NATIVE_REQUEST_PREFIX

SETTLE_S = 0.5  # a server whose store writes paused this long has written a request's pages
SETTLE_MAX_S = 30.0
SERVER_TIERS = ("device", "host", "storage")  # the keys of SGLang's cached_tokens_details


class LiveServerError(KVMapError):
    """A live SGLang server could not be reached or answered a request with an error."""


@dataclass(frozen=True)
class Generation:
    """One streamed greedy generation: the answer, the time to its first token, the prompt
    tokens the server reports cached per tier (``SERVER_TIERS``), and what sgl-kvmap did for the
    request (``meta_info["kvmap"]``, its SGLang plugin's report: ``plugin``; None from a server
    without it)."""

    output_ids: tuple[int, ...]
    ttft_s: float
    prompt_tokens: int
    cached: dict[str, int]
    kvmap: dict | None = None


class LiveClient:
    """Greedy ``/generate`` calls to the servers of one pair, by model name ("small",
    "large"): ``servers`` maps each to its base URL, e.g. ``http://127.0.0.1:30000``;
    ``stats``, where known, each server's KVMapStorage counters file (its ``stats_path``)."""

    def __init__(
        self,
        servers: Mapping[str, str],
        timeout: float = 600.0,
        stats: Mapping[str, str | Path] | None = None,
    ):
        import httpx

        self.servers = {model: url.rstrip("/") for model, url in servers.items()}
        self.stats = {model: Path(path) for model, path in (stats or {}).items()}
        self._http = httpx.Client(timeout=httpx.Timeout(timeout, connect=10.0))

    def settle(self, model: str) -> None:
        """Wait until ``model``'s server has stopped writing to the store (its KVMapStorage
        counters of written and withheld pages unchanged for ``SETTLE_S``, at most
        ``SETTLE_MAX_S``): the pages of the request it just served are then in the store, as
        they are when a session's next turn arrives after a user's think time."""
        if model not in self.stats:
            return
        written = ("stored_pages", "pages_withheld")
        last, since = None, time.monotonic()
        deadline = since + SETTLE_MAX_S
        while time.monotonic() < deadline:
            counters = self.counters(model)
            now = tuple(counters[name] for name in written)
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= SETTLE_S:
                return
            time.sleep(0.05)

    def counters(self, model: str) -> Counter:
        """The KVMapStorage counters ``model``'s server has written so far (empty without a
        stats file)."""
        return Counter(self._stats(model).get("counters", {}))

    def stage_seconds(self, model: str) -> Counter:
        """The wall seconds ``model``'s KVMapStorage has spent in each stage of its path so far
        (``storage.STAGES``; empty without a stats file)."""
        return Counter(self._stats(model).get("seconds", {}))

    def _stats(self, model: str) -> dict:
        path = self.stats.get(model)
        if path is None or not path.exists():
            return {}
        return json.loads(path.read_text())

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> LiveClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self, model: str, tokens: Sequence[int] | str, max_new_tokens: int, native: bool = False
    ) -> Generation:
        """Greedy ``max_new_tokens`` after the prompt ``tokens`` (token ids, or text the server
        tokenizes), streamed; ``native``: the server computes the whole prompt, never its first
        page apart (``NATIVE_REQUEST_PREFIX``)."""
        prompt = {"text": tokens} if isinstance(tokens, str) else {"input_ids": list(tokens)}
        body = {
            **prompt,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens},
            "stream": True,
        }
        if native:
            body["rid"] = f"{NATIVE_REQUEST_PREFIX}{uuid.uuid4().hex}"
        started = time.perf_counter()
        first, chunks = None, []
        for chunk in self._stream(model, body):
            if first is None and chunk.get("output_ids"):
                first = time.perf_counter()
            chunks.append(chunk)
        if not chunks:
            raise LiveServerError(f"{self._where(model)} streamed no output for the request")
        meta = chunks[-1].get("meta_info") or {}
        prompt = meta.get("prompt_tokens") if isinstance(meta, dict) else None
        if type(prompt) is not int or prompt < 0:  # a text prompt's length is the server's to say
            raise LiveServerError(f"{self._where(model)} sent no meta_info.prompt_tokens count")
        return Generation(
            output_ids=_answer_ids(chunks, meta, self._where(model)),
            ttft_s=(first or time.perf_counter()) - started,
            prompt_tokens=int(meta["prompt_tokens"]),
            cached=cached_by_tier(meta),
            kvmap=meta.get("kvmap"),
        )

    def page_size(self, model: str) -> int:
        """The page size ``model``'s server runs with (SGLang's ``GET /server_info``)."""
        import httpx

        url = self.servers[model] + "/server_info"
        try:
            response = self._http.get(url)
        except httpx.HTTPError as exc:
            raise self._unreachable(model, exc) from exc
        if response.status_code != 200:
            raise self._status_error(model, response)
        try:
            page = response.json()["page_size"]
        except (ValueError, KeyError, TypeError):
            page = None
        if isinstance(page, bool) or not isinstance(page, int) or page < 1:
            raise LiveServerError(f"{self._where(model)} reports no page size at /server_info")
        return page

    def answer_nll(self, model: str, prompt: Sequence[int], answer: Sequence[int]) -> float:
        """Mean negative log-likelihood (nats/token) of ``answer`` after ``prompt``."""
        logprobs = self.answer_logprobs(model, prompt, answer)
        return -sum(logprobs) / len(logprobs)

    def answer_logprobs(
        self, model: str, prompt: Sequence[int], answer: Sequence[int]
    ) -> list[float]:
        """The log-probability of each token of ``answer`` after ``prompt``, teacher-forced, as
        ``model``'s server computes it over what it has cached of ``prompt``."""
        body = {
            "input_ids": [*prompt, *answer],
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 1},
            "return_logprob": True,
            "logprob_start_len": max(len(prompt) - 1, 0),
            "stream": False,
        }
        meta = self._post(model, body).get("meta_info") or {}
        return answer_logprobs(meta.get("input_token_logprobs") or [], answer, len(prompt))

    def _stream(self, model: str, body: dict) -> Iterator[dict]:
        import httpx

        try:
            with self._http.stream("POST", self._url(model), json=body) as response:
                if response.status_code != 200:
                    response.read()
                    raise self._status_error(model, response)
                yield from sse_payloads(response.iter_lines(), self._where(model))
        except httpx.HTTPError as exc:
            raise self._unreachable(model, exc) from exc

    def _post(self, model: str, body: dict) -> dict:
        import httpx

        try:
            response = self._http.post(self._url(model), json=body)
        except httpx.HTTPError as exc:
            raise self._unreachable(model, exc) from exc
        if response.status_code != 200:
            raise self._status_error(model, response)
        return response.json()

    def _url(self, model: str) -> str:
        if model not in self.servers:
            raise KVMapError(f"no server for model {model!r}; servers: {sorted(self.servers)}")
        return self.servers[model] + "/generate"

    def _where(self, model: str) -> str:
        return f"the {model} server at {self.servers[model]}"

    def _unreachable(self, model: str, exc: Exception) -> LiveServerError:
        return LiveServerError(
            f"{self._where(model)} did not answer ({type(exc).__name__}: {exc}); is it running "
            "and healthy (GET /health)? See its log"
        )

    def _status_error(self, model: str, response) -> LiveServerError:
        return LiveServerError(
            f"{self._where(model)} answered HTTP {response.status_code}: "
            f"{response.text.strip()[:500]}"
        )


def sse_payloads(lines: Iterable[str], where: str) -> Iterator[dict]:
    """The JSON objects of SGLang's event stream (``data: {...}`` lines up to ``data:
    [DONE]``); an ``{"error": ...}`` object, which SGLang streams with HTTP 200
    (``entrypoints/http_server.py:957-974``), raises."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        try:
            payload = json.loads(data)
        except ValueError:
            raise LiveServerError(
                f"{where} streamed an event that is not JSON: {data[:200]}"
            ) from None
        if not isinstance(payload, dict):
            raise LiveServerError(f"{where} streamed an event that is not an object: {data[:200]}")
        if "error" in payload:
            error = payload["error"]
            message = error.get("message", error) if isinstance(error, dict) else error
            raise LiveServerError(f"{where} streamed an error: {message}")
        yield payload


def cached_by_tier(meta: dict) -> dict[str, int]:
    """SGLang's per-tier cached prompt tokens (``SERVER_TIERS``); without details (SGLang
    sends none when nothing was cached) every tier is 0, unless ``cached_tokens`` says
    otherwise, which SGLang reports as device hits (``output_streamer.py:102-132``)."""
    details = meta.get("cached_tokens_details") or {}
    if not details and meta.get("cached_tokens"):
        details = {"device": meta["cached_tokens"]}
    if not isinstance(details, dict):
        raise LiveServerError(f"cached_tokens_details is not an object: {details!r:.200}")
    counts = {tier: details.get(tier) or 0 for tier in SERVER_TIERS}
    bad = {tier: n for tier, n in counts.items() if type(n) is not int or n < 0}
    if bad:
        raise LiveServerError(f"cached tokens per tier that are not counts: {bad!r:.200}")
    return counts


def answer_logprobs(
    input_token_logprobs: Sequence[Sequence], answer: Sequence[int], prompt_tokens: int
) -> list[float]:
    """The logprob of every answer token from SGLang's ``meta_info.input_token_logprobs``
    (``[logprob, token_id, text]`` per input token from ``logprob_start_len = prompt - 1``;
    the first entry, the last prompt token, has no logprob)."""
    entries = list(input_token_logprobs)[-len(answer) :] if answer else []
    ids = [int(entry[1]) for entry in entries]
    if ids != list(answer):
        raise LiveServerError(
            f"the server returned logprobs for tokens {ids[:8]}... where the answer after the "
            f"{prompt_tokens}-token prompt is {list(answer)[:8]}...: was logprob_start_len "
            "honoured?"
        )
    values = [entry[0] for entry in entries]
    if any(v is None or not math.isfinite(v) for v in values):
        raise LiveServerError(f"the server returned missing or non-finite logprobs: {values}")
    return [float(v) for v in values]


def _answer_ids(chunks: list[dict], meta: dict, where: str) -> tuple[int, ...]:
    """The answer from SGLang's default cumulative stream (the last chunk holds every id), or
    from an incremental one (``--incremental-streaming-output``: the chunks' ids joined),
    whichever matches ``meta_info.completion_tokens``."""
    last = list(chunks[-1].get("output_ids") or [])
    expected = meta.get("completion_tokens", len(last))
    if len(last) == expected:
        return tuple(last)
    joined = [i for chunk in chunks for i in chunk.get("output_ids") or []]
    if len(joined) == expected:
        return tuple(joined)
    raise LiveServerError(
        f"{where} reported {expected} completion tokens but streamed {len(last)} "
        f"(last chunk) / {len(joined)} (all chunks)"
    )
