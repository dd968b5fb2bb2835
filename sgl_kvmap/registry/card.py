"""The model card (README.md) of a mapper pack, rendered with huggingface_hub's ModelCard.

The card's metadata is what a Hub user filters on: ``library_name: sgl-kvmap``, tags (library,
topic, model family, fingerprint prefixes), ``base_model`` = the target with
``base_model_relation: adapter``, and a ``kvmap`` block naming the source and both
fingerprints. Its body repeats the pair, the recipe and the recorded measurements.
"""

from __future__ import annotations

from typing import Any

from huggingface_hub import ModelCard, ModelCardData

from ..core.pack import is_repo_id
from .naming import LIBRARY_TAG, pack_tags

CARD_KEY = "kvmap"  # the card metadata block this library writes and reads


def card_data(config: dict[str, Any]) -> ModelCardData:
    """The card metadata of a pack whose kvmap.json is ``config``."""
    source, target = config["source"], config["target"]
    return ModelCardData(
        library_name=LIBRARY_TAG,
        tags=pack_tags(
            target["model_type"], config["source_fingerprint"], config["target_fingerprint"]
        ),
        # the Hub accepts only a repo id here; a pack fitted from local folders names none
        base_model=target["model_id"] if is_repo_id(target["model_id"]) else None,
        base_model_relation="adapter" if is_repo_id(target["model_id"]) else None,
        **{
            CARD_KEY: {
                "format_version": config["format_version"],
                "source": source["model_id"],
                "source_revision": source["revision"],
                "source_fingerprint": config["source_fingerprint"],
                "target": target["model_id"],
                "target_revision": target["revision"],
                "target_fingerprint": config["target_fingerprint"],
            }
        },
    )


def render_card(config: dict[str, Any]) -> str:
    """README.md of a pack whose kvmap.json is ``config``: YAML metadata, then the body."""
    return str(ModelCard(f"---\n{card_data(config).to_yaml()}\n---\n{_body(config)}"))


def pairs_in_card(card_text: str) -> dict[str, Any]:
    """The ``kvmap`` metadata block of a card ({} when absent)."""
    return ModelCard(card_text).data.to_dict().get(CARD_KEY) or {}


def _body(config: dict[str, Any]) -> str:
    src, tgt = config["source"], config["target"]
    metrics = config.get("metrics", {})
    rows = "\n".join(
        f"| {key} | {_fmt(value)} |"
        for key, value in sorted(metrics.items())
        if not isinstance(value, (list, dict)) and key != "command"
    )
    calib = config.get("calibration", {})
    return f"""
# KV mapper: {src["model_id"]} -> {tgt["model_id"]}

Closed-form per-head ridge mapper (RoPE-stripped, cross-layer source selection) that turns
the KV cache of `{src["model_id"]}` into a KV cache for `{tgt["model_id"]}`, so the target can
continue a conversation without re-running prefill. Made with sgl-kvmap.

| | source | target |
| --- | --- | --- |
| model | `{src["model_id"]}` | `{tgt["model_id"]}` |
| revision | {src["revision"] or "(not recorded)"} | {tgt["revision"] or "(not recorded)"} |
| layers | {src["num_layers"]} | {tgt["num_layers"]} |
| KV heads | {src["num_kv_heads"]} | {tgt["num_kv_heads"]} |
| head_dim | {src["head_dim"]} | {tgt["head_dim"]} |
| fingerprint | `{config["source_fingerprint"]}` | `{config["target_fingerprint"]}` |

Source layers per target layer: {max(len(s) for s in config["selection"])}{_rank(config)};
ridge {config["ridge"]};
target-computed sink tokens: {config["sink_tokens"]}.
Calibration: {_fmt(calib.get("tokens", "?"))} tokens from {calib.get("text", "?")}.

## Measured

| metric | value |
| --- | --- |
{rows or "| (none recorded) | |"}

Measured with: `{metrics.get("command", "(not recorded)")}`

## Use

```python
from sgl_kvmap import KVMapper
mapper = KVMapper.from_pretrained("this/repo", revision="<commit>")
target_cache = mapper.map(source_cache)
```

or serve it: `sgl-kvmap sglang-args --pack this/repo ...`.
"""


def _rank(config: dict[str, Any]) -> str:
    rank, hidden = config.get("rank"), config.get("residual_hidden")
    if rank is None:
        return ""
    residual = "" if hidden is None else f" plus a non-linear residual of width {hidden}"
    return f", through one shared projection of rank {rank}{residual}"


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
