"""Models on the Hugging Face Hub as local folders, through huggingface_hub (no HTTP by hand).

A model argument is a local folder (used as it is) or a Hub repo id. A repo id is looked up in
the Hugging Face cache first and used from there when it is complete (pass a ``revision`` to
pin or refresh it); otherwise it is downloaded, unless ``HF_HUB_OFFLINE`` is set. Every way
this can fail is a one-line ModelSourceError that says what to do, and none of them waits: a
network that cannot be reached fails on the first attempt (huggingface_hub falls back to the
cache instead of retrying).

Every Hub request has a time limit: huggingface_hub leaves some without one (``repo_info``,
listings, commits), so a server that accepts a connection and never answers would hang them.
Importing the registry installs, through huggingface_hub's ``set_client_factory``, its default
HTTP client with one addition: a request that carries no limit gets ``hub_timeout()`` seconds
(``KVMAP_HUB_TIMEOUT``, else huggingface_hub's ``HF_HUB_DOWNLOAD_TIMEOUT``) to connect and
between bytes; limits huggingface_hub sets itself are kept. ``hub_failure`` words what went
wrong with a Hub call in one line: offline, a time limit, no connection, a server error, or a
cache that cannot be written.
"""

from __future__ import annotations

import errno
import math
import os
from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import (
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import validate_repo_id

from ..core.environment import PREFIX, setting
from ..core.errors import KVMapError, ModelSourceError
from ..core.sources import model_in_folder

TIMEOUT_SETTING = "HUB_TIMEOUT"  # KVMAP_HUB_TIMEOUT: seconds a Hub request may wait for data
# what a full or read-only cache raises (errno), and how each is said
FULL = "is full", "free space there or point HF_HOME at another disk"
READ_ONLY = "is not writable", "point HF_HOME at a writable folder"
CACHE_ERRNOS = {
    errno.ENOSPC: ("no space left on the device", *FULL),
    errno.EDQUOT: ("disk quota exceeded", *FULL),
    errno.EROFS: ("read-only file system", *READ_ONLY),
    errno.EACCES: ("permission denied", *READ_ONLY),
    errno.EPERM: ("operation not permitted", *READ_ONLY),
}

# what a model's spec reads (config, tokenizer) and what loading it adds (safetensors only:
# no pickled weights)
SPEC_FILES = ("*.json", "*.model", "*.txt", "*.tiktoken")
MODEL_FILES = (*SPEC_FILES, "*.safetensors")


def hub_timeout() -> float:
    """Seconds a Hub request may wait to connect or for its next bytes: ``KVMAP_HUB_TIMEOUT``,
    else huggingface_hub's ``HF_HUB_DOWNLOAD_TIMEOUT``. KVMapError for a value that is not a
    number of seconds above 0."""
    value = setting(TIMEOUT_SETTING)
    if value is None:
        return float(constants.HF_HUB_DOWNLOAD_TIMEOUT)
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise KVMapError(
            f"{PREFIX}{TIMEOUT_SETTING}={value!r} is not a number of seconds above 0; "
            "set it to, say, 10, or unset it"
        )
    return seconds


def _bound_request(request) -> None:
    """httpx request hook: give each unset time limit of ``request`` ``hub_timeout()``."""
    limits = dict(request.extensions.get("timeout") or {})
    seconds = hub_timeout()
    for phase in ("connect", "read", "write", "pool"):
        if limits.get(phase) is None:
            limits[phase] = seconds
    request.extensions["timeout"] = limits


def _bounded_client():
    """huggingface_hub's default HTTP client, with ``_bound_request`` among its request hooks."""
    from huggingface_hub.utils._http import default_client_factory  # httpx: huggingface_hub 1.x

    client = default_client_factory()
    client.event_hooks = {
        **client.event_hooks,
        "request": [*client.event_hooks.get("request", []), _bound_request],
    }
    return client


def use_time_limits() -> None:
    """Make every request huggingface_hub sends without a time limit wait ``hub_timeout()`` at
    most (its ``set_client_factory``; a factory installed later replaces this one). Under
    huggingface_hub 0.x (requests) nothing is changed."""
    from huggingface_hub import utils

    if hasattr(utils, "set_client_factory"):
        utils.set_client_factory(_bounded_client)


def hub_failure(err: BaseException, cache: str | Path | None = None) -> str:
    """What went wrong in a Hub call, in words, from ``err`` and the errors behind it: the
    cache not writable or full (with the path, else ``cache``), offline, a time limit, no
    connection, or the server's answer (HTTP status)."""
    causes = _causes(err)
    for cause in causes:
        if isinstance(cause, OSError) and cause.errno in CACHE_ERRNOS:
            path = cause.filename or cache
            where = f" ({path})" if path else ""
            reason, state, advice = CACHE_ERRNOS[cause.errno]
            return f"the Hugging Face cache {state}: {reason}{where}; {advice}"
    for cause in causes:
        if isinstance(cause, OfflineModeIsEnabled):
            return "offline (HF_HUB_OFFLINE is set)"
        if type(cause).__name__.endswith("Timeout") or isinstance(cause, TimeoutError):
            return (
                f"the Hub ({_endpoint()}) did not answer within {hub_timeout():g} s "
                f"({PREFIX}{TIMEOUT_SETTING} sets the limit)"
            )
        if isinstance(cause, HfHubHTTPError) and cause.response is not None:
            status = cause.response.status_code
            kind = "a server error" if status >= 500 else "a refusal"
            return f"the Hub answered HTTP {status}, {kind} ({first_line(cause)})"
    for cause in causes:
        if type(cause).__name__ in ("ConnectError", "ConnectionError", "NetworkError"):
            return f"the Hub ({_endpoint()}) could not be reached ({first_line(cause)})"
    return f"the Hub could not be reached ({first_line(err)})"


def check_cache_folder(path: str | Path, variable: str) -> None:
    """Refuse (KVMapError) a cache folder that cannot be one: it, or a folder above it, is a
    file. ``variable`` names the setting that chose it (``HF_HOME``, say)."""
    path = Path(path).expanduser()
    for folder in (path, *path.parents):
        if folder.exists():
            if not folder.is_dir():
                raise KVMapError(
                    f"{path} cannot hold the Hugging Face cache: {folder} is a file, not a "
                    f"folder (the cache's place comes from {variable}; point it at a folder)"
                )
            return


def checked_repo_id(repo_id: str, error: type[KVMapError] = KVMapError) -> str:
    """``repo_id`` when it names a Hub repo (``namespace/name`` as huggingface_hub validates
    it), else ``error`` in one line."""
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise error(f"{repo_id!r} is not a valid Hub repo id: {first_line(err)}") from None
    if "/" not in repo_id:
        raise error(f"{repo_id!r} is not a valid Hub repo id: write it as NAMESPACE/NAME")
    return repo_id


def checked_namespace(namespace: str) -> str:
    """``namespace`` when it can own Hub repos (a user or organization name), else KVMapError."""
    try:
        validate_repo_id(f"{namespace}/name")
    except HFValidationError:
        raise KVMapError(
            f"{namespace!r} is not a valid Hub namespace: a user or organization name of "
            "letters, digits, '-', '_' and '.'"
        ) from None
    return namespace


def check_hub_cache(cache_dir: str | Path | None) -> None:
    """``check_cache_folder`` for the Hugging Face cache in use (``cache_dir`` or the default)."""
    check_cache_folder(cache_dir or constants.HF_HUB_CACHE, _chosen_by(cache_dir, "HF_HUB_CACHE"))


def check_caches(cache_dir: str | Path | None, assets_dir: str | Path | None) -> None:
    """``check_cache_folder`` for the Hugging Face cache and its assets cache in use."""
    check_hub_cache(cache_dir)
    assets = assets_dir or constants.HF_ASSETS_CACHE
    check_cache_folder(assets, _chosen_by(assets_dir, "HF_ASSETS_CACHE"))


def _chosen_by(given: str | Path | None, variable: str) -> str:
    """What chose a cache folder, for messages: the argument, its variable, else HF_HOME."""
    if given is not None:
        return "the cache folder given"
    return variable if os.environ.get(variable) else "HF_HOME"


def _causes(err: BaseException) -> list[BaseException]:
    """``err`` and the errors it was raised from or during, outermost first."""
    seen: list[BaseException] = []
    while err is not None and all(err is not s for s in seen):
        seen.append(err)
        err = err.__cause__ or err.__context__
    return seen


def _endpoint() -> str:
    return os.environ.get("HF_ENDPOINT") or constants.ENDPOINT


def model_folder(model: str | Path, revision: str | None = None, *, weights: bool = True) -> Path:
    """The local folder of ``model``: an existing folder itself, else the Hub repo ``model``
    (at ``revision``) from the Hugging Face cache or downloaded into it.

    ``weights=False`` fetches only what a spec reads (config and tokenizer files). Raises
    ModelSourceError when ``model`` is neither a folder nor a repo id, or is not cached and
    cannot be downloaded (offline, Hub unreachable, no such repo or revision).
    """
    if Path(model).is_dir():
        return model_in_folder(model)
    repo_id = _repo_id(str(model))
    check_hub_cache(None)
    patterns = list(MODEL_FILES if weights else SPEC_FILES)
    cached = _cached_snapshot(repo_id, revision, patterns, weights)
    if cached is not None:
        return cached
    if constants.HF_HUB_OFFLINE:
        raise ModelSourceError(
            f"{repo_id} is not a local folder and not in the Hugging Face cache; HF_HUB_OFFLINE "
            "is set, so it cannot be downloaded. Pass a local folder, or unset HF_HUB_OFFLINE "
            "where the Hub can be reached."
        )
    return _download(repo_id, revision, patterns)


def _repo_id(model: str) -> str:
    """``model`` if it can name a Hub repo (``name`` or ``owner/name``), else ModelSourceError."""
    try:
        validate_repo_id(model)
    except HFValidationError:
        raise ModelSourceError(
            f"{model} is not a folder (no such directory) and not a Hugging Face repo id"
        ) from None
    return model


def _cached_snapshot(
    repo_id: str, revision: str | None, patterns: list[str], weights: bool
) -> Path | None:
    """The cached snapshot of ``repo_id`` if it holds ``patterns`` whole, else None."""
    try:
        folder = Path(
            snapshot_download(
                repo_id, revision=revision, allow_patterns=patterns, local_files_only=True
            )
        )
    except LocalEntryNotFoundError:  # absent, or known to be incomplete
        return None
    complete = (folder / "config.json").is_file()
    if weights:
        complete = complete and any(folder.glob("*.safetensors"))
    return folder if complete else None


def _download(repo_id: str, revision: str | None, patterns: list[str]) -> Path:
    """Download ``patterns`` of ``repo_id`` (huggingface_hub's cache, retries and auth)."""
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except LocalEntryNotFoundError as err:  # the Hub could not be reached
        raise ModelSourceError(
            f"{repo_id} is not a local folder and not in the Hugging Face cache, and "
            f"{hub_failure(err)}. Pass a local folder, or set HF_HUB_OFFLINE=1 to use cached "
            "models only."
        ) from err
    except RevisionNotFoundError as err:
        raise ModelSourceError(f"{repo_id} has no revision {revision!r} on the Hub") from err
    except RepositoryNotFoundError as err:
        raise ModelSourceError(
            f"{repo_id}: no such model on the Hugging Face Hub, or it is private or gated "
            "(log in with `hf auth login` if you have access)"
        ) from err
    except HfHubHTTPError as err:
        raise ModelSourceError(
            f"{repo_id}: the Hugging Face Hub refused the download ({first_line(err)})"
        ) from err


def first_line(err: BaseException) -> str:
    """The first line of ``err``'s message (huggingface_hub's run over several)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
