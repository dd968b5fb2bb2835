"""Conventional Hub names and tags of mapper packs (pure functions, no network).

A pack for ``Qwen/Qwen2.5-0.5B-Instruct -> Qwen/Qwen2.5-1.5B-Instruct`` is named
``kvmap-Qwen2.5-0.5B-Instruct-to-Qwen2.5-1.5B-Instruct``. Names follow the Hub's rules (at
most 96 characters, letters, digits, ``-``, ``_``, ``.``, never ``--`` or ``..``, no leading or
trailing ``-`` or ``.``); a pair whose name would break them gets a stable hashed name
``kvmap-{family}-{hash}`` built from both fingerprints, so every client finds the same repo.
"""

from __future__ import annotations

import hashlib
import re

LIBRARY_TAG = "sgl-kvmap"
TOPIC_TAG = "kv-cache"
MAX_NAME = 96
PREFIX = "kvmap-"
_HASH_CHARS = 16


def repo_name(
    source_id: str, target_id: str, source_fingerprint: str, target_fingerprint: str, family: str
) -> str:
    """The conventional repo name (without namespace) of the pack for one model pair."""
    readable = f"{PREFIX}{_model_name(source_id)}-to-{_model_name(target_id)}"
    if is_valid_name(readable):
        return readable
    digest = hashlib.sha256(f"{source_fingerprint}:{target_fingerprint}".encode()).hexdigest()
    return f"{PREFIX}{_clean(family)[:40] or 'pair'}-{digest[:_HASH_CHARS]}"


def pack_tags(family: str, source_fingerprint: str, target_fingerprint: str) -> list[str]:
    """The tags a published pack carries: the library, the topic, the model family, and the
    first characters of each fingerprint (for a server-side filter before the exact match)."""
    return [
        LIBRARY_TAG,
        TOPIC_TAG,
        family,
        f"kvmap-source-{source_fingerprint[:12]}",
        f"kvmap-target-{target_fingerprint[:12]}",
    ]


def is_valid_name(name: str) -> bool:
    """Whether ``name`` is a valid Hub repo name (the part after ``namespace/``)."""
    return (
        0 < len(name) <= MAX_NAME
        and re.fullmatch(r"[A-Za-z0-9._-]+", name) is not None
        and "--" not in name
        and ".." not in name
        and name[0] not in "-."
        and name[-1] not in "-."
        and not name.endswith(".git")
    )


def _model_name(model_id: str) -> str:
    """The last path component of a model id or local path, in the Hub's alphabet."""
    return _clean(model_id.rstrip("/").rsplit("/", 1)[-1])


def _clean(text: str) -> str:
    text = re.sub(r"[^A-Za-z0-9._-]+", "-", text)
    text = re.sub(r"-{2,}", "-", re.sub(r"\.{2,}", ".", text))
    return text.strip("-.")
