"""Mapper packs on the Hugging Face Hub: fetch at one commit, publish in one commit, list.

Everything here goes through huggingface_hub (downloads, cache layout, retries, locks, auth).
A pack is always fetched by commit: the revision asked for (branch, tag or commit) is resolved
once (an answer that is not a 40-hex commit id is refused), its kvmap.json is read and checked
first (format version, schema), and only then are the tensors downloaded at that same commit.
The caller verifies the whole pack (``load_pack``; ``pull_pack`` does, downloading a damaged
cached copy again) before anything uses it. A repo whose card does not describe a pack is
skipped by listings, logged.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub import (
    CommitOperationAdd,
    CommitOperationDelete,
    HfApi,
    constants,
    hf_hub_download,
    scan_cache_dir,
    snapshot_download,
)
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
from ..core.pack import CARD_FILE, CONFIG_FILE, PACK_FILES, TENSORS_FILE, load_pack, read_config
from ..fitting.config import recipe_summary
from .card import CARD_KEY, render_card
from .hub import check_hub_cache, checked_repo_id, first_line, hub_failure

log = logging.getLogger(__name__)

LIBRARY_NAME = "sgl-kvmap"
COMMIT_ID = re.compile(r"[0-9a-f]{40}")
CARD_FIELDS = ("source", "target", "source_fingerprint", "target_fingerprint")


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
    force_download: bool = False,
) -> Path:
    """The local snapshot folder of pack ``repo_id`` at ``revision`` (default: main), in the
    Hugging Face cache (``force_download``: downloaded again even if cached). Raises PackError
    with one line saying what to do when it cannot."""
    checked_repo_id(repo_id, PackError)
    check_hub_cache(cache_dir)
    common = {
        "repo_id": repo_id,
        "cache_dir": cache_dir,
        "local_files_only": local_files_only,
        "token": token,
        "endpoint": endpoint(),
        "library_name": LIBRARY_NAME,
        "force_download": force_download,
    }
    where = f"{repo_id}{_at(revision)}"
    try:
        head = Path(
            snapshot_download(revision=revision or "main", allow_patterns=[CONFIG_FILE], **common)
        )
        commit = _commit_of(head, where)
        parse_manifest((head / CONFIG_FILE).read_bytes(), f"{repo_id}@{commit}/{CONFIG_FILE}")
        folder = snapshot_download(revision=commit, allow_patterns=sorted(PACK_FILES), **common)
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as err:
        raise PackError(_missing(where, repo_id, err, local_files_only)) from err
    except (RepositoryNotFoundError, RevisionNotFoundError) as err:
        raise PackError(f"{where}: no such pack on the Hub ({first_line(err)})") from err
    except FileNotFoundError as err:
        raise PackError(f"{where} has no {CONFIG_FILE}: not a mapper pack") from err
    except EntryNotFoundError as err:
        raise PackError(f"{where}: {first_line(err)}") from err
    except NETWORK_ERRORS as err:
        raise PackError(
            f"{where}: {hub_failure(err, cache_dir or constants.HF_HUB_CACHE)}"
        ) from err
    return Path(folder)


def pull_pack(repo_id: str, *, force: bool = False, **options: Any) -> Path:
    """``fetch_pack`` (``options`` as it takes them), then the whole pack verified. A cached copy
    that fails its check (damaged on disk) is downloaded again once; ``force`` downloads it again
    at once. Raises PackError when the pack cannot be had whole."""
    folder = fetch_pack(repo_id, force_download=force, **options)
    try:
        load_pack(folder, KVMapper)
        return folder
    except PackError as err:
        if force or options.get("local_files_only") or constants.HF_HUB_OFFLINE:
            raise PackError(
                f"{err}; to replace the cached copy run `sgl-kvmap pull {repo_id} --force` "
                "where the Hub can be reached"
            ) from err
        log.warning("%s; downloading it again", err)
    folder = fetch_pack(repo_id, force_download=True, **options)
    load_pack(folder, KVMapper)  # damaged on the Hub as well: the error says so
    return folder


def _commit_of(snapshot: Path, where: str) -> str:
    """The commit a snapshot folder is named after, refused when it is not a commit id (a Hub
    that answered a branch name as the commit would have us pin a name that moves)."""
    if not COMMIT_ID.fullmatch(snapshot.name):
        raise PackError(
            f"{where}: the Hub gave {snapshot.name!r} as the commit, which is not a commit id "
            "(40 hex digits); refusing to pin a name that can move. Check HF_ENDPOINT."
        )
    return snapshot.name


def _missing(where: str, repo_id: str, err: BaseException, local_files_only: bool) -> str:
    """Why ``where`` could not be fetched when it is not in the cache (offline or a failure)."""
    if local_files_only or constants.is_offline_mode() or isinstance(err, OfflineModeIsEnabled):
        return (
            f"{where} is not in the local Hugging Face cache and the Hub cannot be reached "
            f"(offline). Get it with `sgl-kvmap pull {repo_id}` while online, or build the "
            "pair's pack with `sgl-kvmap resolve SOURCE TARGET --build`."
        )
    return f"{where} is not in the local Hugging Face cache and {hub_failure(err)}"


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
    """Publish the pack ``folder`` to ``repo_id`` as one commit on branch ``revision`` (default
    main; created if missing), optionally tagged ``tag``. Returns the commit id.

    The pack is verified first, and its card is the one generated from its kvmap.json (a
    README.md in ``folder`` that says otherwise, or none, is not published; logged).

    A push that fails leaves the remote as it was, as far as the Hub's API allows:

    - nothing is written before the tag is known to be free (a taken tag is refused);
    - the commit is made on the branch head read before it (``parent_commit``), so a branch
      that moved meanwhile refuses it instead of losing the other commit;
    - when tagging fails after the commit, the commit is undone: a branch made for this push
      is deleted, and an existing branch gets a commit restoring its previous pack files (its
      files are as before; its history keeps both commits). If undoing fails too, the error
      names the commit that holds the untagged pack.

    A repository created for the push stays, with no pack in it. Raises PackError."""
    checked_repo_id(repo_id, PackError)
    mapper = load_pack(folder, KVMapper)  # the whole pack is verified before it is published
    config = read_config(folder)
    api = HfApi(endpoint=endpoint(), token=token, library_name=LIBRARY_NAME)
    message = commit_message or (
        f"sgl-kvmap pack {mapper.source.model_id} -> {mapper.target.model_id}"
    )
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        branch, parent, made = _branch_for(api, repo_id, revision, tag)
        commit = api.create_commit(
            repo_id,
            _pack_operations(Path(folder), config),
            commit_message=message,
            revision=branch,
            parent_commit=parent,
        ).oid
    except NETWORK_ERRORS as err:
        raise PackError(f"could not publish {folder} to {repo_id}: {hub_failure(err)}") from err
    if tag is not None:
        try:
            api.create_tag(repo_id, tag=tag, revision=commit)
        except NETWORK_ERRORS as err:
            undone = _undo(api, repo_id, branch, parent, commit, made)
            raise PackError(
                f"could not tag {repo_id}@{commit[:12]} as {tag!r}: {hub_failure(err)}; {undone}"
            ) from err
    return commit


def _branch_for(
    api: HfApi, repo_id: str, revision: str | None, tag: str | None
) -> tuple[str, str | None, bool]:
    """The branch to commit to, its head, and whether it was made for this push; a taken tag
    is refused before anything is written."""
    refs = api.list_repo_refs(repo_id)
    if tag is not None and tag in {t.name for t in refs.tags}:
        raise PackError(
            f"{repo_id} already has a tag {tag!r}; nothing was pushed. Choose another tag."
        )
    heads = {b.name: b.target_commit for b in refs.branches}
    branch = revision or "main"
    if branch in heads:
        return branch, heads[branch], False
    api.create_branch(repo_id, branch=branch)  # from the default branch
    return branch, heads.get("main"), True


def _pack_operations(folder: Path, config: dict[str, Any]) -> list[CommitOperationAdd]:
    """The pack's files as one commit: kvmap.json and the tensors as they are, and the card
    generated from that kvmap.json."""
    card = render_card(config)
    written = folder / CARD_FILE
    if not written.is_file() or written.read_text(errors="replace") != card:
        log.warning(
            "%s: %s is not the card of its %s; publishing the card generated from it",
            folder,
            CARD_FILE,
            CONFIG_FILE,
        )
    return [
        CommitOperationAdd(CONFIG_FILE, folder / CONFIG_FILE),
        CommitOperationAdd(TENSORS_FILE, folder / TENSORS_FILE),
        CommitOperationAdd(CARD_FILE, card.encode()),
    ]


def _undo(
    api: HfApi, repo_id: str, branch: str, parent: str | None, commit: str, made: bool
) -> str:
    """Undo ``commit`` on ``branch`` (see ``push_pack``); says what became of the branch."""
    try:
        if commit == parent:
            return f"nothing was changed (the pack was already at {branch})"
        if made:
            api.delete_branch(repo_id, branch=branch)
            return f"the branch {branch!r} made for the push was deleted"
        with tempfile.TemporaryDirectory() as scratch:
            restore = _restoring(api, repo_id, parent, Path(scratch))
            undo = api.create_commit(
                repo_id,
                restore,
                commit_message=f"sgl-kvmap: undo {commit[:12]} (tagging it failed)",
                revision=branch,
                parent_commit=commit,
            )
        return f"{branch!r} holds its previous pack files again (commit {undo.oid[:12]})"
    except NETWORK_ERRORS as err:
        return (
            f"undoing the commit failed too ({hub_failure(err)}): {branch!r} now holds the pack "
            f"untagged at {commit}"
        )


def _restoring(api: HfApi, repo_id: str, parent: str | None, scratch: Path) -> list:
    """Commit operations that put the pack files of ``parent`` back (deleting those it lacked)."""
    before = set(api.list_repo_files(repo_id, revision=parent)) if parent else set()
    operations: list = []
    for name in sorted(PACK_FILES):
        if name not in before:
            operations.append(CommitOperationDelete(name))
            continue
        path = hf_hub_download(
            repo_id,
            name,
            revision=parent,
            cache_dir=scratch,
            endpoint=api.endpoint,
            token=api.token,
            library_name=LIBRARY_NAME,
        )
        operations.append(CommitOperationAdd(name, path))
    return operations


def cached_packs(cache_dir: str | Path | None = None) -> list[PackEntry]:
    """The packs in the Hugging Face cache (each cached commit that holds a kvmap.json)."""
    check_hub_cache(cache_dir)
    try:
        info = scan_cache_dir(cache_dir or constants.HF_HUB_CACHE)
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
    """Packs on the Hub carrying the library tag and ``tags``, described by their cards (a repo
    whose card or commit does not describe a pack is skipped, logged)."""
    api = HfApi(endpoint=endpoint(), token=token, library_name=LIBRARY_NAME)
    try:
        found = list(api.list_models(filter=[LIBRARY_NAME, *tags], cardData=True))
    except NETWORK_ERRORS as err:
        raise PackError(f"could not list packs on the Hub: {hub_failure(err)}") from err
    entries = (_card_entry(model.id, model.sha, model.card_data) for model in found)
    return [entry for entry in entries if entry is not None]


def _card_entry(repo_id: str, sha: Any, card_data: Any) -> PackEntry | None:
    """The PackEntry a listed repo's card describes, or None (logged when it tries and fails)."""
    data = card_data.to_dict() if hasattr(card_data, "to_dict") else {}
    block = data.get(CARD_KEY) if isinstance(data, dict) else None
    if block is None:
        return None  # not a pack's card (a repo merely tagged like one)
    fields = block.get if isinstance(block, dict) else None
    if fields is None or not all(isinstance(fields(key), str) for key in CARD_FIELDS):
        log.warning(
            "skipping %s: its model card's %r block is malformed (it must map %s to text)",
            repo_id,
            CARD_KEY,
            ", ".join(CARD_FIELDS),
        )
        return None
    if not (isinstance(sha, str) and COMMIT_ID.fullmatch(sha)):
        log.warning(
            "skipping %s: the Hub gave %r as its commit, which is not a commit id", repo_id, sha
        )
        return None
    return PackEntry(repo_id, sha, *(block[key] for key in CARD_FIELDS), "hub")


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


__all__ = [
    "CARD_FILE",
    "HubRegistry",
    "PackEntry",
    "cached_packs",
    "fetch_pack",
    "hub_packs",
    "pull_pack",
    "push_pack",
]
