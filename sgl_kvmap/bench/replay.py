"""Replaying a workload on two in-process SGLang engines (``sglang.engine.Engine``: SGLang
0.5.23's own radix tree, HiCache host pool, controller threads and storage backend, on CPU).

One replay = one routing policy x one mode. Both engines and the store they share are created
for the replay and persist across all its requests, so whatever is reused comes from the trace's
structure: a session's earlier turns, prefixes that other sessions share, and (in a translating
mode) pages the other model stored. Requests run one at a time in arrival order; queueing is not
modelled (time to first token is the request's own prefetch, load-back and prefill).

Modes (how a swapped request's prefix is served; ``MODE_SETTINGS``): ``reprefill`` (HiCache with
the store, no translation: the target recomputes what it never cached itself), ``translated``
(the other model's pages translated, every page) and ``tail`` (translated, the last page of a
translated run recomputed). The hand-off repair of the library (anchors recomputed by the target)
has no place in SGLang's prefetch path, so it is not a mode here.

Quality, on swapped requests: the reprefill replay's greedy answer (``quality_tokens`` tokens) is
the reference; a translating mode's answer is judged against it teacher-forced, one forward over
the reference answer: ``agreement`` is the fraction of the reference that the mode's own greedy
decoding reproduces before it first departs from it (until the first difference both decode the
same context, so this is exactly the greedy answers' common prefix), ``nll`` the reference
answer's mean negative log-likelihood.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..core.errors import KVMapError
from ..models.capture import LoadedModel, run
from ..sglang.launch import PrefetchDeadline
from .records import MODES, REFERENCE_MODE, Quality, RequestRecord, agreement
from .workload import Turn

MODE_SETTINGS = {
    "reprefill": {"translate": False},
    "translated": {"translate": True, "tail_pages": 0},
    "tail": {"translate": True, "tail_pages": 1},
}


@dataclass(frozen=True)
class Deployment:
    """The two engines' models and packs. names: their served names (model folders);
    packs: ``{("small", "large"): pack folder, ("large", "small"): ...}``."""

    models: dict[str, LoadedModel]
    names: dict[str, str]
    packs: dict[tuple[str, str], str]

    def other(self, model: str) -> str:
        (other,) = set(self.models) - {model}
        return other


@dataclass
class Answer:
    """A request's greedy answer and its mean NLL (nats/token) under the cache that made it."""

    tokens: list[int]
    nll: float


@dataclass
class ReplayPlan:
    """What one replay serves: the turns, each one's model and swap flag, and the oracle's
    reusable tokens (``workload.ideal_reuse``)."""

    policy: str
    turns: list[Turn]
    models: list[str]
    swapped: list[bool]
    ideal: list[int]
    references: dict[int, Answer] = field(default_factory=dict)  # filled by the reprefill replay


def replay(
    deployment: Deployment,
    plan: ReplayPlan,
    mode: str,
    *,
    quality_tokens: int = 16,
    device_tokens: int = 8192,
    page_size: int = 64,
    deadline: PrefetchDeadline = PrefetchDeadline(),
    prefetch_threshold: int | None = None,
    overrides: dict | None = None,
    on_request: Callable[[RequestRecord], None] | None = None,
    inspect: Callable | None = None,
) -> list[RequestRecord]:
    """Serve ``plan``'s turns in ``mode`` on fresh engines over a fresh store; one record each.
    The engines run as ``sglang-args`` launches them: ``page_size`` tokens a page, SGLang's
    prefetch stop policy and ``deadline``, its own prefetch threshold (``prefetch_threshold``
    lowers it, for tests' short prompts).

    The reprefill replay stores each swapped request's answer in ``plan.references``; the
    translating modes need it (run reprefill first). ``overrides``: extra StorageSettings for
    both engines (tests use it to force fallbacks); ``inspect(engines, i, slots, record)`` is
    called after each request with both engines by model and the device slots of its prompt
    (tests read the pools)."""
    if mode not in MODES:
        raise KVMapError(f"unknown mode {mode!r}; modes are {', '.join(MODES)}")
    if mode != REFERENCE_MODE and any(plan.swapped) and not plan.references:
        raise KVMapError(f"replay {REFERENCE_MODE!r} first: {mode!r} is judged against it")
    from ..sglang.engine import Engine

    with tempfile.TemporaryDirectory(prefix="kvmap-bench-store-") as store:
        engines = {}
        try:
            for model in deployment.models:
                extra = _extra_config(deployment, model, mode, store, deadline, overrides or {})
                engines[model] = Engine(
                    deployment.models[model],
                    deployment.names[model],
                    extra,
                    page_size=page_size,
                    slots=device_tokens,
                    prefetch_threshold=prefetch_threshold,
                    prefetch_policy=deadline.policy,
                )
            records = []
            for i in range(len(plan.turns)):
                engine = engines[plan.models[i]]
                record, slots = _serve(engine, plan, i, mode, quality_tokens)
                records.append(record)
                if inspect:
                    inspect(engines, i, slots, record)
                if on_request:
                    on_request(record)
            return records
        finally:
            for engine in engines.values():
                engine.close()


def _extra_config(
    deployment: Deployment, model: str, mode: str, store: str, deadline, overrides
) -> dict:
    from ..sglang import PeerSettings, StorageSettings
    from ..sglang.launch import sglang_extra_config

    peer = deployment.other(model)
    settings = StorageSettings(
        interface_v1=True,
        model_path=deployment.names[model],
        peers=(PeerSettings(deployment.names[peer], str(deployment.packs[peer, model])),),
        **{**MODE_SETTINGS[mode], **overrides},
    )
    return sglang_extra_config(settings, store, deadline if settings.translate else None)


def _serve(engine, plan: ReplayPlan, i: int, mode: str, quality_tokens: int):
    """One request through ``engine``: timed to its first token, judged if it was swapped."""
    tokens = list(plan.turns[i].tokens)
    started = time.perf_counter()
    req, slots = engine.begin(tokens)
    prefix = req.prefix_len
    past = engine.pool_kv(slots[:prefix]) if prefix else None
    logits = engine.compute(tokens, slots, prefix, past, logits=1)
    int(logits[-1].argmax())  # the first token
    ttft = time.perf_counter() - started
    tiers = engine.last_tiers
    quality = None
    if plan.swapped[i]:
        quality = _judge(engine, plan, i, mode, slots, logits[-1], quality_tokens)
    engine.finish(req, logits)
    turn = plan.turns[i]
    record = RequestRecord(
        policy=plan.policy,
        mode=mode,
        request=turn.request,
        session=turn.session,
        turn=turn.turn,
        model=plan.models[i],
        swapped=plan.swapped[i],
        prompt_tokens=len(tokens),
        ideal_reuse_tokens=plan.ideal[i],
        reused={
            "device": tiers.device,
            "host": tiers.host,
            "storage": tiers.storage,
            "translated": tiers.translated,
        },
        computed=len(tokens) - prefix,
        fallbacks=dict(tiers.fallbacks),
        ttft_s=ttft,
        quality=quality,
    )
    return record, slots


def _judge(engine, plan, i, mode, slots, last_logits, quality_tokens) -> Quality | None:
    """The reference answer (reprefill: made and stored here) and this mode's quality."""
    model = engine.model.model
    cache = engine.pool_kv(slots)
    if mode == REFERENCE_MODE:
        answer = greedy_answer(model, cache, last_logits, quality_tokens)
        nll, _ = teacher_forced(model, cache, last_logits, answer)
        plan.references[plan.turns[i].request] = Answer(answer, nll)
        return None
    reference = plan.references[plan.turns[i].request]
    nll, predicted = teacher_forced(model, cache, last_logits, reference.tokens)
    tokens = len(reference.tokens)
    return Quality(tokens, agreement(predicted, reference.tokens, tokens), nll, reference.nll)


@torch.no_grad()
def greedy_answer(model, cache, last_logits: torch.Tensor, count: int) -> list[int]:
    """``count`` greedy tokens after a prompt whose KV is ``cache`` and whose last logits are
    ``last_logits: [vocab]``."""
    answer = [int(last_logits.argmax())]
    while len(answer) < count:
        out = run(model, torch.tensor(answer[-1:]), past=cache, logits_to_keep=1)
        cache = out.cache
        answer.append(int(out.logits[-1].argmax()))
    return answer


@torch.no_grad()
def teacher_forced(
    model, cache, last_logits: torch.Tensor, answer: list[int]
) -> tuple[float, list[int]]:
    """``answer``'s mean NLL after the prompt (``cache``, ``last_logits: [vocab]``) and the
    greedy token at each of its positions given the answer before it: up to its first departure
    from ``answer`` that is greedy decoding's own answer (``records.agreement``)."""
    logits = last_logits[None]
    if len(answer) > 1:
        rest = run(model, torch.tensor(answer[:-1]), past=cache, logits_to_keep=len(answer) - 1)
        logits = torch.cat([logits, rest.logits])
    target = torch.tensor(answer)
    nll = torch.nn.functional.cross_entropy(logits.float(), target).item()
    return nll, logits.argmax(-1).tolist()
