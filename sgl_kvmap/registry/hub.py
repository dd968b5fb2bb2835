"""Models on the Hugging Face Hub as local folders, through huggingface_hub (no HTTP by hand).

A model argument is a local folder (used as it is) or a Hub repo id. A repo id is looked up in
the Hugging Face cache first and used from there when it is complete (pass a ``revision`` to
pin or refresh it); otherwise it is downloaded, unless ``HF_HUB_OFFLINE`` is set. Every way
this can fail is a one-line ModelSourceError that says what to do, and none of them waits: a
network that cannot be reached fails on the first attempt (huggingface_hub falls back to the
cache instead of retrying).
"""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import (
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import validate_repo_id

from ..core.errors import ModelSourceError

# what a model's spec reads (config, tokenizer) and what loading it adds (safetensors only:
# no pickled weights)
SPEC_FILES = ("*.json", "*.model", "*.txt", "*.tiktoken")
MODEL_FILES = (*SPEC_FILES, "*.safetensors")


def model_folder(model: str | Path, revision: str | None = None, *, weights: bool = True) -> Path:
    """The local folder of ``model``: an existing folder itself, else the Hub repo ``model``
    (at ``revision``) from the Hugging Face cache or downloaded into it.

    ``weights=False`` fetches only what a spec reads (config and tokenizer files). Raises
    ModelSourceError when ``model`` is neither a folder nor a repo id, or is not cached and
    cannot be downloaded (offline, Hub unreachable, no such repo or revision).
    """
    if Path(model).is_dir():
        return Path(model)
    repo_id = _repo_id(str(model))
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
            f"{repo_id} is not a local folder and not in the Hugging Face cache, and the Hub "
            f"could not be reached ({first_line(err)}). Pass a local folder, or set "
            "HF_HUB_OFFLINE=1 to use cached models only."
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
