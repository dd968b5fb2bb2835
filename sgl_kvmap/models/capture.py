"""Run Hugging Face causal LMs and read their KV caches (the only module that runs models).

Caches go in and out as ``cache.KVCache`` (token-major, keys post-RoPE).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from dataclasses import dataclass

import torch

from ..core.cache import KVCache
from ..core.sources import model_folder
from ..core.spec import (
    ModelSpec,
    check_models,
    commit_of,
    spec_from_config,
    spec_from_pretrained,
)
from .placement import input_device

_CAPTURE_ATTENTION = "sgl_kvmap_capture"
_capture_state = threading.local()


@dataclass
class ForwardResult:
    """logits: [kept_tokens, vocab] float32; cache: the full cache after the call;
    queries: L x [tokens, heads, head_dim] post-RoPE (only when asked for)."""

    logits: torch.Tensor | None
    cache: KVCache
    queries: list[torch.Tensor] | None = None


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    spec: ModelSpec


def load_model(
    path: str,
    revision: str | None = None,
    dtype: torch.dtype = torch.float32,
    placement: dict | None = None,
) -> LoadedModel:
    """Load a causal LM + tokenizer (folder or Hub id, ``sources.model_folder``) for inference
    and describe it (its spec names it ``path``). ``placement``: ``from_pretrained``'s
    placement arguments (``placement.Placement.loader_arguments``: sharded or offloaded by
    accelerate); None: the whole model on the CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = model_folder(path, revision)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **(placement or {}))
    model.eval()
    spec = spec_from_config(model.config, tokenizer, str(path), commit_of(folder) or revision)
    return LoadedModel(model, tokenizer, spec)


def load_models_for(
    mapper, source: str | None = None, target: str | None = None
) -> tuple[LoadedModel, LoadedModel]:
    """Load the source and target of ``mapper`` (a KVMapper; default: the models its pack
    names), once their configs and tokenizers show they are the models it was fitted for:
    a wrong model is refused (PairMismatchError) before any weight is loaded."""
    source = source or mapper.source.model_id
    target = target or mapper.target.model_id
    check_models(mapper, spec_from_pretrained(source), spec_from_pretrained(target))
    return load_model(source), load_model(target)


def model_device(model: torch.nn.Module) -> torch.device:
    """Where ``model``'s input ids go: its first parameter's device, or, placed by accelerate,
    its input embeddings' execution device (``placement.input_device``)."""
    return input_device(model)


def loaded(model: str | LoadedModel) -> LoadedModel:
    """``model`` itself if it is loaded, else ``load_model(model)``."""
    return model if isinstance(model, LoadedModel) else load_model(str(model))


@torch.inference_mode()
def run(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    past: KVCache | None = None,
    logits_to_keep: int = 0,
    want_queries: bool = False,
) -> ForwardResult:
    """Prefill ``input_ids: [tokens]`` after ``past`` (positions continue from it).

    ``logits_to_keep``: logits of the last N tokens (0: none).
    """
    _check_ids(input_ids)
    keep = min(logits_to_keep, input_ids.numel())
    out, queries = _forward(model, input_ids, past, keep, want_queries)
    return ForwardResult(
        logits=out.logits[0, -keep:].float() if keep else None,
        cache=_from_hf(getattr(out, "cache", None) or out.past_key_values),
        queries=queries,
    )


def logits_over(model: torch.nn.Module, cache: KVCache, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits [tokens, vocab] (float32) of ``input_ids: [tokens]`` read after ``cache`` (positions
    continue from it), with autograd on: gradients flow back into the cache's tensors (freeze the
    model's own weights to leave them out). ``tune`` trains a mapper through this."""
    _check_ids(input_ids)
    with torch.enable_grad():
        out, _ = _forward(model, input_ids, cache, input_ids.numel(), want_queries=False)
    return out.logits[0].float()


def capture_kv(model: torch.nn.Module, input_ids: torch.Tensor) -> KVCache:
    """Post-RoPE K, V of every layer for ``input_ids: [tokens]`` at positions 0..tokens-1."""
    return run(model, input_ids).cache


def first_layer_kv(
    model: torch.nn.Module, input_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own layer-0 K (post-RoPE) and V for ``input_ids: [tokens]`` at positions
    0..tokens-1, each [tokens, kv_heads, head_dim].

    Layer 0's keys and values read no context (embedding, norm, projection, RoPE), so they are
    exact and cheap for any number of tokens: the forward stops where layer 0 hands them to its
    cache, before any attention or MLP runs, and the model's own code computes them.
    """
    _check_ids(input_ids)
    try:
        with torch.no_grad():
            model(
                input_ids=input_ids[None],
                position_ids=torch.arange(input_ids.numel(), device=input_ids.device)[None],
                use_cache=True,
                **{_cache_argument(model): _first_layer_catcher()},
            )
    except _FirstLayerKV as caught:
        keys, values = caught.args
        return keys[0].transpose(0, 1), values[0].transpose(0, 1)
    raise RuntimeError("the model never wrote layer 0's K/V to its cache")


def recompute_tokens(
    model: torch.nn.Module, cache: KVCache, token_ids: torch.Tensor, positions: torch.Tensor
) -> KVCache:
    """``cache`` with the K/V of the tokens at ``positions`` recomputed by ``model``.

    cache: L x [T, kv_heads, head_dim], the model's geometry, for ``token_ids[:T]``;
    positions: [N] distinct indices in [0, T). Each recomputed token attends to the cache's
    OTHER tokens before it and to the recomputed tokens up to itself, at every layer (selective
    recompute: a forward of N tokens, whatever T). Over an exact cache it returns that cache.
    Returns a new cache; ``cache`` is not modified.
    """
    if positions.numel() and positions.max() >= len(cache):
        raise ValueError(
            f"positions must be distinct indices in [0, {len(cache)}), got {positions}"
        )
    return forward_scattered(model, cache, token_ids, positions).cache


def forward_scattered(
    model: torch.nn.Module,
    cache: KVCache,
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    logits_to_keep: int = 0,
) -> ForwardResult:
    """One forward over the tokens at ``positions``: some recomputed inside ``cache``, the rest
    appended after it.

    cache: L x [T, kv_heads, head_dim] for ``token_ids[:T]``; positions: [N] distinct indices
    into ``token_ids``, those >= T forming the run T, T+1, ..., P-1 (P = max position + 1).
    Each token attends, at every layer, to the cache's tokens before it that are not in
    ``positions`` and to the tokens of this forward up to itself: the same result as
    recomputing them one at a time, in order, in one forward whose cost is N tokens. Rows of
    ``cache`` not in ``positions`` stay as they are.

    Returns the cache of P tokens and the logits of the last ``logits_to_keep`` positions.
    Used to recompute chosen tokens (``recompute_tokens``) and to fuse the target's sink
    tokens into the hand-off forward (``transfer.handoff``).
    """
    device = token_ids.device
    total, positions = len(cache), positions.to(device).sort().values
    count = positions.numel()
    if count == 0:
        return ForwardResult(None, cache)
    end = max(total, int(positions[-1]) + 1)
    appended = positions[positions >= total]
    if (
        positions[0] < 0
        or positions.unique().numel() != count
        or not torch.equal(appended, torch.arange(total, total + appended.numel(), device=device))
    ):
        raise ValueError(
            f"positions must be distinct indices in [0, {total}) plus the run {total}, "
            f"{total + 1}, ... after the cache, got {positions}"
        )
    if token_ids.numel() < end:
        raise ValueError(f"token_ids has {token_ids.numel()} tokens, positions reach {end}")
    inside = positions[positions < total]
    allowed = torch.zeros(count, total + count, dtype=torch.bool, device=device)
    allowed[:, :total] = torch.arange(total, device=device)[None] < positions[:, None]
    allowed[:, inside] = False  # their stale entries: the recomputed ones replace them
    allowed[:, total:] = torch.ones(count, count, dtype=torch.bool, device=device).tril()
    dtype = cache.keys[0].dtype
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)
    with torch.no_grad():
        out = model(
            input_ids=token_ids[positions][None],
            position_ids=positions[None],
            attention_mask=mask[None, None],
            use_cache=True,
            logits_to_keep=max(logits_to_keep, 1),
            **{_cache_argument(model): _to_hf(cache)},
        )
    fresh = _from_hf(getattr(out, "cache", None) or out.past_key_values)
    keys = [_scatter_rows(k, total, positions, end) for k in fresh.keys]
    values = [_scatter_rows(v, total, positions, end) for v in fresh.values]
    logits = out.logits[0, -logits_to_keep:].float() if logits_to_keep else None
    return ForwardResult(logits, KVCache(keys, values, torch.arange(end)))


def _check_ids(input_ids: torch.Tensor) -> None:
    if input_ids.ndim != 1 or input_ids.numel() == 0:
        raise ValueError(
            f"input_ids must be a non-empty 1-D tensor, got shape {tuple(input_ids.shape)}"
        )


class _FirstLayerKV(Exception):
    """Carries layer 0's K/V out of a forward stopped at its first cache write."""


def _first_layer_catcher():
    """A transformers cache that stops the forward at the first K/V written to it."""
    from transformers import DynamicCache

    class FirstLayerCatcher(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            raise _FirstLayerKV(key_states, value_states)

    return FirstLayerCatcher()


def _scatter_rows(
    rows: torch.Tensor, total: int, positions: torch.Tensor, end: int
) -> torch.Tensor:
    """[end, ...] from ``rows: [total + N, ...]`` (the cache, then the N tokens of a scattered
    forward): the cache's rows, with the new ones at ``positions``."""
    out = torch.empty((end, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    out[:total] = rows[:total]
    out[positions] = rows[total:]
    return out


def _forward(model, ids: torch.Tensor, past: KVCache | None, keep: int, want_queries: bool):
    start = len(past) if past is not None else 0
    positions = torch.arange(start, start + ids.numel(), device=ids.device)
    kwargs = dict(
        input_ids=ids[None],
        position_ids=positions[None],
        use_cache=True,
        logits_to_keep=max(keep, 1),
    )
    kwargs[_cache_argument(model)] = _to_hf(past) if past is not None else None
    if not want_queries:
        return model(**kwargs), None
    with _recording_queries(model) as recorded:
        out = model(**kwargs)
    return out, [recorded[i] for i in sorted(recorded)]


def _cache_argument(model) -> str:
    """transformers renamed ``past_key_values`` to ``cache``; use whichever this version takes."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _to_hf(cache: KVCache):
    """``cache`` as a transformers DynamicCache (batch of one)."""
    from transformers import DynamicCache

    pairs = [
        (k.transpose(0, 1)[None], v.transpose(0, 1)[None]) for k, v in zip(cache.keys, cache.values)
    ]
    return DynamicCache(ddp_cache_data=pairs)


def _from_hf(hf_cache) -> KVCache:
    keys = [layer.keys[0].transpose(0, 1) for layer in hf_cache.layers]
    values = [layer.values[0].transpose(0, 1) for layer in hf_cache.layers]
    return KVCache(keys, values, torch.arange(keys[0].shape[0]))


@contextlib.contextmanager
def _recording_queries(model):
    """Route attention through a wrapper of SDPA that records each layer's post-RoPE queries."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(_CAPTURE_ATTENTION, _recording_attention)
    AttentionMaskInterface.register(_CAPTURE_ATTENTION, sdpa_mask)
    previous = model.config._attn_implementation
    _capture_state.queries = {}
    model.set_attn_implementation(_CAPTURE_ATTENTION)
    try:
        yield _capture_state.queries
    finally:
        model.set_attn_implementation(previous)


def _recording_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    _capture_state.queries[module.layer_idx] = query[0].transpose(0, 1).clone()
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
