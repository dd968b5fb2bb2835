"""ModelSpec: the KV geometry and RoPE of one model, and its fingerprint.

This is the only module that reads Hugging Face configs. A spec is built from a config (and a
tokenizer) without loading weights: the model is instantiated on the ``meta`` device to see
its modules (QK-norm, rotary module), which costs no memory.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .errors import KVMapError, PairMismatchError
from .rope import RotaryTables, rotary_module, rotary_tables
from .sources import model_folder

ROPE_STYLES = ("half", "interleaved")
# Models whose apply_rotary_pos_emb pairs dimensions (2i, 2i+1) instead of (i, i + r/2).
INTERLEAVED_ROPE_MODEL_TYPES = frozenset({"cohere", "cohere2", "glm", "glm4", "glm4_moe"})


@dataclass(frozen=True)
class ModelSpec:
    """Geometry and positional encoding of one causal LM, as far as its KV cache is concerned.

    ``rope_style`` is "half" (Llama/Qwen: dim i pairs with i + rotary_dim/2) or "interleaved"
    (GPT-J/GLM/Cohere: dim 2i pairs with 2i+1). Dims at or past ``rotary_dim`` carry no RoPE.
    ``config`` is the model's full HF config as a dict, kept to rebuild its rotary module.
    """

    model_id: str
    revision: str | None
    model_type: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_style: str
    qk_norm: bool
    tokenizer_fingerprint: str
    config: dict[str, Any] = field(repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.rope_style not in ROPE_STYLES:
            raise KVMapError(f"rope_style must be one of {ROPE_STYLES}, got {self.rope_style!r}")
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise KVMapError(f"rotary_dim {self.rotary_dim} invalid for head_dim {self.head_dim}")

    @property
    def kv_width(self) -> int:
        """Features per token per layer for K (or V): num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    @functools.cached_property
    def fingerprint(self) -> str:
        """sha256 of what shapes the KV cache: geometry, RoPE, config, tokenizer (not the id)."""
        payload = {k: v for k, v in self.to_dict().items() if k not in ("model_id", "revision")}
        payload["config"] = _cache_relevant_config(self.config)
        return _sha256_json(payload)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})

    def hf_config(self):
        """Rebuild the transformers config object this spec was made from."""
        from transformers import AutoConfig

        data = dict(self.config)
        return AutoConfig.for_model(data.pop("model_type"), **data)


def spec_from_pretrained(path: str, revision: str | None = None) -> ModelSpec:
    """Build the spec of the model at ``path`` (folder or Hub id, ``sources.model_folder``)
    from its config and tokenizer: no weight is loaded (or, for a Hub id, downloaded)."""
    from transformers import AutoConfig, AutoTokenizer

    folder = model_folder(path, revision, weights=False)
    config = AutoConfig.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return spec_from_config(config, tokenizer, str(path), commit_of(folder) or revision)


def commit_of(folder: str | Path) -> str | None:
    """The commit of a model folder that is a snapshot in the Hugging Face cache (None for any
    other folder), so a pack pins the exact model it was fitted for."""
    from transformers.utils import extract_commit_hash

    return extract_commit_hash(str(Path(folder) / "config.json"), None)


def spec_from_config(config, tokenizer, model_id: str, revision: str | None = None) -> ModelSpec:
    """Build a spec from a transformers config and tokenizer (weights are never touched).

    The spec's revision is ``revision`` or, for a model read from the Hugging Face cache, the
    commit transformers resolved it to, so a pack pins the exact model it was fitted for."""
    revision = revision or getattr(config, "_commit_hash", None)
    text_config = config.get_text_config(decoder=True)
    _check_full_attention(text_config, model_id)
    heads = text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    inv_freq = rotary_module(text_config).inv_freq
    return ModelSpec(
        model_id=model_id,
        revision=revision,
        model_type=text_config.model_type,
        num_layers=text_config.num_hidden_layers,
        num_attention_heads=heads,
        num_kv_heads=getattr(text_config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        rotary_dim=2 * inv_freq.numel(),
        rope_style="interleaved"
        if text_config.model_type in INTERLEAVED_ROPE_MODEL_TYPES
        else "half",
        qk_norm=_has_qk_norm(text_config),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        config=text_config.to_dict(),
    )


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the token -> id table, special tokens included."""
    return _sha256_json(sorted(tokenizer.get_vocab().items()))


def check_pair(source: ModelSpec, target: ModelSpec) -> None:
    """Refuse a pair whose tokenizers differ: token i of one cache must be token i of the other."""
    if source.tokenizer_fingerprint != target.tokenizer_fingerprint:
        raise PairMismatchError(
            f"{source.model_id} and {target.model_id} have different tokenizers "
            f"({source.tokenizer_fingerprint[:12]} vs {target.tokenizer_fingerprint[:12]}); "
            "KV caches can only be mapped between models that share one tokenizer."
        )


def check_models(mapper, source: ModelSpec, target: ModelSpec) -> None:
    """Refuse to use ``mapper`` (a KVMapper: its ``source`` and ``target`` specs) with models
    other than the ones it was fitted for: another configuration or tokenizer (fingerprint), or,
    where both commits are known (models from the Hub), another commit."""
    for role, fitted, given in (
        ("source", mapper.source, source),
        ("target", mapper.target, target),
    ):
        if fitted.fingerprint != given.fingerprint:
            diff = _spec_difference(fitted, given)
            raise PairMismatchError(
                f"this pack's {role} is {fitted.model_id} but {given.model_id} was given ({diff}); "
                "fit a pack for this pair with `sgl-kvmap fit`."
            )
        if fitted.revision and given.revision and fitted.revision != given.revision:
            raise PairMismatchError(
                f"this pack's {role} is {fitted.model_id} at commit {fitted.revision} but "
                f"{given.model_id} at commit {given.revision} was given (same configuration, "
                "other weights); fit a pack for this pair with `sgl-kvmap fit`."
            )


_MODULES: dict[str, torch.nn.Module] = {}  # spec fingerprint -> its rotary module
_MODULES_LOCK = threading.Lock()  # translation workers build them from several threads


def tables_for_spec(spec: ModelSpec, positions: torch.Tensor) -> RotaryTables:
    """Rotary tables of the model described by a ModelSpec at ``positions: [tokens]``."""
    with _MODULES_LOCK:  # transformers' lazy imports are not safe to race either
        if spec.fingerprint not in _MODULES:
            _MODULES[spec.fingerprint] = rotary_module(spec.hf_config())
        module = _MODULES[spec.fingerprint]
    cos, sin = rotary_tables(module, positions.to("cpu"))
    return RotaryTables(cos.to(positions.device), sin.to(positions.device))


def _check_full_attention(config, model_id: str) -> None:
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    sliding = getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", 0)
    if layer_types != {"full_attention"} or sliding:
        raise KVMapError(
            f"{model_id}: only dense full-attention models are supported "
            f"(layer types {sorted(layer_types)}, sliding window {sliding or 'off'})."
        )


def _has_qk_norm(config) -> bool:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return any(name.endswith(("k_norm", "k_layernorm")) for name, _ in model.named_modules())


_CACHE_IRRELEVANT_KEYS = {"transformers_version", "_name_or_path", "_model_name_or_path", "dtype"}


def _cache_relevant_config(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in sorted(config.items()) if k not in _CACHE_IRRELEVANT_KEYS}


def _sha256_json(obj: Any) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _spec_difference(a: ModelSpec, b: ModelSpec) -> str:
    da, db = a.to_dict(), b.to_dict()
    fields = [k for k in da if k not in ("model_id", "revision", "config") and da[k] != db[k]]
    if fields:
        return ", ".join(f"{k}: {da[k]!r} vs {db[k]!r}" for k in fields)
    return "their configs differ"
