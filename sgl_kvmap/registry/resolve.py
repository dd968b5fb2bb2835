"""resolve: the pack for a model pair, from the local cache, else the Hub, else built here.

Order: a pack built here before (in huggingface_hub's assets cache), a Hub pack already in the
Hugging Face cache, the pair's conventional repo on the Hub, a tag search on the Hub with the
fingerprints matched here, and, when asked (``build``), a fit with the recipe asked for.
Every candidate is checked against the models in use (their config and tokenizer
fingerprints, read without loading weights); a mismatch is refused with what differs unless
``allow_mismatch`` says otherwise, which is logged. ``allow_mismatch`` never accepts a pack of
another KV geometry (layers, KV heads, head dim of either model): its tensors cannot fill the
models' caches. A candidate that cannot be fetched or read (no valid kvmap.json, a malformed
card, a damaged download) is skipped with one logged line, and the next one is tried.

Looking up packs writes nothing: a read-only cache serves the packs it holds.

Packs built here are kept by pair and recipe: ``built/{pair}/recipe-{key}/pack``, where ``key``
is ``PackRecipe.key()`` (a readable name and a hash of the whole recipe). A lookup that states
a recipe (``recipe``; a build always states one, the default recipe unless told) takes only
that recipe's pack built here, so a cheap build never stands in for another recipe's. A lookup
that states none takes any pack built here for the pair: the default recipe's first, then the
other recipes' (the largest calibration budget first), then packs of unknown recipe. Those sit
at ``built/{pair}/pack``, where packs were built before recipes keyed the cache; they are never
taken for a stated recipe and never replaced. Published packs (cached or on the Hub) are taken
as their publisher made them, whatever the recipe; ``pack_recipe`` says how any pack was made.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import replace
from pathlib import Path

from huggingface_hub import constants
from huggingface_hub.constants import is_offline_mode
from huggingface_hub.utils import WeakFileLock

from ..core.environment import setting
from ..core.errors import PackError, PairMismatchError
from ..core.mapper import KVMapper
from ..core.pack import is_pack, read_config, same_maps
from ..core.spec import ModelSpec, check_models, check_pair, spec_from_pretrained
from ..fitting.build import build_pack, build_pack_pair
from ..fitting.config import PackRecipe, recipe_summary
from ..fitting.distributed import fit_under_torchrun, load_pair
from ..models.placement import Loading, Placement
from .hub import check_caches, checked_namespace
from .naming import repo_name
from .packs import PackEntry, cached_packs, entry_of, fetch_pack, hub_packs

log = logging.getLogger(__name__)

NAMESPACE_ENV = "KVMAP_HUB_NAMESPACE"
DEFAULT_NAMESPACE = "sgl-kvmap"  # where published packs are looked for by conventional name
RECIPE_PREFIX = "recipe-"  # a built pack's recipe folder: recipe-{PackRecipe.key()}
PACK_FOLDER = "pack"  # the pack inside a recipe folder; directly in a pair's folder: unknown recipe


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
    recipe: PackRecipe | None = None,
    nproc: int = 1,
    placement: Placement | None = None,
) -> Path:
    """The local folder of the pack for ``source`` -> ``target`` (see ``resolve_mapper``).

    ``cache_dir``: huggingface_hub's cache of Hub packs; ``assets_dir``: its assets cache, where
    built packs go; ``recipe``: the recipe asked for, the only one whose pack built here is
    taken and the one a build uses. None states none: then any pack built here is taken (the
    default recipe's first, see the module docstring), and ``build`` states the default.
    ``nproc``: processes a build captures its statistics in (more than 1: under torchrun);
    ``placement``: a build loads each model across its process's devices so (``fit --device-map
    auto``: the same pack, for models one device cannot hold)."""
    namespace = checked_namespace(namespace or setting("HUB_NAMESPACE", DEFAULT_NAMESPACE))
    check_caches(cache_dir, assets_dir)
    specs = spec_from_pretrained(source), spec_from_pretrained(target)
    check_pair(*specs)
    offline = local_files_only or is_offline_mode()
    wanted = _stated(recipe, build)
    for folder in _local_candidates(specs, cache_dir, assets_dir, wanted):
        if _fits(folder, specs, allow_mismatch):
            return folder
    if not offline:
        for folder in _hub_candidates(specs, namespace, cache_dir, token):
            if _fits(folder, specs, allow_mismatch):
                return folder
    if build:
        return build_missing(source, target, specs, assets_dir, wanted, nproc, placement)
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
    a: str, b: str, *, build: bool = False, recipe: PackRecipe | None = None, **options
) -> tuple[Path, Path]:
    """The packs a -> b and b -> a, each as ``resolve_pack`` finds it for ``recipe`` (``options``
    as it takes them). With ``build``, missing packs are built; when both are, one calibration
    pass fits both (``fitting.build.build_pack_pair``)."""
    directions = ((a, b), (b, a))
    wanted = _stated(recipe, build)
    found: list[Path | None] = []
    for source, target in directions:
        try:
            found.append(resolve_pack(source, target, recipe=wanted, **options))
        except PackError:
            if not build:
                raise
            found.append(None)
    assets_dir = options.get("assets_dir")
    if found == [None, None]:
        return build_missing_pair(a, b, assets_dir, wanted)
    specs = spec_from_pretrained(a), spec_from_pretrained(b)
    pair = [
        folder or build_missing(source, target, pair_specs, assets_dir, wanted)
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
        built_pack_folder(specs[0], specs[1], recipe, assets_dir),
        built_pack_folder(specs[1], specs[0], recipe, assets_dir),
    )
    with contextlib.ExitStack() as locks:
        for folder in sorted(folders):  # one order for every process: no deadlock
            locks.enter_context(_build_lock(folder))
        if not all(is_pack(folder) for folder in folders):
            log.warning(
                "building the packs %s <-> %s here with recipe %s (this fits the pair)",
                a,
                b,
                recipe.key(),
            )
            for (mapper, summary), folder in zip(build_pack_pair(a, b, None, recipe), folders):
                if not is_pack(folder):
                    _save_built(mapper, summary, folder)
    return folders


def keep_as_built(
    mapper: KVMapper, recipe: PackRecipe, assets_dir: str | Path | None = None
) -> Path | None:
    """Keep ``mapper``, made as ``recipe`` says, as the pack built here for its pair with that
    recipe (where ``resolve`` looks first), unless another pack is there already; returns its
    folder, or None when another was there. A pack of the same maps (the same fit, measured
    again: the demo run twice) is replaced, so it carries the newer figures."""
    folder = built_pack_folder(mapper.source, mapper.target, recipe, assets_dir)
    with _build_lock(folder):
        if not is_pack(folder):
            return mapper.save_pretrained(folder)
        kept = KVMapper.from_pretrained(folder)
        if not same_maps(kept, mapper) or kept.info.get("metrics") == mapper.info.get("metrics"):
            return None
        return mapper.save_pretrained(folder, overwrite=True)


def built_pack_dir(
    source: ModelSpec, target: ModelSpec, assets_dir: str | Path | None = None
) -> Path:
    """The folder of the packs built here for this pair (huggingface_hub's assets cache; not
    created here: a build makes it)."""
    name = repo_name(
        source.model_id, target.model_id, source.fingerprint, target.fingerprint, target.model_type
    )
    return _built_root(assets_dir) / f"{name}-{source.fingerprint[:8]}{target.fingerprint[:8]}"


def built_pack_folder(
    source: ModelSpec, target: ModelSpec, recipe: PackRecipe, assets_dir: str | Path | None = None
) -> Path:
    """The pack folder of the pack built here for this pair with ``recipe`` (a folder per
    recipe inside ``built_pack_dir``, named by its key)."""
    recipe_folder = f"{RECIPE_PREFIX}{recipe.key()}"
    return built_pack_dir(source, target, assets_dir) / recipe_folder / PACK_FOLDER


def built_packs(assets_dir: str | Path | None = None) -> list[PackEntry]:
    """The packs built here (``resolve --build``, the demo's) in huggingface_hub's assets cache,
    pair by pair, each with its recipe (``pack_recipe``)."""
    root = _built_root(assets_dir)
    keyed = root.glob(f"*/{RECIPE_PREFIX}*/{PACK_FOLDER}")
    folders = sorted([*keyed, *root.glob(f"*/{PACK_FOLDER}")], key=_pair_order)
    found = (_built_entry(folder, assets_dir) for folder in folders if is_pack(folder))
    return [entry for entry in found if entry is not None]


def pack_recipe(folder: Path, assets_dir: str | Path | None = None) -> str:
    """How the pack at ``folder`` was made, in words: a pack built here by its recipe's key
    (and whether that is the default recipe), then what its kvmap.json records; a pack built
    here before recipes keyed the cache as of unknown recipe; any other pack by its record."""
    folder = Path(folder).resolve()
    summary = recipe_summary(read_config(folder).get("calibration", {}))
    key = _recipe_key(folder)
    if folder.name != PACK_FOLDER or _pair_of(folder).parent != _built_root(assets_dir):
        return summary
    if key is None:
        return f"unknown (built here before packs were kept by recipe; it records {summary})"
    return f"{key}{' (the default)' if key == PackRecipe().key() else ''}: {summary}"


def build_missing(
    source: str,
    target: str,
    specs: tuple[ModelSpec, ModelSpec],
    assets_dir: str | Path | None = None,
    recipe: PackRecipe = PackRecipe(),
    nproc: int = 1,
    placement: Placement | None = None,
) -> Path:
    """Fit the pair as ``recipe`` says into its folder in ``built_pack_dir``, once: under a
    lock, a second process waits and then finds the pack the first one built. With ``nproc``
    above 1 the fit runs under torchrun in that many processes (``fitting.distributed``);
    ``placement``: each process loads each model across its devices so (accelerate)."""
    folder = built_pack_folder(*specs, recipe, assets_dir)
    with _build_lock(folder):
        if is_pack(folder):
            return folder
        log.warning(
            "building the pack %s -> %s here with recipe %s (this fits the pair)",
            source,
            target,
            recipe.key(),
        )
        if nproc > 1:
            fit_under_torchrun(source, target, folder, recipe, nproc, placement)
            return folder
        if placement is not None:
            models = load_pair(source, target, Loading(placement=placement))
            return _save_built(*build_pack(*models, None, recipe), folder)
        return _save_built(*build_pack(source, target, None, recipe), folder)


def _stated(recipe: PackRecipe | None, build: bool) -> PackRecipe | None:
    """The recipe a lookup states: the one given; else, for a build, the default; else none."""
    return PackRecipe() if recipe is None and build else recipe


def _built_root(assets_dir: str | Path | None) -> Path:
    """The folder that holds a folder per pair of packs built here: huggingface_hub's
    ``cached_assets_path`` namespace folder, named as it names it, without creating it."""
    root = Path(assets_dir or constants.HF_ASSETS_CACHE).expanduser().resolve()
    return root / "sgl-kvmap" / "built"


def _recipe_key(folder: Path) -> str | None:
    """The recipe key of a built pack's folder (None: not in a recipe folder)."""
    parent = Path(folder).parent.name
    if Path(folder).name != PACK_FOLDER or not parent.startswith(RECIPE_PREFIX):
        return None
    return parent[len(RECIPE_PREFIX) :]


def _pair_order(folder: Path) -> tuple:
    """Packs built here in list order: by pair, then by recipe key, unknown recipes last."""
    key = _recipe_key(folder)
    return (_pair_of(folder).name, key is None, key or "")


def _built_entry(folder: Path, assets_dir: str | Path | None) -> PackEntry | None:
    entry = entry_of(_pair_of(folder).name, None, folder)
    return entry and replace(entry, recipe=pack_recipe(folder, assets_dir))


def _pair_of(folder: Path) -> Path:
    """The pair's folder of a built pack's folder."""
    return folder.parents[1] if _recipe_key(folder) is not None else folder.parent


def _built_for_pair(specs: tuple[ModelSpec, ModelSpec], assets_dir) -> list[Path]:
    """The pair's packs built here, in the order a lookup that states no recipe takes them:
    the default recipe's, then the others' by calibration budget, then the unknown recipe's."""
    pair = built_pack_dir(*specs, assets_dir)
    default = built_pack_folder(*specs, PackRecipe(), assets_dir)
    others = sorted(
        (f for f in pair.glob(f"{RECIPE_PREFIX}*/{PACK_FOLDER}") if f != default), key=_budget
    )
    return [f for f in (default, *others, pair / PACK_FOLDER) if is_pack(f)]


def _budget(folder: Path) -> tuple:
    """Sort key of a built pack: more calibration tokens first, then more tuning steps."""
    try:
        record = read_config(folder).get("calibration", {})
    except PackError:
        record = {}  # taken last among its kind; the lookup itself will say what is wrong
    tokens, tuning = record.get("tokens"), record.get("tuning")
    steps = tuning.get("steps") if isinstance(tuning, dict) else 0
    return (
        -(tokens if isinstance(tokens, int) else 0),
        -(steps if isinstance(steps, int) else 0),
        folder.parent.name,
    )


def _build_lock(folder: Path) -> WeakFileLock:
    """The lock a build of the pack ``folder`` holds (beside it, in its recipe's folder)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    return WeakFileLock(folder.parent / "build.lock")


def _save_built(mapper: KVMapper, summary: dict, folder: Path) -> Path:
    """Save a pack built here, with what its build measured among its metrics."""
    mapper.info["metrics"].update(summary)
    return mapper.save_pretrained(folder, overwrite=True)


GEOMETRY = ("num_layers", "num_kv_heads", "head_dim")  # what a pack's tensors are shaped by


def check_pins(
    folder: Path, specs: tuple[ModelSpec, ModelSpec], allow_mismatch: bool = False
) -> None:
    """Refuse the pack at ``folder`` if it was fitted for other models than ``specs``
    (PairMismatchError naming what differs); ``allow_mismatch`` logs instead, except for
    another KV geometry (``GEOMETRY`` of either model), which is always refused."""
    mapper = KVMapper.from_pretrained(folder)
    check_geometry(folder, mapper, specs)
    try:
        check_models(mapper, *specs)
    except PairMismatchError as err:
        if not allow_mismatch:
            raise
        log.warning("using %s although it does not match the models: %s", folder, err)


def check_geometry(folder: Path, mapper: KVMapper, specs: tuple[ModelSpec, ModelSpec]) -> None:
    """Refuse (PairMismatchError) a pack whose KV geometry is not the models': its maps read
    and write caches of other shapes."""
    for role, fitted, given in zip(("source", "target"), (mapper.source, mapper.target), specs):
        differs = [
            f"{name} {getattr(fitted, name)} vs {getattr(given, name)}"
            for name in GEOMETRY
            if getattr(fitted, name) != getattr(given, name)
        ]
        if differs:
            raise PairMismatchError(
                f"{folder}: this pack's {role} has another KV geometry than {given.model_id} "
                f"({', '.join(differs)}); no pack of these shapes can serve it, even with "
                "--allow-mismatch. Fit a pack for this pair with `sgl-kvmap fit`."
            )


def _fits(folder: Path, specs: tuple[ModelSpec, ModelSpec], allow_mismatch: bool) -> bool:
    """Whether the candidate pack ``folder`` loads and belongs to these models."""
    try:
        check_pins(folder, specs, allow_mismatch)
    except PairMismatchError as err:
        log.info("not using %s: %s", folder, err)
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


def _local_candidates(specs, cache_dir, assets_dir, recipe: PackRecipe | None) -> list[Path]:
    """Packs built here for ``recipe`` (None: for any, ``_built_for_pair``), then cached Hub
    packs of the pair."""
    if recipe is None:
        found = _built_for_pair(specs, assets_dir)
    else:
        built = built_pack_folder(*specs, recipe, assets_dir)
        found = [built] if is_pack(built) else []
    return found + [Path(e.where) for e in cached_packs(cache_dir) if _matches(e, specs)]


def _hub_candidates(specs, namespace, cache_dir, token):
    """Folders of Hub packs for the pair, fetched lazily: the conventional name, then a search."""
    source, target = specs
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
        if not _matches(entry, specs):
            continue
        try:
            yield fetch_pack(entry.repo_id, revision=entry.commit, cache_dir=cache_dir, token=token)
        except PackError as err:  # a repo tagged for the pair that holds no valid pack
            log.warning("skipping %s: %s", entry.repo_id, err)


__all__ = [
    "built_pack_dir",
    "built_pack_folder",
    "built_packs",
    "check_pins",
    "keep_as_built",
    "pack_recipe",
    "resolve_mapper",
    "resolve_pack",
    "resolve_pack_pair",
]
