"""resolve: the pack for a model pair, from the local cache, else the Hub, else built here.

Order: a pack built here before (in huggingface_hub's assets cache), a Hub pack already in the
Hugging Face cache, the pair's conventional repo on the Hub, a tag search on the Hub with the
fingerprints matched here, and, when asked (``build``), a fit with the pair's default recipe.
Every candidate is checked against the models in use (their config and tokenizer
fingerprints, read without loading weights); a mismatch is refused with what differs unless
``allow_mismatch`` says otherwise, which is logged.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from huggingface_hub import cached_assets_path
from huggingface_hub.constants import is_offline_mode
from huggingface_hub.utils import WeakFileLock

from ..core.errors import PackError, PairMismatchError
from ..core.mapper import KVMapper
from ..core.pack import is_pack
from ..core.spec import ModelSpec, check_models, check_pair, spec_from_pretrained
from ..fitting.build import build_pack, build_pack_pair
from ..fitting.config import PackRecipe
from .naming import repo_name
from .packs import PackEntry, cached_packs, entry_of, fetch_pack, hub_packs

log = logging.getLogger(__name__)

NAMESPACE_ENV = "SGL_KVMAP_HUB_NAMESPACE"
DEFAULT_NAMESPACE = "sgl-kvmap"  # where published packs are looked for by conventional name


def resolve_mapper(source: str, target: str, **options) -> KVMapper:
    """The checked mapper for ``source`` -> ``target`` (model folders or Hub ids); ``options``
    as ``resolve_pack`` takes them (``build``, ``local_files_only``, ``allow_mismatch``, ...).
    See the module docstring for where it comes from. Raises PackError when there is none."""
    return KVMapper.from_pretrained(resolve_pack(source, target, **options))


def resolve_pack(
    source: str,
    target: str,
    *,
    build: bool = False,
    local_files_only: bool = False,
    allow_mismatch: bool = False,
    namespace: str | None = None,
    cache_dir: str | Path | None = None,
    assets_dir: str | Path | None = None,
    token: str | bool | None = None,
    recipe: PackRecipe = PackRecipe(),
) -> Path:
    """The local folder of the pack for ``source`` -> ``target`` (see ``resolve_mapper``).

    ``cache_dir``: huggingface_hub's cache of Hub packs; ``assets_dir``: its assets cache, where
    built packs go; ``recipe``: how a missing pack is built (default: the pair's default)."""
    specs = spec_from_pretrained(source), spec_from_pretrained(target)
    check_pair(*specs)
    offline = local_files_only or is_offline_mode()
    for folder in _local_candidates(specs, cache_dir, assets_dir):
        if _fits(folder, specs, allow_mismatch):
            return folder
    if not offline:
        for folder in _hub_candidates(specs, namespace, cache_dir, token):
            if _fits(folder, specs, allow_mismatch):
                return folder
    if build:
        return build_missing(source, target, specs, assets_dir, recipe)
    where = "in the local cache" if offline else "in the local cache or on the Hub"
    raise PackError(
        f"no mapper pack for {specs[0].model_id} -> {specs[1].model_id} {where}. "
        + (
            "Fetch one with `sgl-kvmap pull ORG/NAME` while online, or "
            if offline
            else "Publish one with `sgl-kvmap push`, or "
        )
        + "build it here with `sgl-kvmap resolve SOURCE TARGET --build`."
    )


def resolve_pack_pair(
    a: str, b: str, *, build: bool = False, recipe: PackRecipe = PackRecipe(), **options
) -> tuple[Path, Path]:
    """The packs a -> b and b -> a, each as ``resolve_pack`` finds it (``options`` as it takes
    them). With ``build``, missing packs are built; when both are, one calibration pass fits
    both (``fitting.build.build_pack_pair``)."""
    directions = ((a, b), (b, a))
    found: list[Path | None] = []
    for source, target in directions:
        try:
            found.append(resolve_pack(source, target, **options))
        except PackError:
            if not build:
                raise
            found.append(None)
    assets_dir = options.get("assets_dir")
    if found == [None, None]:
        return build_missing_pair(a, b, assets_dir, recipe)
    specs = spec_from_pretrained(a), spec_from_pretrained(b)
    pair = [
        folder or build_missing(source, target, pair_specs, assets_dir, recipe)
        for folder, (source, target), pair_specs in zip(found, directions, (specs, specs[::-1]))
    ]
    return pair[0], pair[1]


def build_missing_pair(
    a: str, b: str, assets_dir: str | Path | None = None, recipe: PackRecipe = PackRecipe()
) -> tuple[Path, Path]:
    """``build_missing`` both ways from one calibration pass, under both packs' locks."""
    specs = spec_from_pretrained(a), spec_from_pretrained(b)
    check_pair(*specs)
    folders = (
        built_pack_folder(specs[0], specs[1], assets_dir),
        built_pack_folder(specs[1], specs[0], assets_dir),
    )
    with contextlib.ExitStack() as locks:
        for folder in sorted(folders):  # one order for every process: no deadlock
            locks.enter_context(_build_lock(folder))
        if not all(is_pack(folder) for folder in folders):
            log.warning("building the packs %s <-> %s here (this fits the pair)", a, b)
            for (mapper, summary), folder in zip(build_pack_pair(a, b, None, recipe), folders):
                if not is_pack(folder):
                    _save_built(mapper, summary, folder)
    return folders


def keep_as_built(mapper: KVMapper, assets_dir: str | Path | None = None) -> Path | None:
    """Keep ``mapper`` as the pack built here for its pair (where ``resolve`` looks first),
    unless one is there already; returns its folder, or None when one was there."""
    folder = built_pack_folder(mapper.source, mapper.target, assets_dir)
    with _build_lock(folder):
        if is_pack(folder):
            return None
        return mapper.save_pretrained(folder)


def built_pack_dir(
    source: ModelSpec, target: ModelSpec, assets_dir: str | Path | None = None
) -> Path:
    """Where a pack built here for this pair lives (huggingface_hub's assets cache)."""
    name = repo_name(
        source.model_id, target.model_id, source.fingerprint, target.fingerprint, target.model_type
    )
    key = f"{name}-{source.fingerprint[:8]}{target.fingerprint[:8]}"
    return cached_assets_path(
        library_name="sgl-kvmap", namespace="built", subfolder=key, assets_dir=assets_dir
    )


def built_pack_folder(
    source: ModelSpec, target: ModelSpec, assets_dir: str | Path | None = None
) -> Path:
    """The pack folder of a pack built here for this pair (inside ``built_pack_dir``)."""
    return built_pack_dir(source, target, assets_dir) / "pack"


def built_packs(assets_dir: str | Path | None = None) -> list[PackEntry]:
    """The packs built here (``resolve --build``) in huggingface_hub's assets cache."""
    some_pair = cached_assets_path(
        library_name="sgl-kvmap", namespace="built", assets_dir=assets_dir
    )  # huggingface_hub names a folder per pair inside the namespace folder
    root = some_pair.parent
    found = (entry_of(f.parent.name, None, f) for f in sorted(root.glob("*/pack")) if is_pack(f))
    return [entry for entry in found if entry is not None]


def build_missing(
    source: str,
    target: str,
    specs: tuple[ModelSpec, ModelSpec],
    assets_dir: str | Path | None = None,
    recipe: PackRecipe = PackRecipe(),
) -> Path:
    """Fit the pair with its default recipe into ``built_pack_dir``, once: under a lock, a
    second process waits and then finds the pack the first one built."""
    folder = built_pack_folder(*specs, assets_dir)
    with _build_lock(folder):
        if is_pack(folder):
            return folder
        log.warning("building the pack %s -> %s here (this fits the pair)", source, target)
        return _save_built(*build_pack(source, target, None, recipe), folder)


def _build_lock(folder: Path) -> WeakFileLock:
    """The lock a build of the pack ``folder`` holds (beside it, in its pair's folder)."""
    return WeakFileLock(folder.parent / "build.lock")


def _save_built(mapper: KVMapper, summary: dict, folder: Path) -> Path:
    """Save a pack built here, with what its build measured among its metrics."""
    mapper.info["metrics"].update(summary)
    return mapper.save_pretrained(folder, overwrite=True)


def check_pins(
    folder: Path, specs: tuple[ModelSpec, ModelSpec], allow_mismatch: bool = False
) -> None:
    """Refuse the pack at ``folder`` if it was fitted for other models than ``specs``
    (PairMismatchError naming what differs); ``allow_mismatch`` logs instead."""
    mapper = KVMapper.from_pretrained(folder)
    try:
        check_models(mapper, *specs)
    except PairMismatchError as err:
        if not allow_mismatch:
            raise
        log.warning("using %s although it does not match the models: %s", folder, err)


def _fits(folder: Path, specs: tuple[ModelSpec, ModelSpec], allow_mismatch: bool) -> bool:
    """Whether the candidate pack ``folder`` loads and belongs to these models."""
    try:
        check_pins(folder, specs, allow_mismatch)
    except PairMismatchError:
        return False
    except PackError as err:
        log.warning("skipping %s: %s", folder, err)
        return False
    return True


def _matches(entry: PackEntry, specs: tuple[ModelSpec, ModelSpec]) -> bool:
    return (entry.source_fingerprint, entry.target_fingerprint) == (
        specs[0].fingerprint,
        specs[1].fingerprint,
    )


def _local_candidates(specs, cache_dir, assets_dir) -> list[Path]:
    built = built_pack_folder(*specs, assets_dir)
    found = [built] if is_pack(built) else []
    found += [Path(e.where) for e in cached_packs(cache_dir) if _matches(e, specs)]
    return found


def _hub_candidates(specs, namespace, cache_dir, token):
    """Folders of Hub packs for the pair, fetched lazily: the conventional name, then a search."""
    source, target = specs
    namespace = namespace or os.environ.get(NAMESPACE_ENV, DEFAULT_NAMESPACE)
    name = repo_name(
        source.model_id, target.model_id, source.fingerprint, target.fingerprint, target.model_type
    )
    try:
        yield fetch_pack(f"{namespace}/{name}", cache_dir=cache_dir, token=token)
    except PackError as err:
        log.info("%s/%s: %s", namespace, name, err)
    tags = (f"kvmap-source-{source.fingerprint[:12]}", f"kvmap-target-{target.fingerprint[:12]}")
    try:
        entries = hub_packs(*tags, token=token)
    except PackError as err:  # the Hub unreachable: the local cache and a build remain
        log.warning("%s", err)
        return
    for entry in entries:
        if _matches(entry, specs):
            yield fetch_pack(entry.repo_id, revision=entry.commit, cache_dir=cache_dir, token=token)


__all__ = [
    "built_pack_dir",
    "built_pack_folder",
    "built_packs",
    "check_pins",
    "keep_as_built",
    "resolve_mapper",
    "resolve_pack",
    "resolve_pack_pair",
]
