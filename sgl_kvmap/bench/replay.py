"""Replaying a workload on two in-process SGLang engines (``sglang.engine.Engine``: SGLang
0.5.23's own radix tree, HiCache host pool, controller threads and storage backend, on CPU).

One replay = one routing policy x one mode. Both engines and the store they share are created
for the replay and persist across all its requests, so whatever is reused comes from the trace's
structure: a session's earlier turns, prefixes that other sessions share, and (in a translating
mode) pages the other model stored. Requests run one at a time in arrival order; queueing is not
modelled (time to first token is the request's own prefetch, load-back and prefill).

Modes (how a swapped request's prefix is served; ``MODE_SETTINGS``): ``reprefill`` (HiCache with
the store, no translation: the target recomputes what it never cached itself), ``translated``
(the other model's pages translated, every page) and ``tail`` (translated, the last pages of a
translated run recomputed). The hand-off repair of the library (anchors recomputed by the target)
has no place in SGLang's prefetch path, so it is not a mode here.

Quality, on swapped requests, teacher-forced on the trace's true continuation
(``Turn.continuation``, held-out text after the prompt): each mode's top-1 accuracy and NLL
under the cache it served, beside the baselines (``records.BASELINES``) measured once in the
reprefill replay: the target on its own cache (reference), staying on the source model (its full
forward over the prompt) and the target on the turn's new tokens alone. And against the
reprefill replay's greedy answer (``quality_tokens`` tokens), one forward over it: ``agreement``
is the fraction of the reference that the mode's own greedy decoding reproduces before it first
departs from it (until the first difference both decode the same context, so this is exactly the
greedy answers' common prefix), ``nll`` the reference answer's mean negative log-likelihood.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..core.errors import KVMapError
from ..models.capture import LoadedModel, run
from ..sglang.launch import PAGE_SIZE, PREFETCH_THRESHOLD, PrefetchDeadline
from ..sglang.settings import INNER_BACKENDS, StorageSettings
from .records import MODES, REFERENCE_MODE, Quality, RequestRecord, Scores, agreement
from .workload import Turn

MODE_SETTINGS = {
    "reprefill": {"translate": False},
    "translated": {"translate": True, "tail_pages": 0},
    "tail": {"translate": True, "tail_pages": StorageSettings.tail_pages},
}
KV_DTYPE = torch.bfloat16  # the engines' KV pools (and so their stored pages)
MIN_SEGMENT = 16 << 20  # bytes: Mooncake refuses to mount less


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
    """A swapped request's greedy answer and its mean NLL (nats/token) under the cache that made
    it (the target's own), and the baselines' scores on its true continuation (BASELINES)."""

    tokens: list[int]
    nll: float
    baselines: dict[str, Scores] = field(default_factory=dict)


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
    page_size: int = PAGE_SIZE,
    deadline: PrefetchDeadline = PrefetchDeadline(),
    prefetch_threshold: int | None = PREFETCH_THRESHOLD,
    overrides: dict | None = None,
    opening: tuple[int, ...] = (),
    on_request: Callable[[RequestRecord], None] | None = None,
    inspect: Callable | None = None,
    store: str = "file",
) -> list[RequestRecord]:
    """Serve ``plan``'s turns in ``mode`` on fresh engines over a fresh store; one record each.
    The engines run as ``sglang-args`` launches them: ``page_size`` tokens a page, SGLang's
    prefetch stop policy and ``deadline``, ``prefetch_threshold`` tokens before a prefetch
    (None: SGLang's own).

    The reprefill replay stores each swapped request's answer in ``plan.references``; the
    translating modes need it (run reprefill first). The engines translate with any pack (no
    quality floor) unless ``overrides``, extra StorageSettings for both engines, set one (tests
    also use it to force fallbacks); ``opening``: tokens every engine serves itself before the
    first request (a warm shared opening: ``workload.shared_opening``; not recorded);
    ``inspect(engines, i, slots, record)`` is called after
    each request with both engines by model and the device slots of its prompt (tests read
    the pools); ``store``: the engines' shared store (``fresh_store``)."""
    if mode not in MODES:
        raise KVMapError(f"unknown mode {mode!r}; modes are {', '.join(MODES)}")
    if mode != REFERENCE_MODE and any(plan.swapped) and not plan.references:
        raise KVMapError(f"replay {REFERENCE_MODE!r} first: {mode!r} is judged against it")
    from ..sglang.engine import Engine

    segment = segment_bytes(deployment, plan.turns, page_size)
    with fresh_store(store, segment) as keys:
        engines = {}
        try:
            for model in deployment.models:
                settings = {"inner_backend": store, **(overrides or {})}
                extra = _extra_config(deployment, model, mode, keys, deadline, settings)
                engines[model] = Engine(
                    deployment.models[model],
                    deployment.names[model],
                    extra,
                    dtype=KV_DTYPE,
                    page_size=page_size,
                    slots=device_tokens,
                    prefetch_threshold=prefetch_threshold,
                    prefetch_policy=deadline.policy,
                )
            if opening:
                for engine in engines.values():
                    engine.serve(list(opening), prime=False)
            records = []
            for i in range(len(plan.turns)):
                engine = engines[plan.models[i]]
                record, slots = _serve(engine, deployment, plan, i, mode, quality_tokens)
                records.append(record)
                if inspect:
                    inspect(engines, i, slots, record)
                if on_request:
                    on_request(record)
            return records
        finally:
            for engine in engines.values():
                engine.close()


@contextlib.contextmanager
def fresh_store(store: str, segment: int) -> Iterator[dict]:
    """A new, empty store for one replay, as SGLang's extra-config keys that name it: a
    temporary folder (``file``), or a ``mooncake_master`` of its own on free ports of 127.0.0.1
    (``mooncake``; each engine, with a client of its own, mounts ``segment`` bytes)."""
    if store not in INNER_BACKENDS:
        raise KVMapError(f"unknown store {store!r}; stores are {', '.join(INNER_BACKENDS)}")
    with tempfile.TemporaryDirectory(prefix="kvmap-bench-store-") as folder:
        if store == "file":
            yield {"file_storage_path": folder}
            return
        from ..sglang.mooncake_master import Master

        with Master(Path(folder) / "mooncake_master.log") as master:
            yield master.extra(segment)


def segment_bytes(deployment: Deployment, turns: list, page_size: int) -> int:
    """What each engine mounts in a Mooncake store: room for every full page of every prompt
    at the larger model's page size, so two engines' segments stay below half full and the
    master never evicts (the file store keeps every page too)."""
    pages = sum(len(turn.tokens) // page_size for turn in turns)
    largest = max(_page_bytes(model.spec, page_size) for model in deployment.models.values())
    return max(MIN_SEGMENT, pages * largest)


def _page_bytes(spec, page_size: int) -> int:
    """One stored page (K and V of every layer and KV head) of a model of ``spec``."""
    elements = 2 * page_size * spec.num_layers * spec.num_kv_heads * spec.head_dim
    return elements * KV_DTYPE.itemsize


def _extra_config(
    deployment: Deployment, model: str, mode: str, store_keys: dict, deadline, overrides
) -> dict:
    from ..sglang import PeerSettings, StorageSettings
    from ..sglang.launch import sglang_extra_config

    peer = deployment.other(model)
    settings = StorageSettings(
        interface_v1=True,
        model_path=deployment.names[model],
        peers=(PeerSettings(deployment.names[peer], str(deployment.packs[peer, model])),),
        **{"quality_floor": None, **MODE_SETTINGS[mode], **overrides},
    )
    deadline = deadline if settings.translate else None
    return sglang_extra_config(settings, "", deadline, store_keys=store_keys)


def _serve(
    engine, deployment: Deployment, plan: ReplayPlan, i: int, mode: str, quality_tokens: int
):
    """One request through ``engine``: timed to its first token, judged if it was swapped."""
    tokens = list(plan.turns[i].tokens)
    started = time.perf_counter()
    req, slots = engine.begin(tokens)
    forward = time.perf_counter()
    prefix = req.prefix_len
    past = engine.pool_kv(slots[:prefix]) if prefix else None
    logits = engine.compute(tokens, slots, prefix, past, logits=1)
    int(logits[-1].argmax())  # the first token
    ttft = time.perf_counter() - started
    stages = {**engine.last_stages, "forward": time.perf_counter() - forward}
    tiers = engine.last_tiers
    quality = None
    if plan.swapped[i]:
        quality = _judge(engine, deployment, plan, i, mode, slots, logits[-1], quality_tokens)
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
        computed=len(tokens) - prefix + tiers.primed,
        fallbacks=dict(tiers.fallbacks),
        ttft_s=ttft,
        quality=quality,
        primed=tiers.primed,
        stages=stages,
    )
    return record, slots


def _judge(engine, deployment, plan, i, mode, slots, last_logits, quality_tokens) -> Quality:
    """This mode's quality on swapped request ``i``; the reprefill replay first makes and stores
    the reference answer and the baselines' scores."""
    model = engine.model.model
    cache = engine.pool_kv(slots)
    turn = plan.turns[i]
    served = served_scores(model, cache, last_logits, turn.continuation)
    if mode == REFERENCE_MODE:
        answer = greedy_answer(model, cache, last_logits, quality_tokens)
        nll, predicted = teacher_forced(model, cache, last_logits, answer)
        baselines = {} if served is None else _baselines(deployment, plan, i, served)
        plan.references[turn.request] = Answer(answer, nll, baselines)
    reference = plan.references[turn.request]
    if mode != REFERENCE_MODE:
        nll, predicted = teacher_forced(model, cache, last_logits, reference.tokens)
    tokens = len(reference.tokens)
    return Quality(
        tokens,
        agreement(predicted, reference.tokens, tokens),
        nll,
        reference.nll,
        continuation_tokens=len(turn.continuation),
        continuation=served,
        baselines=dict(reference.baselines),
    )


def _baselines(deployment: Deployment, plan: ReplayPlan, i: int, reference: Scores) -> dict:
    """Request ``i``'s baselines: the target's own cache (``reference``), the source model it
    was swapped from over the whole prompt, the target over the turn's new tokens alone."""
    turn = plan.turns[i]
    target = plan.models[i]
    new = turn.tokens[len(turn.tokens) - max(1, turn.new_tokens) :]
    return {
        "reference": reference,
        "source": fresh_scores(
            deployment.models[deployment.other(target)].model, turn.tokens, turn.continuation
        ),
        "no_prefix": fresh_scores(deployment.models[target].model, new, turn.continuation),
    }


def served_scores(
    model, cache, last_logits: torch.Tensor, continuation: tuple[int, ...]
) -> Scores | None:
    """``continuation``'s teacher-forced scores after a prompt whose KV is ``cache`` and whose
    last logits are ``last_logits: [vocab]`` (None for an empty continuation)."""
    if not continuation:
        return None
    nll, predicted = teacher_forced(model, cache, last_logits, list(continuation))
    return Scores(_accuracy(predicted, continuation), nll)


@torch.no_grad()
def fresh_scores(model, prompt: tuple[int, ...], continuation: tuple[int, ...]) -> Scores:
    """``continuation``'s teacher-forced scores after ``prompt``, the model computing it all."""
    out = run(model, torch.tensor([*prompt, *continuation[:-1]]), logits_to_keep=len(continuation))
    nll = torch.nn.functional.cross_entropy(out.logits, torch.tensor(continuation)).item()
    return Scores(_accuracy(out.logits.argmax(-1).tolist(), continuation), nll)


def _accuracy(predicted: list[int], truth: tuple[int, ...]) -> float:
    return sum(p == t for p, t in zip(predicted, truth)) / len(truth)


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
