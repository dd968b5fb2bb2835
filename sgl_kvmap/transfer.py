"""Hand a prefix from the source model to the target: map its cache, patch the sinks.

The hand-off convention used everywhere in sgl-kvmap: for a prompt of P tokens, the target
gets a translated cache for tokens [0, P - 1 - tail) and computes the remaining ``tail + 1``
tokens itself (the last prompt token always, since its logits start the answer). Attention
sinks map badly, so the target computes its own KV for the first ``mapper.sink_tokens``
tokens: a forward over a handful of tokens, exact because attention is causal.
"""

from __future__ import annotations

import torch

from .capture import KVCache, capture_kv
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


def handoff_split(prompt_len: int, tail: int) -> int:
    """Number of prompt tokens whose cache is translated; the target computes the rest."""
    if prompt_len < 2:
        raise ValueError("a hand-off needs a prompt of at least 2 tokens")
    return max(0, prompt_len - 1 - tail)
