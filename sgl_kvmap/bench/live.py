"""The benchmark's replay against two live SGLang servers (``sgl-kvmap bench --live``).

Each request of a trace goes, as token ids, to the server its routing chose ("small" or
"large"), through SGLang's native ``/generate`` endpoint: greedy, streamed; a swapped request
is answered with ``quality_tokens`` tokens (its quality is judged on them), any other with its
first token (the in-process replay computes the same). What is measured, and where it comes
from (SGLang 0.5.23):

- **Time to first token**: from sending the request to the first streamed chunk that holds an
  output token (SGLang streams the first token at once whatever its stream interval,
  ``managers/scheduler_components/output_streamer.py:459-468``). It includes HiCache's
  prefetch from storage, the translation in KVMapStorage, the load-back and the prefill.
- **Tiers**: ``meta_info.cached_tokens_details`` of the last chunk, ``{"device", "host",
  "storage", "storage_backend"}``, which the native endpoint always returns when any prompt
  token was cached (``managers/tokenizer_manager.py:2569-2576``; no server flag and no request
  field: ``--enable-cache-report`` and ``return_cached_tokens_details`` are for the OpenAI
  endpoints only). ``device + host + storage`` is the matched prefix
  (``managers/schedule_batch.py:231-265``). SGLang does not tell a server's own storage pages
  from pages KVMapStorage translated from a peer; KVMapStorage's counters do (its stats file,
  ``LiveClient.stats``): the pages of its own it loaded during the request come first, the
  rest of the storage hit is ``translated`` (``counted_tiers``), and the request's
  ``fallbacks`` are the reasons it counted meanwhile. Without a stats file, the storage hits
  of a swapped request in a translating mode count as translated (``record_tiers``).
  ``computed`` is the prompt minus the cached tokens.
- **Quality** (swapped requests in a translating mode), against the re-prefill replay's answer
  to the same request: the share of its first ``quality_tokens`` greedy tokens this mode's
  answer reproduces before it first departs from it (``records.agreement``), and the
  teacher-forced mean NLL of that answer on the server that served the request, right after
  it (so over this mode's cache): prompt + answer sent with
  ``return_logprob`` and ``logprob_start_len = prompt - 1``. SGLang reuses cache only up to
  ``logprob_start_len`` (``schedule_batch.py:1774-1775``), so the answer is always computed;
  and its input logprobs are ``[None] + logprobs[:-1]`` paired with
  ``input_ids[logprob_start_len:]`` (``scheduler_components/logprob_result_processor.py:37-50``):
  a start at the prompt length itself would leave the first answer token without one. The
  re-prefill replay measures the same NLL on its own cache (``reference_nll``). These requests
  add the prompt and answer to that server's cache, as serving the answer would.

Requests are replayed one at a time, in arrival order, each after the previous one finished
and its server's writes to the store settled (``LiveClient.settle``; the in-process engines
wait for the same backups): no queueing and no batching across requests is modelled, and
``arrival_s`` is not waited for.
The stream must be SGLang's default (cumulative ``output_ids``); a server started with
``--incremental-streaming-output`` also works (the ids are then joined).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from ..core.errors import KVMapError
from ..sglang.client import Generation, LiveClient, LiveServerError
from ..sglang.launch import PAGE_SIZE
from .records import (
    MODES,
    REFERENCE_MODE,
    TIERS,
    TRANSLATING_MODES,
    Quality,
    RequestRecord,
    agreement,
)

QUALITY_TOKENS = 32  # answer tokens compared for greedy agreement


class TurnLike(Protocol):
    """The fields of ``sgl_kvmap.bench.workload.Turn`` a replay reads."""

    request: int
    session: int
    turn: int
    tokens: tuple[int, ...]  # the whole prompt of this request, history included
    output_tokens: int  # the answer length the trace asks for


@dataclass(frozen=True)
class Reference:
    """The re-prefill replay's answer to one request, and for a swapped request the
    teacher-forced NLL of that answer under re-prefill's own cache."""

    answer: tuple[int, ...]
    nll: float | None = None


class LiveReplay(NamedTuple):
    records: list[RequestRecord]
    answers: dict[int, Reference]  # by request index


def record_tiers(cached: Mapping[str, int], mode: str, swapped: bool) -> dict[str, int]:
    """The record's tiers (``TIERS``) from the server's: storage hits of a swapped request in
    a translating mode are the translated pages; every other storage hit is native."""
    storage_tier = "translated" if swapped and mode in TRANSLATING_MODES else "storage"
    reused = dict.fromkeys(TIERS, 0)
    reused["device"], reused["host"] = cached["device"], cached["host"]
    reused[storage_tier] = cached["storage"]
    return reused


def replay(
    turns: Sequence[TurnLike],
    models: Sequence[str],
    swapped: Sequence[bool],
    ideal_reuse: Sequence[int],
    *,
    policy: str,
    mode: str,
    client: LiveClient,
    references: Mapping[int, Reference] | None = None,
    quality_tokens: int = QUALITY_TOKENS,
    page_size: int = PAGE_SIZE,
) -> LiveReplay:
    """Replay ``turns`` (arrival order) one at a time; ``models[i]`` serves ``turns[i]``
    (the policy's routing), ``swapped[i]`` says whether it changed model, ``ideal_reuse[i]``
    is the oracle's reuse. A swapped request is answered with ``quality_tokens`` greedy tokens,
    any other with its first token (its time to first token is what is measured). In a
    translating mode ``references`` (re-prefill's answers, from this function in mode
    ``reprefill``) give each swapped request its quality. With the servers' counters
    (``LiveClient.stats``), their changes during a request split its storage hit into the
    server's own pages and translated ones (``page_size`` tokens a page) and give its
    fallbacks."""
    if mode not in MODES:
        raise KVMapError(f"mode must be one of {MODES}, got {mode!r}")
    if not len(turns) == len(models) == len(swapped) == len(ideal_reuse):
        raise KVMapError("turns, models, swapped and ideal_reuse must have one entry per turn")
    if mode in TRANSLATING_MODES and references is None:
        raise KVMapError(f"mode {mode!r} needs the re-prefill replay's answers (references)")
    records, answers, previous = [], {}, None
    for turn, model, moved, ideal in zip(turns, models, swapped, ideal_reuse):
        if previous is not None:
            client.settle(previous)
        previous = model
        before, seconds = client.counters(model), client.stage_seconds(model)
        generation = client.generate(model, turn.tokens, quality_tokens if moved else 1)
        changes = _changes(before, client.counters(model)) if model in client.stats else None
        record = _record(turn, model, moved, ideal, generation, policy, mode, changes, page_size)
        record.stages = _stages(generation, seconds, client.stage_seconds(model))
        if moved and mode == REFERENCE_MODE and generation.output_ids:
            nll = client.answer_nll(model, turn.tokens, generation.output_ids)
            answers[turn.request] = Reference(generation.output_ids, nll)
        else:
            answers[turn.request] = Reference(generation.output_ids)
        if moved and mode in TRANSLATING_MODES:
            reference = _reference(references, turn.request)
            record.quality = _quality(client, model, turn, generation, reference, quality_tokens)
        records.append(record)
    return LiveReplay(records, answers)


def _stages(generation: Generation, before: Counter, after: Counter) -> dict[str, float]:
    """Where a request's time went, as a live server tells it: the priming round trip
    (``meta_info.kvmap``) and the stages its KVMapStorage timed meanwhile."""
    after.subtract(before)
    primed = float((generation.kvmap or {}).get("primed_seconds", 0.0))
    return {"primed": primed, **{stage: max(0.0, s) for stage, s in after.items()}}


def _changes(before: Counter, after: Counter) -> Counter:
    after.subtract(before)
    return +after


def _record(
    turn, model, moved, ideal, generation: Generation, policy, mode, changes, page_size
) -> RequestRecord:
    prompt = len(turn.tokens)
    if generation.prompt_tokens != prompt:
        raise LiveServerError(
            f"request {turn.request}: the {model} server counted {generation.prompt_tokens} "
            f"prompt tokens for {prompt} token ids"
        )
    if changes is None:
        reused = record_tiers(generation.cached, mode, moved)
    else:
        reused = counted_tiers(generation.cached, changes, page_size)
    if sum(reused.values()) > prompt:
        raise LiveServerError(
            f"request {turn.request}: the {model} server reports {generation.cached} cached "
            f"tokens for a {prompt}-token prompt"
        )
    # the first page the server computed just before the request (sgl-kvmap's priming): a device
    # hit for the request, computed for the swap
    primed = min(int((generation.kvmap or {}).get("primed_tokens", 0)), reused["device"])
    reused["device"] -= primed
    fallbacks = {
        name.removeprefix("fallback."): n
        for name, n in (changes or {}).items()
        if name.startswith("fallback.")
    }
    return RequestRecord(
        policy=policy,
        mode=mode,
        request=turn.request,
        session=turn.session,
        turn=turn.turn,
        model=model,
        swapped=moved,
        prompt_tokens=prompt,
        ideal_reuse_tokens=ideal,
        reused=reused,
        computed=prompt - sum(reused.values()),
        fallbacks=fallbacks,
        ttft_s=generation.ttft_s,
        primed=primed,
    )


def counted_tiers(cached: Mapping[str, int], changes: Mapping[str, int], page: int) -> dict:
    """The record's tiers from the server's and its KVMapStorage's counters during the request:
    KVMapStorage hands SGLang the server's own pages first, then translated ones, and SGLang
    keeps a leading part of them, so what it took from storage beyond the own pages loaded is
    translated."""
    storage = cached["storage"]
    native = min(storage, changes.get("native_pages", 0) * page)
    reused = dict.fromkeys(TIERS, 0)
    reused["device"], reused["host"] = cached["device"], cached["host"]
    reused["storage"], reused["translated"] = native, storage - native
    return reused


def _reference(references: Mapping[int, Reference], request: int) -> Reference:
    reference = references.get(request)
    if reference is None:
        raise KVMapError(
            f"request {request} is swapped but the re-prefill replay has no answer for it: "
            "replay mode 'reprefill' first, with the same turns and policy"
        )
    return reference


def _quality(client, model, turn, generation, reference: Reference, tokens) -> Quality | None:
    if not reference.answer or reference.nll is None:
        return None  # re-prefill answered nothing (end of sequence at once): nothing to compare
    return Quality(
        tokens=min(tokens, len(reference.answer)),
        agreement=agreement(generation.output_ids, reference.answer, tokens),
        nll=client.answer_nll(model, turn.tokens, reference.answer),
        reference_nll=reference.nll,
    )
