"""Hand a prefix from the source model to the target: map its cache, patch the sinks.

The hand-off convention used everywhere in sgl-kvmap: for a prompt of P tokens, the target
gets a translated cache for tokens [0, P - 1 - tail) and computes the remaining ``tail + 1``
tokens itself (the last prompt token always, since its logits start the answer). Attention
sinks map badly, so the target computes its own KV for the first ``mapper.sink_tokens``
tokens: a forward over a handful of tokens, exact because attention is causal. ``handoff`` does
the whole hand-off with ONE target forward: the sink tokens ride in the forward over the tail
and the last prompt token (a scattered forward), so the target's weights are read once.
Layer 0's K/V read no context, so the target computes them exactly for every translated token
(``capture.first_layer_kv``: embedding, norm, projection; no attention, no MLP).

Repair (``Repair``): the same forward can also recompute chosen translated tokens ("anchors"),
the prompt tokens that the answer is likely to read. The source, whose cache is exact, drafts a
few tokens greedily after the prompt; the translated tokens its drafted queries attend to most
are the anchors. (The continuation's own attention picks the tokens that matter; the prompt's
last queries pick worse: see docs/LOG.md.) Greedy decoding is serial, one
source forward per drafted token; a parallel draft (``Repair.sweeps``) guesses the draft by
prompt lookup (``lookup_guess``: code and chat repeat their context) and refines the guess in a
few parallel forwards (Jacobi iterations, whose fixed point is the greedy draft).

The draft needs the source model at hand-off time; in serving the source is another engine.
``Repair.choice`` picks the anchors in a way serving can afford instead (``pick_anchors``):
"source_prompt" by the attention of the source's last prompt queries (what the source engine
computes in its own prefill and could write beside its pages), "target_tail" by the attention
of the target's own queries over the translated cache, "recent" the tokens just before the tail
(a longer tail).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.errors import KVMapError
from ..core.mapper import KVMapper
from ..core.token_weights import attention_paid
from .capture import (
    ForwardResult,
    KVCache,
    first_layer_kv,
    forward_scattered,
    recompute_tokens,
    run,
)

ANCHOR_CHOICES = ("draft", "source_prompt", "target_tail", "recent")
"""How ``Repair`` picks its anchors (``pick_anchors``)."""


@dataclass(frozen=True)
class Repair:
    """Translated prompt tokens the target recomputes at hand-off, and how they are picked.

    anchors: how many translated tokens to recompute (besides the sinks and the tail).
    draft: tokens the source drafts greedily after the prompt over its own cache; the anchors
    are the translated tokens that the queries of the last prompt token and of the drafted
    tokens attend to most (mean over the source's layers and heads).
    sweeps: 0 decodes the draft serially (``draft - 1`` source forwards of one token each);
    s >= 1 drafts in parallel: a prompt-lookup guess refined by s source forwards over the
    whole draft (Jacobi iterations; s >= draft - 1 gives the greedy draft's queries exactly).
    choice: what picks the anchors, one of ``ANCHOR_CHOICES``: "draft" (the source's draft
    above), "source_prompt" (``source_prompt_anchors``), "target_tail"
    (``target_tail_anchors``) or "recent" (``recent_anchors``); draft and sweeps serve
    "draft" only.
    """

    anchors: int
    draft: int = 2  # at 240 anchors as good as a 32-token draft (docs/LOG.md)
    sweeps: int = 0
    choice: str = "draft"

    def __post_init__(self) -> None:
        if self.anchors < 0 or self.draft < 1 or self.sweeps < 0:
            raise KVMapError(f"need anchors >= 0, draft >= 1 and sweeps >= 0, got {self!r}")
        if self.choice not in ANCHOR_CHOICES:
            raise KVMapError(
                f"anchor choice must be one of {', '.join(ANCHOR_CHOICES)}, got {self.choice!r}"
            )

    @classmethod
    def parse(cls, text: str) -> Repair:
        """``"ANCHORS:DRAFT[:SWEEPS]"``, e.g. ``"240:32:2"`` (KVMapError if malformed)."""
        try:
            numbers = [int(part) for part in text.split(":")]
        except ValueError:
            numbers = []
        if len(numbers) not in (2, 3):
            raise KVMapError(f"expected ANCHORS:DRAFT[:SWEEPS], got {text!r}")
        return cls(*numbers)

    def __str__(self) -> str:
        if self.choice != "draft":
            return f"{self.anchors} anchors by {_CHOICE_NAMES[self.choice]}"
        text = f"{self.anchors} anchors by a {self.draft}-token source draft"
        if not self.sweeps:
            return text
        return text + f" ({self.sweeps} parallel sweep{'s' if self.sweeps > 1 else ''})"


def translate_prefix(
    mapper: KVMapper,
    source_cache: KVCache,
    token_ids: torch.Tensor,
    target_model,
    anchors: torch.Tensor | None = None,
    exact_first_layer: bool = True,
) -> KVCache:
    """Target cache for ``token_ids: [t]`` from the source's cache of the same tokens (t layers x
    [t, kv_s, d_s]), with the first ``mapper.sink_tokens`` tokens and the ``anchors: [A]``
    (indices in [0, t)) recomputed by ``target_model`` in one scattered forward, and (with
    ``exact_first_layer``) the target's own layer 0 for every token."""
    if len(source_cache) != token_ids.numel():
        raise ValueError(
            f"source cache holds {len(source_cache)} tokens, token_ids {token_ids.numel()}"
        )
    mapped = mapped_prefix(mapper, source_cache, token_ids, target_model, exact_first_layer)
    positions = _with_sinks(anchors, mapper.sink_tokens, token_ids.numel())
    return recompute_tokens(target_model, mapped, token_ids, positions)


def handoff(
    mapper: KVMapper,
    source_cache: KVCache,
    token_ids: torch.Tensor,
    target_model,
    tail: int = 0,
    repair: Repair | None = None,
    source_model=None,
    exact_first_layer: bool = True,
) -> ForwardResult:
    """The whole hand-off of a prompt ``token_ids: [P]`` to the target, in one target forward.

    source_cache: the source's KV of (at least) the first ``handoff_split(P, tail)`` tokens.
    Maps them, then one forward of ``target_model`` computes the sink tokens (over the mapped
    cache, replacing their mapped rows), the ``repair`` anchors (picked as ``repair.choice``
    says, see ``pick_anchors``: "draft" and "source_prompt" need ``source_model``), the
    ``tail`` tokens and the last prompt token. The same result as ``translate_prefix``
    followed by a forward over the rest of the prompt, at the cost of one forward (and what
    the choice costs). ``exact_first_layer``: the target's own layer 0 for the translated
    tokens (``capture.first_layer_kv``). Returns the target's cache of all P tokens and the
    logits ``[1, vocab]`` of the last one.
    """
    split = handoff_split(token_ids.numel(), tail)
    if len(source_cache) < split:
        raise ValueError(
            f"source cache holds {len(source_cache)} tokens, the hand-off maps {split}"
        )
    if split == 0:
        return run(target_model, token_ids, logits_to_keep=1)
    mapped = mapped_prefix(
        mapper, source_cache.slice(0, split), token_ids[:split], target_model, exact_first_layer
    )
    anchors = None
    if repair is not None and repair.anchors:
        anchors = pick_anchors(
            repair, mapper, source_cache, token_ids, tail, source_model, target_model, mapped
        )
    positions = handoff_positions(token_ids.numel(), tail, mapper.sink_tokens, anchors)
    return forward_scattered(target_model, mapped, token_ids, positions, logits_to_keep=1)


def mapped_prefix(
    mapper: KVMapper,
    source_cache: KVCache,
    token_ids: torch.Tensor,
    target_model,
    exact_first_layer: bool = True,
) -> KVCache:
    """``mapper.map(source_cache)`` for the tokens ``token_ids: [t]``, its layer 0 replaced by
    the target's own (exact: layer 0 reads no context) if ``exact_first_layer``."""
    mapped = mapper.map(source_cache)
    if not exact_first_layer:
        return mapped
    keys, values = first_layer_kv(target_model, token_ids)
    dtype = mapped.keys[0].dtype
    mapped.keys[0], mapped.values[0] = keys.to(dtype), values.to(dtype)
    return mapped


def pick_anchors(
    repair: Repair,
    mapper: KVMapper,
    source_cache: KVCache,
    token_ids: torch.Tensor,
    tail: int,
    source_model=None,
    target_model=None,
    mapped: KVCache | None = None,
) -> torch.Tensor:
    """The ``repair.anchors`` translated tokens of a hand-off of ``token_ids: [P]``, picked as
    ``repair.choice`` says: [A] ascending indices in [sink_tokens, handoff_split(P, tail)).

    source_cache: the source's KV of (at least) the translated tokens. "draft" and
    "source_prompt" run ``source_model``; "target_tail" runs ``target_model`` over ``mapped``
    (the target's cache of the translated tokens, ``mapped_prefix``; made here if None);
    "recent" runs nothing. KVMapError if the model the choice runs is missing.
    """
    split, sinks = handoff_split(token_ids.numel(), tail), mapper.sink_tokens
    side = _CHOICE_RUNS[repair.choice]
    if side and {"source": source_model, "target": target_model}[side] is None:
        raise KVMapError(f"picking anchors by {repair.choice!r} needs the {side} model")
    if repair.choice == "draft":
        return draft_anchors(source_model, source_cache, token_ids, repair, tail, mapper)
    if repair.choice == "source_prompt":
        return source_prompt_anchors(
            source_model, source_cache, token_ids, repair.anchors, tail, sinks
        )
    if repair.choice == "recent":
        return recent_anchors(split, repair.anchors, sinks)
    if mapped is None:
        mapped = mapped_prefix(
            mapper, source_cache.slice(0, split), token_ids[:split], target_model
        )
    return target_tail_anchors(target_model, mapped, token_ids, repair.anchors, sinks)


def source_prompt_anchors(
    source_model,
    source_cache: KVCache,
    token_ids: torch.Tensor,
    count: int,
    tail: int,
    sink_tokens: int,
) -> torch.Tensor:
    """The ``count`` translated tokens (of the prompt ``token_ids: [P]``) that the source's
    queries of the last ``tail + 1`` prompt tokens (the ones the target recomputes) attend to
    most: [count] ascending indices in [sink_tokens, handoff_split(P, tail)).

    A source engine computes these queries in its own prefill, so it could score its pages
    as it writes them, at no extra forward; here the source re-reads those tokens over
    ``source_cache`` (its KV of at least the translated tokens) to get them.
    """
    split = handoff_split(token_ids.numel(), tail)
    paid = prompt_attention(source_model, source_cache, token_ids, tail + 1)
    return top_attended(paid[:split], count, sink_tokens)


def prompt_attention(model, cache: KVCache, token_ids: torch.Tensor, queries: int) -> torch.Tensor:
    """Attention ``model`` pays each prompt token (``token_ids: [P]``) from the queries of the
    last ``queries`` prompt tokens, summed over them, mean over layers and heads: [P].

    cache: the model's KV of the first c >= P - ``queries`` tokens (c >= 1); the model reads
    the prompt's last tokens over it (one forward of at most ``queries`` tokens' cost more)."""
    cached = min(len(cache), token_ids.numel() - queries)
    if cached < 1 or queries < 1:
        raise KVMapError(
            f"prompt attention needs 1 <= queries < prompt ({token_ids.numel()}), got {queries}"
        )
    step = run(model, token_ids[cached:], past=cache.slice(0, cached), want_queries=True)
    return attention_paid([q[-queries:] for q in step.queries], step.cache.keys)


def target_tail_anchors(
    target_model, mapped: KVCache, token_ids: torch.Tensor, count: int, sink_tokens: int
) -> torch.Tensor:
    """The ``count`` translated tokens that the TARGET's own queries of the rest of the prompt
    (the tail and the last token, ``token_ids[len(mapped):]``) attend to most over the
    translated cache: [count] ascending indices in [sink_tokens, len(mapped)).

    mapped: the target's cache of the translated tokens ``token_ids[:T]`` (L x [T, kv_t, d_t],
    ``mapped_prefix``). Uses the target only. Cost: a target forward over the sink tokens and
    one over the tail and the last token (both reading the translated cache) before the
    hand-off forward, which computes the tail again with the anchors recomputed: the tail's
    tokens are computed twice and the hand-off waits for two more (serial) target forwards.
    """
    split = len(mapped)
    sinks = torch.arange(min(sink_tokens, split))
    cache = recompute_tokens(target_model, mapped, token_ids[:split], sinks)
    step = run(target_model, token_ids[split:], past=cache, want_queries=True)
    paid = attention_paid(step.queries, step.cache.keys)
    return top_attended(paid[:split], count, sink_tokens)


def recent_anchors(translated: int, count: int, sink_tokens: int) -> torch.Tensor:
    """The ``count`` translated tokens just before the tail (of ``translated``, sinks never):
    [count] ascending indices in [sink_tokens, translated). The hand-off then equals one with
    a tail ``count`` tokens longer: the cheapest baseline, nothing runs to pick them."""
    return torch.arange(max(sink_tokens, translated - count), translated)


def draft_anchors(
    source_model,
    source_cache: KVCache,
    token_ids: torch.Tensor,
    repair: Repair,
    tail: int,
    mapper: KVMapper,
) -> torch.Tensor:
    """The ``repair.anchors`` translated tokens of a hand-off to recompute: [A] ascending
    indices in [sink_tokens, handoff_split(P, tail)) for the prompt ``token_ids: [P]``.

    source_cache: the source's KV of (at least) the translated tokens; the source reads the
    rest of the prompt over it, then drafts ``repair.draft - 1`` more tokens greedily.
    """
    prompt_len = token_ids.numel()
    split = handoff_split(prompt_len, tail)
    paid = draft_attention(source_model, source_cache, token_ids, repair.draft, repair.sweeps)
    return top_attended(paid[:split], repair.anchors, mapper.sink_tokens)


def draft_attention(
    source_model, source_cache: KVCache, token_ids: torch.Tensor, draft: int, sweeps: int = 0
) -> torch.Tensor:
    """Attention the source pays each of the first P - 1 prompt tokens (``token_ids: [P]``)
    while it drafts: the queries of the last prompt token and of ``draft - 1`` drafted tokens
    after it, summed over those queries, mean over layers and heads. Returns [P - 1].

    source_cache: the source's KV of the first c tokens of the prompt (c >= 1); the source
    reads tokens c .. P - 1 over it first. ``sweeps`` 0: the draft is decoded greedily, one
    forward per token; s >= 1: it is guessed (``lookup_guess``) and refined in s parallel
    forwards, and the queries are those of the last forward (``Repair.sweeps``).
    """
    prompt_len, cached = token_ids.numel(), min(len(source_cache), token_ids.numel() - 1)
    if cached < 1 or draft < 1 or sweeps < 0:
        raise KVMapError(
            f"a draft needs a cached prompt token, draft >= 1 and sweeps >= 0, "
            f"got draft {draft}, sweeps {sweeps}"
        )
    step = run(
        source_model,
        token_ids[cached:],
        past=source_cache.slice(0, cached),
        logits_to_keep=1,
        want_queries=True,
    )
    last = [q[-1:] for q in step.queries]
    if draft == 1:
        return attention_paid(last, step.cache.keys)[: prompt_len - 1]
    first = step.logits[-1].argmax()[None]
    draft_queries, cache = (
        _parallel_draft(source_model, step.cache, token_ids, first, draft - 1, sweeps)
        if sweeps
        else _serial_draft(source_model, step.cache, first, draft - 1)
    )
    queries = [torch.cat((q, d)) for q, d in zip(last, draft_queries)]
    return attention_paid(queries, cache.keys)[: prompt_len - 1]


def _serial_draft(source_model, cache: KVCache, first: torch.Tensor, count: int):
    """Greedy decoding of ``count`` tokens from ``first: [1]`` after ``cache``: the queries
    (L x [count, heads, d]) of the tokens fed, and the cache after them."""
    token, queries = first, []
    for _ in range(count):
        step = run(source_model, token, past=cache, logits_to_keep=1, want_queries=True)
        queries.append(step.queries)
        token, cache = step.logits[-1].argmax()[None], step.cache
    return [torch.cat(q) for q in zip(*queries)], cache


def _parallel_draft(
    source_model,
    cache: KVCache,
    token_ids: torch.Tensor,
    first: torch.Tensor,
    count: int,
    sweeps: int,
):
    """Jacobi decoding of ``count`` tokens from ``first: [1]`` after ``cache`` (the prompt
    ``token_ids`` read): the block [first, guess...] starts from ``lookup_guess`` and each of
    ``sweeps`` parallel forwards replaces the guess by the source's argmax at every position.
    Returns the last forward's queries (L x [count, heads, d]) and the cache after it."""
    guess = torch.cat((first, lookup_guess(torch.cat((token_ids, first)), count - 1)))
    for _ in range(sweeps):
        step = run(source_model, guess, past=cache, logits_to_keep=count, want_queries=True)
        guess = torch.cat((first, step.logits[:-1].argmax(-1)))
    return step.queries, step.cache


def lookup_guess(context: torch.Tensor, length: int, max_ngram: int = 3) -> torch.Tensor:
    """A guess at the ``length`` tokens after ``context: [T]`` by prompt lookup: find the latest
    earlier occurrence of the context's last n tokens (the longest n <= ``max_ngram`` that
    occurs) and copy what followed it, reading on into the copy itself where the context ends.
    Without any match, the last token repeated. Returns [length] token ids."""
    if context.ndim != 1 or context.numel() == 0:
        raise ValueError(f"context must be a non-empty 1-D tensor, got {tuple(context.shape)}")
    start = _latest_match_end(context, max_ngram)
    if start is None:
        return context[-1:].repeat(length)
    extended = context.tolist()
    for i in range(length):
        extended.append(extended[start + i])
    return torch.tensor(extended[context.numel() :], dtype=context.dtype, device=context.device)


def _latest_match_end(context: torch.Tensor, max_ngram: int) -> int | None:
    """Index just past the latest earlier occurrence of the context's longest matching suffix
    (at most ``max_ngram`` tokens), or None if even its last token never occurred before."""
    for n in range(min(max_ngram, context.numel() - 1), 0, -1):
        earlier = context.unfold(0, n, 1)[:-1]  # every n-gram but the suffix itself
        hits = (earlier == context[-n:]).all(dim=1).nonzero()
        if hits.numel():
            return int(hits[-1]) + n
    return None


def top_attended(attention: torch.Tensor, count: int, start: int = 0) -> torch.Tensor:
    """The ``count`` indices in [start, T) of most ``attention: [T]``, ascending."""
    count = max(0, min(count, attention.numel() - start))
    return (attention[start:].topk(count).indices + start).sort().values


def handoff_positions(
    prompt_len: int, tail: int, sink_tokens: int, anchors: torch.Tensor | None = None
) -> torch.Tensor:
    """Positions [N] the target computes in the hand-off forward: the sink tokens and the
    ``anchors`` (within the translated part) and every prompt token from
    ``handoff_split(prompt_len, tail)`` on."""
    split = handoff_split(prompt_len, tail)
    return torch.cat((_with_sinks(anchors, sink_tokens, split), torch.arange(split, prompt_len)))


def _with_sinks(anchors: torch.Tensor | None, sink_tokens: int, translated: int) -> torch.Tensor:
    """The sink positions and ``anchors`` (within ``translated`` tokens), sorted, distinct."""
    sinks = torch.arange(min(sink_tokens, translated))
    if anchors is None or anchors.numel() == 0:
        return sinks
    anchors = anchors.cpu()
    if anchors.min() < 0 or anchors.max() >= translated:
        raise ValueError(f"anchors must lie in [0, {translated}), got {anchors}")
    return torch.cat((sinks, anchors)).unique()


_CHOICE_RUNS = {
    "draft": "source",
    "source_prompt": "source",
    "target_tail": "target",
    "recent": None,
}
_CHOICE_NAMES = {
    "source_prompt": "the source's attention from its last prompt tokens",
    "target_tail": "the target's attention from its tail",
    "recent": "recency (a longer tail)",
}


def handoff_split(prompt_len: int, tail: int) -> int:
    """Number of prompt tokens whose cache is translated; the target computes the rest."""
    if prompt_len < 2:
        raise ValueError("a hand-off needs a prompt of at least 2 tokens")
    return max(0, prompt_len - 1 - tail)
