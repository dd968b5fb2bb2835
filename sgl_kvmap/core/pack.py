"""Mapper packs: one local folder (``KVMapper.save_pretrained`` / ``from_pretrained``).

    mapper.safetensors   k.{layer}.weight / k.{layer}.bias / v.{layer}.* (float32), for a
                         reduced-rank mapper k.projection / v.projection, and for one with a
                         non-linear residual k.residual.in.weight / .bias and
                         k.residual.{layer}.weight (v.* alike); its metadata holds the
                         digest of kvmap.json's semantic fields (``manifest``)
    kvmap.json           format version, both ModelSpecs + fingerprints, selection, ridge,
                         sink tokens, rank, calibration recipe, metrics, sha256 of the tensors
                         (schema: ``manifest.SCHEMA``)
    README.md            model card generated from kvmap.json

Format version 2 is version 1 plus the optional projections (written only by reduced-rank
mappers, so every other pack stays readable by version-1 readers); version 3 adds the optional
non-linear residual (``residual_hidden`` in kvmap.json), written only by mappers that have one.

Saving fills a hidden sibling folder and swaps it into place whole (``files``), and never
replaces a folder that is not a pack. Loading reads both files from one version of the folder,
checks everything (schema, checksum, digest, shapes) and raises PackError saying what is
wrong; the loaded mapper holds copies of what was checked, never a mapping of the file.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from .._version import __version__
from .errors import KVMapError, PackError
from .files import UnreadableFile, read_folder, replacing_folder, sha256_bytes
from .fit import KINDS, LayerMap
from .manifest import (
    DIGEST_KEY,
    FORMAT_NAME,
    FORMAT_VERSION,
    READABLE_VERSIONS,
    manifest_digest,
    parse_manifest,
)
from .residual import Residual
from .spec import ModelSpec

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "READABLE_VERSIONS",
    "check_destination",
    "load_pack",
    "save_pack",
    "use_registry",
]

log = logging.getLogger(__name__)

TENSORS_FILE = "mapper.safetensors"
CONFIG_FILE = "kvmap.json"
CARD_FILE = "README.md"
PACK_FILES = frozenset({TENSORS_FILE, CONFIG_FILE, CARD_FILE})
# A ridge fit keeps its weights and biases far inside float16's range; larger values can only
# come from damage or a hostile file, and would overflow an engine's KV pool.
MAX_ABS_WEIGHT = 65504.0
MAX_MANIFEST_BYTES = 4 << 20  # kvmap.json: a few KiB of settings and metrics; notes fit well


class PackRegistry(Protocol):
    """What the registry layer above (``sgl_kvmap.registry``, the Hub client) does for packs.

    It installs itself with ``use_registry`` when ``sgl_kvmap`` is imported, so this module
    depends on the interface only."""

    def render_card(self, config: dict[str, Any]) -> str:
        """README.md of a pack whose kvmap.json is ``config``."""

    def fetch(self, repo_id: str, **options: Any) -> Path:
        """A local folder holding the pack ``repo_id`` at one commit (``revision``,
        ``cache_dir``, ``local_files_only``, ``token`` as in huggingface_hub)."""

    def push(self, folder: Path, repo_id: str, **options: Any) -> str:
        """Publish a pack folder as one commit; returns the commit id."""


_registry: PackRegistry | None = None


def use_registry(implementation: PackRegistry) -> None:
    """Install the registry (``sgl_kvmap.registry`` does this on import)."""
    global _registry
    _registry = implementation


def registry() -> PackRegistry:
    if _registry is None:
        raise KVMapError("no pack registry installed: import sgl_kvmap (it installs one)")
    return _registry


def is_repo_id(name: str) -> bool:
    """Whether ``name`` reads as a Hub repo id ``namespace/name`` rather than a local path."""
    return re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*", name) is not None


def is_hub_pack(name: str | Path) -> bool:
    """Whether ``name`` names a pack on the Hub: no such local path, and a repo id."""
    return not Path(name).exists() and is_repo_id(str(name))


def save_pack(mapper, folder: Path, *, overwrite: bool = False) -> Path:
    """Write ``mapper`` to ``folder``. Returns the folder.

    A new or empty folder is written; an existing pack is replaced only with ``overwrite``;
    anything else is refused (PackError, ``check_destination``). Readers see the whole old pack
    or the whole new one.
    """
    folder = Path(folder).absolute()
    with replacing_folder(
        folder, lambda existing: check_destination(existing, overwrite)
    ) as staging:
        config = _config(mapper, tensors_sha256="")
        config = json.loads(json.dumps(config, allow_nan=False))  # the values as read back
        data = save(_tensors(mapper), metadata=_metadata(config))
        config["tensors_sha256"] = sha256_bytes(data)
        (staging / TENSORS_FILE).write_bytes(data)
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (staging / CARD_FILE).write_text(registry().render_card(config))
    return folder


def load_pack(folder: Path, mapper_class):
    """Read and validate a pack folder into a ``mapper_class`` (KVMapper, which calls this from
    ``from_pretrained``). Raises PackError for anything wrong or damaged."""
    folder = Path(folder)
    files = _read_pack(folder)
    config = _manifest(folder, files[CONFIG_FILE])
    data = files[TENSORS_FILE]
    if data is None:
        raise PackError(f"{folder}: {TENSORS_FILE} is missing; re-download or re-build the pack")
    # The tensors are built from the very bytes checked here: nothing stays mapped to the
    # file, so it can change or vanish afterwards without touching the loaded mapper.
    if sha256_bytes(data) != config["tensors_sha256"]:
        raise PackError(
            f"{folder}: {TENSORS_FILE} does not match the checksum in {CONFIG_FILE} "
            "(damaged or edited); re-download or re-build the pack"
        )
    try:
        tensors = load(data)
        _check_digest(folder, config, _safetensors_metadata(data))
        mapper = _mapper(config, tensors, mapper_class)
    except (KeyError, TypeError, ValueError, SafetensorError) as err:
        raise PackError(f"{folder}: malformed pack ({type(err).__name__}: {err})") from err
    except PackError:
        raise
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
    """The validated kvmap.json of a pack folder (format, version and schema checked)."""
    folder = Path(folder)
    return _manifest(folder, _read_pack(folder, (CONFIG_FILE,))[CONFIG_FILE])


def is_pack(folder: Path) -> bool:
    """Whether ``folder`` holds a kvmap.json of this format (whole or damaged otherwise)."""
    try:
        data = read_folder(Path(folder), (CONFIG_FILE,), {CONFIG_FILE: MAX_MANIFEST_BYTES})
        data = data[CONFIG_FILE]
        return data is not None and json.loads(data).get("format") == FORMAT_NAME
    except (OSError, ValueError, RecursionError, AttributeError):
        return False


def _read_pack(folder: Path, names=(CONFIG_FILE, TENSORS_FILE)) -> dict[str, bytes | None]:
    """The named files of one version of the pack at ``folder``; kvmap.json must be there."""
    try:
        files = read_folder(folder, names, {CONFIG_FILE: MAX_MANIFEST_BYTES})
    except UnreadableFile as err:
        raise PackError(f"{folder} is not a readable mapper pack: {err}") from None
    except (FileNotFoundError, NotADirectoryError) as err:
        raise PackError(f"{folder} is not a mapper pack: no such folder") from err
    if files[CONFIG_FILE] is None:
        raise PackError(f"{folder} is not a mapper pack: {CONFIG_FILE} is missing")
    return files


def _manifest(folder: Path, data: bytes) -> dict[str, Any]:
    return parse_manifest(data, str(folder / CONFIG_FILE))


def check_destination(folder: Path, overwrite: bool = False) -> None:
    """Refuse (PackError) a ``folder`` that ``save_pack`` may not write: a symbolic link, one
    that exists and is neither empty nor a pack, a pack beside other files, or a pack without
    ``overwrite``. ``save_pack`` applies this rule under its lock; call it early to refuse
    before long work."""
    folder = Path(folder)
    if not (folder.exists() or folder.is_symlink()):
        return
    if folder.is_symlink():
        raise PackError(
            f"{folder} is a symbolic link; refusing to replace it. Save to the folder it "
            "points to, or choose another folder."
        )
    if folder.is_dir() and not any(folder.iterdir()):
        return
    if not folder.is_dir() or not is_pack(folder):
        raise PackError(
            f"{folder} exists and is not a mapper pack; refusing to replace it. "
            "Choose a new or empty folder."
        )
    others = sorted(set(os.listdir(folder)) - PACK_FILES)
    if others:
        raise PackError(
            f"{folder} holds a mapper pack and other files ({', '.join(others[:4])}); "
            "refusing to replace them. Move them away or choose another folder."
        )
    if not overwrite:
        raise PackError(
            f"{folder} already holds a mapper pack; pass overwrite=True "
            "(sgl-kvmap: --overwrite) to replace it"
        )


def _metadata(config: dict[str, Any]) -> dict[str, str]:
    """The tensors file's metadata: the format's name and the manifest's digest."""
    return {"format": FORMAT_NAME, DIGEST_KEY: manifest_digest(config)}


def _safetensors_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of safetensors bytes (an 8-byte header length, then JSON)."""
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]).get("__metadata__") or {}


def _check_digest(folder: Path, config: dict[str, Any], metadata: dict[str, str]) -> None:
    recorded = metadata.get(DIGEST_KEY)
    if recorded is None:
        log.warning(
            "%s: written before manifests were covered by a digest; edits to %s cannot be "
            "detected. Save it again to add one.",
            folder,
            CONFIG_FILE,
        )
    elif recorded != manifest_digest(config):
        raise PackError(
            f"{folder}: {CONFIG_FILE} does not match the digest recorded in {TENSORS_FILE} "
            "(edited?); re-download or re-build the pack"
        )


def _mapper(config: dict[str, Any], tensors: dict[str, torch.Tensor], mapper_class):
    """Build the mapper a checked manifest and its tensors describe (raises KVMapError)."""
    selection = config["selection"]
    return mapper_class(
        source=_spec(config, "source"),
        target=_spec(config, "target"),
        selection=selection,
        maps={
            kind: [_layer_map(tensors, kind, layer) for layer in range(len(selection))]
            for kind in KINDS
        },
        ridge=float(config["ridge"]),
        sink_tokens=config["sink_tokens"],
        info={k: config.get(k, {}) for k in ("calibration", "metrics")},
        projections=(
            {kind: _finite(tensors[f"{kind}.projection"], f"{kind} projection") for kind in KINDS}
            if config.get("rank") is not None
            else None
        ),
        residuals=(
            {kind: _residual(tensors, kind, len(selection)) for kind in KINDS}
            if config.get("residual_hidden") is not None
            else None
        ),
    )


def same_maps(a, b) -> bool:
    """Whether mappers ``a`` and ``b`` translate alike: the same pair, settings and tensors
    (their recorded metrics and calibration notes aside)."""
    settings = ("source_fingerprint", "target_fingerprint", "selection", "ridge", "sink_tokens")
    settings += ("rank", "residual_hidden")
    config_a, config_b = _config(a, ""), _config(b, "")
    if any(config_a[key] != config_b[key] for key in settings):
        return False
    tensors_a, tensors_b = _tensors(a), _tensors(b)
    return tensors_a.keys() == tensors_b.keys() and all(
        torch.equal(tensors_a[name], tensors_b[name]) for name in tensors_a
    )


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
        raise KVMapError(
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
    largest = float(tensor.abs().max()) if tensor.numel() else 0.0
    if largest > MAX_ABS_WEIGHT:
        raise PackError(
            f"{name} holds {largest:.3g}, beyond the {MAX_ABS_WEIGHT:g} a fitted map stays within "
            "(float16's range): a damaged or hostile pack"
        )
    return tensor
