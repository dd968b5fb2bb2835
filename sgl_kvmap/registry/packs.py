"""Mapper packs on the Hugging Face Hub: fetch at one commit, publish in one commit, list.

Everything here goes through huggingface_hub (downloads, cache layout, retries, locks, auth).
A pack is always fetched by commit: the revision asked for (branch, tag or commit) is resolved
once, its kvmap.json is read and checked first (format version, schema), and only then are
the tensors downloaded at that same commit. The caller verifies the whole pack (``load_pack``)
before anything uses it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub import HfApi, scan_cache_dir, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from ..core.errors import PackError
from ..core.manifest import parse_manifest
from ..core.mapper import KVMapper
from ..core.pack import CARD_FILE, CONFIG_FILE, PACK_FILES, load_pack, read_config
from ..fitting.config import recipe_summary
from .card import render_card
from .hub import first_line

log = logging.getLogger(__name__)

LIBRARY_NAME = "sgl-kvmap"


def _transport_errors() -> tuple[type[Exception], ...]:
    """The HTTP client's own connection errors (httpx under huggingface_hub 1.x; requests'
    are OSErrors already)."""
    try:
        import httpx
    except ImportError:
        return ()
    return (httpx.TransportError,)


NETWORK_ERRORS = (OSError, HfHubHTTPError, OfflineModeIsEnabled, *_transport_errors())


@dataclass(frozen=True)
class PackEntry:
    """One pack found in a cache or on the Hub."""

    repo_id: str
    commit: str | None
    source: str
    target: str
    source_fingerprint: str
    target_fingerprint: str
    where: str  # a local folder, or "hub"
    recipe: str | None = None  # how it was made, in words (local packs; None from the Hub)


def endpoint() -> str | None:
    """The Hub endpoint (``HF_ENDPOINT``, read at call time; None: huggingface_hub's default)."""
    return os.environ.get("HF_ENDPOINT") or None


def fetch_pack(
    repo_id: str,
    *,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    local_files_only: bool = False,
    token: str | bool | None = None,
) -> Path:
    """The local snapshot folder of pack ``repo_id`` at ``revision`` (default: main), in the
    Hugging Face cache. Raises PackError with one line saying what to do when it cannot."""
    common = {
        "repo_id": repo_id,
        "cache_dir": cache_dir,
        "local_files_only": local_files_only,
        "token": token,
        "endpoint": endpoint(),
        "library_name": LIBRARY_NAME,
    }
    try:
        head = Path(
            snapshot_download(revision=revision or "main", allow_patterns=[CONFIG_FILE], **common)
        )
        commit = head.name  # a snapshot folder is named after its commit
        parse_manifest((head / CONFIG_FILE).read_bytes(), f"{repo_id}@{commit}/{CONFIG_FILE}")
        folder = snapshot_download(revision=commit, allow_patterns=sorted(PACK_FILES), **common)
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as err:
        raise PackError(
            f"{repo_id}{_at(revision)} is not in the local Hugging Face cache and the Hub "
            f"cannot be reached (offline). Get it with `sgl-kvmap pull {repo_id}` while "
            "online, or build the pair's pack with `sgl-kvmap resolve SOURCE TARGET --build`."
        ) from err
    except (RepositoryNotFoundError, RevisionNotFoundError) as err:
        raise PackError(
            f"{repo_id}{_at(revision)}: no such pack on the Hub ({first_line(err)})"
        ) from err
    except FileNotFoundError as err:
        raise PackError(
            f"{repo_id}{_at(revision)} has no {CONFIG_FILE}: not a mapper pack"
        ) from err
    except EntryNotFoundError as err:
        raise PackError(f"{repo_id}{_at(revision)}: {first_line(err)}") from err
    except NETWORK_ERRORS as err:
        raise PackError(
            f"{repo_id}{_at(revision)}: the Hub could not be reached ({first_line(err)}); set "
            "HF_HUB_OFFLINE=1 to use cached packs only"
        ) from err
    return Path(folder)


def push_pack(
    folder: Path,
    repo_id: str,
    *,
    revision: str | None = None,
    private: bool = False,
    tag: str | None = None,
    token: str | bool | None = None,
    commit_message: str | None = None,
) -> str:
    """Publish the pack ``folder`` to ``repo_id`` as one commit on branch ``revision`` (created
    if missing), optionally tagged ``tag``. The pack is verified first. Returns the commit id."""
    mapper = load_pack(folder, KVMapper)  # the whole pack is verified before it is published
    api = HfApi(endpoint=endpoint(), token=token, library_name=LIBRARY_NAME)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision is not None:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        commit = api.upload_folder(
            repo_id=repo_id,
            folder_path=folder,
            revision=revision,
            allow_patterns=sorted(PACK_FILES),
            commit_message=commit_message
            or f"sgl-kvmap pack {mapper.source.model_id} -> {mapper.target.model_id}",
        )
        if tag is not None:
            api.create_tag(repo_id, tag=tag, revision=commit.oid)
    except NETWORK_ERRORS as err:
        raise PackError(f"could not publish {folder} to {repo_id}: {first_line(err)}") from err
    return commit.oid


def cached_packs(cache_dir: str | Path | None = None) -> list[PackEntry]:
    """The packs in the Hugging Face cache (each cached commit that holds a kvmap.json)."""
    try:
        info = scan_cache_dir(cache_dir)
    except Exception as err:  # huggingface_hub raises CacheNotFound for a missing cache
        log.debug("no Hugging Face cache: %s", err)
        return []
    entries = []
    for repo in info.repos:
        if repo.repo_type != "model":
            continue
        for cached in repo.revisions:
            if (cached.snapshot_path / CONFIG_FILE).is_file():
                entry = entry_of(repo.repo_id, cached.commit_hash, cached.snapshot_path)
                entries += [entry] if entry else []
    return entries


def hub_packs(*tags: str, token: str | bool | None = None) -> list[PackEntry]:
    """Packs on the Hub carrying the library tag and ``tags``, described by their cards."""
    api = HfApi(endpoint=endpoint(), token=token, library_name=LIBRARY_NAME)
    try:
        found = list(api.list_models(filter=[LIBRARY_NAME, *tags], cardData=True))
    except NETWORK_ERRORS as err:
        raise PackError(f"could not list packs on the Hub: {first_line(err)}") from err
    entries = []
    for model in found:
        block = (model.card_data.to_dict() if model.card_data else {}).get("kvmap") or {}
        if {"source", "target", "source_fingerprint", "target_fingerprint"} <= set(block):
            entries.append(
                PackEntry(
                    model.id,
                    model.sha,
                    block["source"],
                    block["target"],
                    block["source_fingerprint"],
                    block["target_fingerprint"],
                    "hub",
                )
            )
    return entries


class HubRegistry:
    """The ``PackRegistry`` that ``sgl_kvmap.core.pack`` uses: huggingface_hub underneath."""

    def render_card(self, config: dict[str, Any]) -> str:
        return render_card(config)

    def fetch(self, repo_id: str, **options: Any) -> Path:
        return fetch_pack(repo_id, **options)

    def push(self, folder: Path, repo_id: str, **options: Any) -> str:
        return push_pack(folder, repo_id, **options)


def entry_of(repo_id: str, commit: str | None, folder: Path) -> PackEntry | None:
    """The PackEntry of the pack at ``folder`` (None, logged, when it is not a valid pack)."""
    try:
        config = read_config(folder)
    except PackError as err:
        log.warning("skipping %s: %s", folder, err)
        return None
    return PackEntry(
        repo_id,
        commit,
        config["source"]["model_id"],
        config["target"]["model_id"],
        config["source_fingerprint"],
        config["target_fingerprint"],
        str(folder),
        recipe_summary(config.get("calibration", {})),
    )


def _at(revision: str | None) -> str:
    return "" if revision is None else f"@{revision}"


__all__ = ["CARD_FILE", "HubRegistry", "PackEntry", "cached_packs", "fetch_pack", "hub_packs"]
