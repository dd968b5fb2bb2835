"""Where models come from: a model argument (a local folder or a Hub id) as a local folder.

The Hub client lives in the registry layer above (``sgl_kvmap.registry.hub``, the only code
that imports huggingface_hub); importing ``sgl_kvmap`` installs it here with
``use_model_source``, so the layers below depend on this interface only. Until then, only
local folders are models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from .errors import ModelSourceError


class ModelSource(Protocol):
    def __call__(self, model: str, revision: str | None = None, *, weights: bool = True) -> Path:
        """The local folder of ``model`` at ``revision``; ``weights=False``: its config and
        tokenizer suffice. Raises ModelSourceError, in one line, when there is none."""


def local_folders(model: str, revision: str | None = None, *, weights: bool = True) -> Path:
    """The model source without a registry: ``model`` if it is a folder."""
    if not Path(model).is_dir():
        raise ModelSourceError(f"{model} is not a folder (no such directory)")
    return model_in_folder(model)


def model_in_folder(folder: str | Path) -> Path:
    """``folder``, an existing folder, if it holds a model (its config.json), else
    ModelSourceError: transformers would say only that it has no ``model_type``."""
    if not (Path(folder) / "config.json").is_file():
        raise ModelSourceError(f"{folder} is a folder, but not a model's: it has no config.json")
    return Path(folder)


_source: ModelSource = local_folders


def use_model_source(source: ModelSource) -> None:
    """Install how model arguments become folders (``sgl_kvmap.registry`` does on import)."""
    global _source
    _source = source


def model_folder(model: str | Path, revision: str | None = None, *, weights: bool = True) -> Path:
    """The local folder of ``model`` (a folder or a Hub id), from the installed model source."""
    return _source(str(model), revision, weights=weights)
