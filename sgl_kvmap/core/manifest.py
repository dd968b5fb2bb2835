"""kvmap.json, a pack's manifest: parsing, its one schema (types and ranges) and its digest.

The digest covers the fields that decide what the mapper computes (format version, both
specs and fingerprints, selection, ridge, sink tokens, rank, residual width). The pack stores
it in the tensors file's metadata, which the manifest's ``tensors_sha256`` covers in turn, so
editing either file alone is refused. Calibration notes and metrics are information only and
are not covered, so they can be brought up to date without re-saving the tensors.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from jsonschema import Draft202012Validator, validators

from .errors import PackError
from .spec import ROPE_STYLES
from .strict_json import loads_finite

FORMAT_NAME = "sgl-kvmap"
FORMAT_VERSION = 3  # the newest this library writes
READABLE_VERSIONS = (1, 2, 3)
DIGEST_KEY = "kvmap_manifest_sha256"  # the name of the digest in the tensors file's metadata
SEMANTIC_FIELDS = (
    "format_version",
    "source",
    "target",
    "source_fingerprint",
    "target_fingerprint",
    "selection",
    "ridge",
    "sink_tokens",
    "rank",
    "residual_hidden",
)
MAX_COUNT = 1 << 20  # bound on layers, heads, widths, ranks and sink tokens

_SHA256 = {"type": "string", "pattern": "^[0-9a-f]{64}$"}
_COUNT = {"type": "integer", "minimum": 1, "maximum": MAX_COUNT}
_SPEC = {
    "type": "object",
    "required": [
        "model_id",
        "revision",
        "model_type",
        "num_layers",
        "num_attention_heads",
        "num_kv_heads",
        "head_dim",
        "rotary_dim",
        "rope_style",
        "qk_norm",
        "tokenizer_fingerprint",
        "config",
    ],
    "additionalProperties": False,
    "properties": {
        "model_id": {"type": "string", "minLength": 1},
        "revision": {"type": ["string", "null"]},
        "model_type": {"type": "string", "minLength": 1},
        "num_layers": _COUNT,
        "num_attention_heads": _COUNT,
        "num_kv_heads": _COUNT,
        "head_dim": _COUNT,
        "rotary_dim": _COUNT,
        "rope_style": {"enum": list(ROPE_STYLES)},
        "qk_norm": {"type": "boolean"},
        "tokenizer_fingerprint": _SHA256,
        "config": {"type": "object"},
    },
}
SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "sgl-kvmap pack manifest (kvmap.json)",
    "type": "object",
    "required": [
        "format",
        "format_version",
        "library_version",
        "source",
        "target",
        "source_fingerprint",
        "target_fingerprint",
        "selection",
        "ridge",
        "sink_tokens",
        "tensors_sha256",
    ],
    "additionalProperties": False,
    "properties": {
        "format": {"const": FORMAT_NAME},
        "format_version": {"type": "integer", "enum": list(READABLE_VERSIONS)},
        "library_version": {"type": "string"},
        "source": _SPEC,
        "target": _SPEC,
        "source_fingerprint": _SHA256,
        "target_fingerprint": _SHA256,
        "selection": {
            "type": "array",
            "minItems": 1,
            "maxItems": MAX_COUNT,
            "items": {
                "type": "array",
                "minItems": 1,
                "uniqueItems": True,
                "items": {"type": "integer", "minimum": 0, "maximum": MAX_COUNT},
            },
        },
        "ridge": {"type": "number", "minimum": 0},
        "sink_tokens": {"type": "integer", "minimum": 0, "maximum": MAX_COUNT},
        "rank": {"anyOf": [{"type": "null"}, _COUNT]},
        "residual_hidden": {"anyOf": [{"type": "null"}, _COUNT]},
        "calibration": {"type": "object"},
        "metrics": {"type": "object"},
        "tensors_sha256": _SHA256,
    },
}


def _strict_integer(checker, value) -> bool:
    """JSON integers only: not booleans, not floats that happen to be whole (1.0)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _strict_number(checker, value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_Validator = validators.extend(
    Draft202012Validator,
    type_checker=Draft202012Validator.TYPE_CHECKER.redefine_many(
        {"integer": _strict_integer, "number": _strict_number}
    ),
)
_VALIDATOR = _Validator(SCHEMA)


def parse_manifest(data: bytes, where: str) -> dict[str, Any]:
    """kvmap.json's bytes -> the validated manifest. Raises PackError naming ``where``."""
    try:
        manifest = loads_finite(data)
    except ValueError as err:  # UnicodeDecodeError is one
        raise PackError(f"{where}: not valid JSON ({err})") from err
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise PackError(f"{where}: not an {FORMAT_NAME} pack (format field {found!r})")
    version = manifest.get("format_version")
    if not _strict_integer(None, version) or version not in READABLE_VERSIONS:
        raise PackError(
            f"{where}: pack format version {version!r}; this sgl-kvmap reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}. Upgrade sgl-kvmap or re-build the pack."
        )
    error = next(iter(sorted(_VALIDATOR.iter_errors(manifest), key=_error_order)), None)
    if error is not None:
        field = ".".join(map(str, error.absolute_path)) or "(top level)"
        raise PackError(f"{where}: {field}: {error.message}")
    return manifest


def manifest_digest(manifest: dict[str, Any]) -> str:
    """sha256 of the manifest's semantic fields (canonical JSON; absent fields count as null)."""
    semantic = {name: manifest.get(name) for name in SEMANTIC_FIELDS}
    text = json.dumps(semantic, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def _error_order(error) -> tuple:
    """Report the shallowest error first (a missing field before a detail deep inside)."""
    return (len(error.absolute_path), list(map(str, error.absolute_path)), error.message)
