"""Mapper packs: one local folder (``KVMapper.save_pretrained`` / ``from_pretrained``).

    mapper.safetensors   k.{layer}.weight / k.{layer}.bias / v.{layer}.* (float32), for a
                         reduced-rank mapper k.projection / v.projection, and for one with a
                         non-linear residual k.residual.in.weight / .bias and
                         k.residual.{layer}.weight (v.* alike)
    kvmap.json           format version, both ModelSpecs + fingerprints, selection, ridge,
                         sink tokens, rank, calibration recipe, metrics, sha256 of the tensors
    README.md            model card generated from kvmap.json

Format version 2 is version 1 plus the optional projections (written only by reduced-rank
mappers, so every other pack stays readable by version-1 readers); version 3 adds the optional
non-linear residual (``residual_hidden`` in kvmap.json), written only by mappers that have one.

Saving writes a temporary sibling folder and renames it into place, so a crash never leaves a
half-written pack. Loading checks everything and raises PackError saying what is wrong.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save_file

from .._version import __version__
from .errors import KVMapError, PackError
from .files import replacing_folder, sha256_bytes, sha256_file
from .fit import KINDS, LayerMap
from .residual import Residual
from .spec import ModelSpec

TENSORS_FILE = "mapper.safetensors"
CONFIG_FILE = "kvmap.json"
CARD_FILE = "README.md"
FORMAT_NAME = "sgl-kvmap"
FORMAT_VERSION = 3  # the newest this library writes
READABLE_VERSIONS = (1, 2, 3)


def save_pack(mapper, folder: Path) -> Path:
    """Write ``mapper`` to ``folder`` (replaced whole if it exists). Returns the folder."""
    folder = Path(folder)
    with replacing_folder(folder) as staging:
        save_file(_tensors(mapper), staging / TENSORS_FILE, metadata={"format": FORMAT_NAME})
        config = _config(mapper, sha256_file(staging / TENSORS_FILE))
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (staging / CARD_FILE).write_text(model_card(config))
    return folder


def load_pack(folder: Path, mapper_class):
    """Read and validate a pack folder into a ``mapper_class`` (KVMapper, which calls this from
    ``from_pretrained``). Raises PackError for anything wrong or damaged."""
    folder = Path(folder)
    config = read_config(folder)
    tensors_path = folder / TENSORS_FILE
    if not tensors_path.is_file():
        raise PackError(f"{folder}: {TENSORS_FILE} is missing; re-download or re-build the pack")
    # Read once, check those bytes and build the tensors from them: nothing stays mapped to
    # the file, so it can change or vanish afterwards without touching the loaded mapper.
    data = tensors_path.read_bytes()
    if sha256_bytes(data) != config["tensors_sha256"]:
        raise PackError(
            f"{folder}: {TENSORS_FILE} does not match the checksum in {CONFIG_FILE} "
            "(damaged or edited); re-download or re-build the pack"
        )
    try:
        tensors = load(data)
        source, target = _spec(config, "source"), _spec(config, "target")
        selection = [list(map(int, s)) for s in config["selection"]]
        maps = {
            kind: [_layer_map(tensors, kind, layer) for layer in range(len(selection))]
            for kind in KINDS
        }
        projections = (
            {kind: _finite(tensors[f"{kind}.projection"], f"{kind} projection") for kind in KINDS}
            if config.get("rank") is not None
            else None
        )
        residuals = (
            {kind: _residual(tensors, kind, len(selection)) for kind in KINDS}
            if config.get("residual_hidden") is not None
            else None
        )
        mapper = mapper_class(
            source=source,
            target=target,
            selection=selection,
            maps=maps,
            ridge=float(config["ridge"]),
            sink_tokens=int(config["sink_tokens"]),
            info={k: config.get(k, {}) for k in ("calibration", "metrics")},
            projections=projections,
            residuals=residuals,
        )
    except (KeyError, TypeError, ValueError, SafetensorError) as err:
        raise PackError(f"{folder}: malformed pack ({type(err).__name__}: {err})") from err
    except KVMapError as err:
        raise PackError(f"{folder}: inconsistent pack: {err}") from err
    unread = sorted(set(tensors) - set(_tensors(mapper)))
    if unread:
        raise PackError(
            f"{folder}: {TENSORS_FILE} holds tensors its {CONFIG_FILE} does not describe "
            f"({', '.join(unread[:4])}{', ...' if len(unread) > 4 else ''}); re-build the pack"
        )
    return mapper


def read_config(folder: Path) -> dict[str, Any]:
    """The validated kvmap.json of a pack folder (format and version checked)."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise PackError(f"{folder} is not a mapper pack: {CONFIG_FILE} is missing")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise PackError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(config, dict) or config.get("format") != FORMAT_NAME:
        raise PackError(
            f"{path}: not an {FORMAT_NAME} pack (format field {config.get('format')!r})"
        )
    if config.get("format_version") not in READABLE_VERSIONS:
        raise PackError(
            f"{path}: pack format version {config.get('format_version')!r}; this sgl-kvmap reads "
            f"versions {', '.join(map(str, READABLE_VERSIONS))}. Upgrade sgl-kvmap or re-build "
            "the pack."
        )
    return config


def model_card(config: dict[str, Any]) -> str:
    """A model card (README.md) for a pack folder, from its kvmap.json."""
    src, tgt = config["source"], config["target"]
    metrics = config.get("metrics", {})
    rows = "\n".join(
        f"| {k} | {_fmt(v)} |"
        for k, v in sorted(metrics.items())
        if not isinstance(v, (list, dict))
    )
    calib = config.get("calibration", {})
    return f"""---
library_name: sgl-kvmap
tags: [kv-cache, sglang, cross-model-kv-transfer]
---
# KV mapper: {src["model_id"]} -> {tgt["model_id"]}

Closed-form per-head ridge mapper (RoPE-stripped, cross-layer source selection) that turns
the KV cache of `{src["model_id"]}` into a KV cache for `{tgt["model_id"]}`, so the target can
continue a conversation without re-running prefill. Made with sgl-kvmap.

| | source | target |
| --- | --- | --- |
| layers | {src["num_layers"]} | {tgt["num_layers"]} |
| KV heads | {src["num_kv_heads"]} | {tgt["num_kv_heads"]} |
| head_dim | {src["head_dim"]} | {tgt["head_dim"]} |
| fingerprint | `{config["source_fingerprint"][:16]}` | `{config["target_fingerprint"][:16]}` |

Source layers per target layer (k): {max(len(s) for s in config["selection"])}{_rank(config)};
ridge {config["ridge"]};
target-computed sink tokens: {config["sink_tokens"]}.
Calibration: {_fmt(calib.get("tokens", "?"))} tokens from {calib.get("text", "?")}.

## Measured

| metric | value |
| --- | --- |
{rows or "| (none recorded) | |"}

## Use

```python
from sgl_kvmap import KVMapper
mapper = KVMapper.from_pretrained("path/to/this/folder")
target_cache = mapper.map(source_cache)
```
"""


def _tensors(mapper) -> dict[str, torch.Tensor]:
    out = {}
    for kind in KINDS:
        for layer, m in enumerate(mapper.maps[kind]):
            out[f"{kind}.{layer}.weight"] = m.weight.float().contiguous()
            out[f"{kind}.{layer}.bias"] = m.bias.float().contiguous()
        if mapper.projections is not None:
            out[f"{kind}.projection"] = mapper.projections[kind].float().contiguous()
        if mapper.residuals is not None:
            residual = mapper.residuals[kind]
            out[f"{kind}.residual.in.weight"] = residual.weight_in.float().contiguous()
            out[f"{kind}.residual.in.bias"] = residual.bias_in.float().contiguous()
            for layer, weight in enumerate(residual.weights_out):
                out[f"{kind}.residual.{layer}.weight"] = weight.float().contiguous()
    return out


def _config(mapper, tensors_sha256: str) -> dict[str, Any]:
    return {
        "format": FORMAT_NAME,
        "format_version": _format_version(mapper),
        "library_version": __version__,
        "source": mapper.source.to_dict(),
        "target": mapper.target.to_dict(),
        "source_fingerprint": mapper.source.fingerprint,
        "target_fingerprint": mapper.target.fingerprint,
        "selection": mapper.selection,
        "ridge": mapper.ridge,
        "sink_tokens": mapper.sink_tokens,
        "rank": mapper.rank,
        "residual_hidden": mapper.residual_hidden,
        "calibration": mapper.info.get("calibration", {}),
        "metrics": mapper.info.get("metrics", {}),
        "tensors_sha256": tensors_sha256,
    }


def _format_version(mapper) -> int:
    """The oldest format that holds ``mapper``, so older readers keep reading what they can."""
    if mapper.residuals is not None:
        return FORMAT_VERSION
    return 1 if mapper.projections is None else 2


def _residual(tensors: dict[str, torch.Tensor], kind: str, target_layers: int) -> Residual:
    name = f"{kind} residual"
    return Residual(
        _finite(tensors[f"{kind}.residual.in.weight"], name),
        _finite(tensors[f"{kind}.residual.in.bias"], name),
        [
            _finite(tensors[f"{kind}.residual.{layer}.weight"], name)
            for layer in range(target_layers)
        ],
    )


def _spec(config: dict[str, Any], role: str) -> ModelSpec:
    spec = ModelSpec.from_dict(config[role])
    if spec.fingerprint != config[f"{role}_fingerprint"]:
        raise PackError(
            f"the {role} spec in {CONFIG_FILE} does not match its recorded fingerprint (edited?)"
        )
    return spec


def _layer_map(tensors: dict[str, torch.Tensor], kind: str, layer: int) -> LayerMap:
    name = f"{kind} map of layer {layer}"
    return LayerMap(
        _finite(tensors[f"{kind}.{layer}.weight"], name),
        _finite(tensors[f"{kind}.{layer}.bias"], name),
    )


def _finite(tensor: torch.Tensor, name: str) -> torch.Tensor:
    if tensor.dtype != torch.float32 or not tensor.isfinite().all():
        raise PackError(f"{name} is not finite float32")
    return tensor


def _rank(config: dict[str, Any]) -> str:
    rank, hidden = config.get("rank"), config.get("residual_hidden")
    if rank is None:
        return ""
    residual = "" if hidden is None else f" plus a non-linear residual of width {hidden}"
    return f", through one shared projection of rank {rank}{residual}"


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
