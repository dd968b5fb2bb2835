"""Hand a prefix from the source model to the target: map its cache, patch the sinks.

The hand-off convention used everywhere in sgl-kvmap: for a prompt of P tokens, the target
gets a translated cache for tokens [0, P - 1 - tail) and computes the remaining ``tail + 1``
tokens itself (the last prompt token always, since its logits start the answer). Attention
sinks map badly, so the target computes its own KV for the first ``mapper.sink_tokens``
tokens: a forward over a handful of tokens, exact because attention is causal. ``handoff`` does
the whole hand-off with ONE target forward: the sink tokens ride in the forward over the tail
and the last prompt token (a scattered forward), so the target's weights are read once.
"""

from __future__ import annotations

import torch

from .capture import ForwardResult, KVCache, capture_kv, forward_scattered, run
from .mapper import KVMapper


def translate_prefix(
    mapper: KVMapper, source_cache: KVCache, token_ids: torch.Tensor, target_model
) -> KVCache:
    """Target cache for ``token_ids: [t]`` from the source's cache of the same tokens (t layers x
    [t, kv_s, d_s]), with the first ``mapper.sink_tokens`` tokens computed by ``target_model``."""
    if len(source_cache) != token_ids.numel():
        raise ValueError(
            f"source cache holds {len(source_cache)} tokens, token_ids {token_ids.numel()}"
        )
    mapped = mapper.map(source_cache)
    sinks = min(mapper.sink_tokens, token_ids.numel())
    if sinks == 0:
        return mapped
    return mapped.replace_front(capture_kv(target_model, token_ids[:sinks]))


def handoff(
    mapper: KVMapper,
    source_cache: KVCache,
    token_ids: torch.Tensor,
    target_model,
    tail: int = 0,
) -> ForwardResult:
    """The whole hand-off of a prompt ``token_ids: [P]`` to the target, in one target forward.

    source_cache: the source's KV of (at least) the first ``handoff_split(P, tail)`` tokens.
    Maps them, then one forward of ``target_model`` computes the sink tokens (over the mapped
    cache, replacing their mapped rows), the ``tail`` tokens and the last prompt token. The
    same result as ``translate_prefix`` followed by a forward over the rest of the prompt, at
    the cost of one forward. Returns the target's cache of all P tokens and the logits
    ``[1, vocab]`` of the last one.
    """
    split = handoff_split(token_ids.numel(), tail)
    if len(source_cache) < split:
        raise ValueError(
            f"source cache holds {len(source_cache)} tokens, the hand-off maps {split}"
        )
    if split == 0:
        return run(target_model, token_ids, logits_to_keep=1)
    mapped = mapper.map(source_cache.slice(0, split))
    positions = handoff_positions(token_ids.numel(), tail, mapper.sink_tokens)
    return forward_scattered(target_model, mapped, token_ids, positions, logits_to_keep=1)


def handoff_positions(prompt_len: int, tail: int, sink_tokens: int) -> torch.Tensor:
    """Positions [N] the target computes in the hand-off forward: the sink tokens (within the
    translated part) and every prompt token from ``handoff_split(prompt_len, tail)`` on."""
    split = handoff_split(prompt_len, tail)
    return torch.cat((torch.arange(min(sink_tokens, split)), torch.arange(split, prompt_len)))


def handoff_split(prompt_len: int, tail: int) -> int:
    """Number of prompt tokens whose cache is translated; the target computes the rest."""
    if prompt_len < 2:
        raise ValueError("a hand-off needs a prompt of at least 2 tokens")
    return max(0, prompt_len - 1 - tail)
