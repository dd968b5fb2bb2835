"""sgl-kvmap's keys in SGLang's ``--hicache-storage-backend-extra-config`` (pure; no sglang).

    {"backend_name": "kvmap", "module_path": "sgl_kvmap.sglang.storage",
     "class_name": "KVMapStorage", "interface_v1": 1, "hicache_storage_pass_prefix_keys": true,
     "inner_backend": "file", "translate": true,
     "peers": [{"model_name": "Qwen/Qwen2.5-Coder-0.5B-Instruct", "pack": "/packs/0.5B_to_1.5B"}]}

Keys SGLang itself reads (file_storage_path, prefetch_threshold, ...) pass through untouched.
Every key of ours is type-checked when the server starts: a wrong type (``"translate":
"false"``) or an unknown peer key is refused with a message, never read as something else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from ..core.errors import KVMapError

BACKEND = {
    "backend_name": "kvmap",
    "module_path": "sgl_kvmap.sglang.storage",
    "class_name": "KVMapStorage",
}
INNER_BACKENDS = ("file", "mooncake")
SINK_POLICIES = ("translate", "native", "prime")
NATIVE_SINKS = ("native", "prime")  # policies under which a prefix's first page is never translated
FIRST_LAYER_POLICIES = ("mapped", "exact")
DERIVED_POLICIES = ("withhold", "share")
MAX_CONCURRENT_TRANSLATIONS = 64
# The gap closed a pack records (``EvalReport.summary()``, written by ``sgl-kvmap eval --record``
# and the demo): with the target's tail recomputed, and translating every token.
GAP_CLOSED_TAIL, GAP_CLOSED = "eval_gap_closed_tail", "eval_gap_closed"
SERVED_FIGURES = ("swaps", "retention", "gap_closed", "gap_closed_low")


def served_key(figure: str, tail: bool) -> str:
    """The pack metric under which ``sgl-kvmap bench --record`` keeps a figure of served swaps
    (one of ``SERVED_FIGURES``) for engines that recompute a tail (``tail``) or translate
    every page: ``served_gap_closed_tail_low`` for the low end of the gap-closed interval
    with a tail."""
    if figure not in SERVED_FIGURES:
        raise ValueError(f"unknown served figure {figure!r}")
    base, low = (figure.removesuffix("_low"), "_low") if figure.endswith("_low") else (figure, "")
    return f"served_{base}{'_tail' if tail else ''}{low}"


# The same, measured on served swaps (``sgl-kvmap bench --record``): the low end of the gap
# closed interval, with the tail, page size and sinks policy the engines served them with.
SERVED_GAP_CLOSED_TAIL = served_key("gap_closed_low", tail=True)
SERVED_GAP_CLOSED = served_key("gap_closed_low", tail=False)
SERVED_TAIL, SERVED_PAGE_SIZE, SERVED_SINKS = "served_tail", "served_page_size", "served_sinks"
SERVED_FIRST_LAYER = "served_first_layer"  # absent: recorded before it was a choice, "mapped"
SERVED_DERIVED = "served_derived"  # absent: recorded before it was a choice, "withhold"
# the library's hand-off as the engines serve it (``sgl-kvmap eval --record``, the demo): its
# page size and tail (tokens); its figures are ``eval_gap_closed_served`` and
# ``eval_retention_served``
EVAL_SERVED_PAGE_SIZE, EVAL_SERVED_TAIL = "eval_served_page_size", "eval_served_tail"
DEFAULT_QUALITY_FLOOR = 0.0  # better than staying on the source model
# a pack whose target does not beat its source has no gap to close: its retention is read
DEFAULT_RETENTION_FLOOR = 0.95
# the ends of the retention keys ``recorded_retention`` reads (served, as served, the library's)
RETENTION_KEYS = ("retention", "retention_tail", "retention_served")
# A request whose id starts so is computed whole, never primed (``priming``): ``sgl-kvmap warm``
# serves the opening every session shares this way, so each engine holds all of it as its own.
NATIVE_REQUEST_PREFIX = "sgl-kvmap-native-"


@dataclass(frozen=True)
class PeerSettings:
    """A peer engine whose stored pages this engine may translate. model_name: its served model
    name (its identity in the store); pack: the mapper pack folder, peer -> this model;
    model_path: where its config and tokenizer are (default: model_name); tp_size: its tensor
    parallel size (its pages are stored per rank). How the peer stores its pages (layout,
    dtype, geometry) is read from the record written beside each page, not configured."""

    model_name: str
    pack: str
    model_path: str = ""
    tp_size: int = 1

    def __post_init__(self) -> None:
        _check_types(self, f"peer {self.model_name!r}")
        if not self.model_name or not self.pack:
            raise KVMapError("a peer needs a model_name and a pack")
        if self.tp_size < 1:
            raise KVMapError(f"peer {self.model_name}: tp_size {self.tp_size} < 1")
        if not self.model_path:
            object.__setattr__(self, "model_path", self.model_name)

    @classmethod
    def from_dict(cls, entry: Any) -> PeerSettings:
        if not isinstance(entry, dict):
            raise KVMapError(f"a peer entry must be a JSON object, got {entry!r}")
        unknown = sorted(set(entry) - {f.name for f in fields(cls)})
        if unknown:
            raise KVMapError(
                f"unknown peer key(s) {unknown} (known: {[f.name for f in fields(cls)]}); a "
                "peer's page layout and dtype are recorded beside its pages, not configured"
            )
        missing = [name for name in ("model_name", "pack") if name not in entry]
        if missing:
            raise KVMapError(f"peer entry {entry!r} has no {' and no '.join(missing)}")
        return cls(**entry)


@dataclass(frozen=True)
class StorageSettings:
    """inner_backend: the built-in store for this engine's own pages and its peers' ("file" on
    one host, "mooncake" across hosts: SGLang's keys for it, such as master_server_address,
    pass through). translate: serve translated pages at all (off: a transparent wrapper that
    still records its pages for others). sinks: "native" translates only after a first page
    this engine holds as its own, so a prefix's first page, its attention sinks, is always
    computed here (and a shared opening served on this engine, ``sgl-kvmap warm``, stays its
    own KV), and a swap whose first page it holds nowhere is prefilled; "prime" (the default)
    does the same, and has the engine compute such a swap's first page before it, so the rest
    is translated (``priming``); "translate" also translates a prefix's first page when this
    engine has no copy of its own (a swap into a fresh engine then translates from page 0, and
    every later request sharing those pages reads them translated). tail_pages: the last pages of a
    translatable run that this engine computes itself instead (the hand-off's recomputed tail;
    0 translates every page a peer stored). first_layer: "mapped" (the default) serves the
    pack's map of layer 0; "exact" serves this model's own layer 0 for every translated token
    whose id the peer's stored layer-0 values give back (``models.first_layer``: it needs both
    models' weight files on this host, read once when the server starts; a peer without them
    is translated with layer 0 mapped, counted ``first_layer_unavailable``). derived: what
    happens to the pages this engine computes over KV it received translated, which are never
    stored as its own: "withhold" (the default) stores them nowhere; "share" stores them
    apart, under the page's key plus ``.derived`` with their records, never read as this
    model's own, and translates peers' pages stored so, so a swap back to a peer after a swap
    into this engine translates what this engine computed (a second-generation translation).
    concurrent_translations: swaps translated at once
    (each on a worker thread of its own; a swap arriving while all are busy is prefilled,
    counted); the prefetch deadline ``sglang-args`` sets covers this many at once.
    quality_floor: the gap closed (``sgl-kvmap eval``: (translated - source) / (target -
    source) in top-1 accuracy) a peer's pack must record above which this engine translates its
    pages; a pack at or below it, or that records none, is not used (counted
    ``pack_below_floor``: SGLang prefills). The default, 0, asks a translated prefix to be
    better than staying on the source model; None translates with any pack (and reads no
    retention either). retention_floor: for a pack whose target does not beat its source (no
    gap to close, as down a family), the retention (translated accuracy over the target's own)
    it must record, at least.
    interface_v1: SGLang's own key, which must be on (positions and provenance come with the v1
    calls). model_path: this engine's model, if its served name is not a path or Hub id.
    stats_path: a folder where the engine keeps its counters as JSON (one file per TP rank,
    ``<served name>_<rank>_<size>.json``, rewritten as they change; "" for none).
    audit_translations: also store every translated page this engine receives, in its own
    store under the page's key plus ``.translated`` (never read as a page of any model), to
    check translations against their source afterwards."""

    inner_backend: str = "file"
    translate: bool = False
    # a translated first page is reused by every later request sharing it (docs/LOG.md, "a
    # warm opening that was translated")
    sinks: str = "prime"
    # 48 tokens at sglang-args' 16-token pages (docs/LOG.md, "the tail at 16-token pages")
    tail_pages: int = 3
    first_layer: str = "mapped"
    derived: str = "withhold"
    concurrent_translations: int = 2
    interface_v1: bool = False
    model_path: str = ""
    stats_path: str = ""
    audit_translations: bool = False
    quality_floor: float | None = DEFAULT_QUALITY_FLOOR
    retention_floor: float = DEFAULT_RETENTION_FLOOR
    peers: tuple[PeerSettings, ...] = ()

    def __post_init__(self) -> None:
        _check_types(self, "the sgl-kvmap extra config")
        if self.inner_backend not in INNER_BACKENDS:
            raise KVMapError(
                f"inner_backend {self.inner_backend!r} is not supported by sgl-kvmap (only "
                f"{', '.join(INNER_BACKENDS)}): 3FS and the other stores are not wired and "
                "tested against a real server yet"
            )
        if self.tail_pages < 0:
            raise KVMapError(f"tail_pages must be >= 0, got {self.tail_pages}")
        if not 1 <= self.concurrent_translations <= MAX_CONCURRENT_TRANSLATIONS:
            raise KVMapError(
                f"concurrent_translations must be 1..{MAX_CONCURRENT_TRANSLATIONS}, got "
                f"{self.concurrent_translations}"
            )
        if self.sinks not in SINK_POLICIES:
            raise KVMapError(f"sinks must be one of {SINK_POLICIES}, got {self.sinks!r}")
        if self.first_layer not in FIRST_LAYER_POLICIES:
            raise KVMapError(
                f"first_layer must be one of {FIRST_LAYER_POLICIES}, got {self.first_layer!r}"
            )
        if self.derived not in DERIVED_POLICIES:
            raise KVMapError(f"derived must be one of {DERIVED_POLICIES}, got {self.derived!r}")
        if type(self.retention_floor) not in (int, float) or not 0 <= self.retention_floor <= 1:
            raise KVMapError(
                f"retention_floor must be a number from 0 to 1, got {self.retention_floor!r}"
            )
        floor = self.quality_floor
        if floor is not None and (
            type(floor) not in (int, float) or not -1 <= floor <= 1 or not math.isfinite(floor)
        ):
            raise KVMapError(
                f"quality_floor must be a number from -1 to 1 (a gap closed) or null, got {floor!r}"
            )

    def floor_refusal(self, metrics: dict[str, Any], page_size: int) -> str | None:
        """Why a pack whose recorded ``metrics`` are these may not be used by an engine of
        ``page_size``-token pages (None: it may): the gap closed it records for this engine
        (``recorded_gap_closed``) must be above ``quality_floor``; a pack whose target does
        not beat its source (no gap to close) must record a retention of at least
        ``retention_floor`` instead."""
        if self.quality_floor is None:
            return None
        key, gap = self.floor_figure(metrics, page_size)
        if key.endswith(RETENTION_KEYS):
            return self._retention_refusal(key, gap, page_size)
        if gap is None:
            return (
                f"the pack records no measured {key}, so it cannot be shown to clear the quality "
                f"floor {self.quality_floor:g}: run `sgl-kvmap eval PACK --record --page-size "
                f"{page_size} --tail-pages {self.tail_pages}` (or `sgl-kvmap bench --record` on "
                "your traffic), or serve with --quality-floor none"
            )
        if gap <= self.quality_floor:
            return (
                f"the pack's measured {key} {gap:.3f} is not above the quality floor "
                f"{self.quality_floor:g} (0: staying on the source model does as well)"
            )
        return None

    def floor_figure(self, metrics: dict[str, Any], page_size: int) -> tuple[str, float | None]:
        """The figure the floor reads of a pack's ``metrics``, by its key: its gap closed
        (``recorded_gap_closed``), or, for a pack whose target does not beat its source (no
        gap to close), its retention (``recorded_retention``)."""
        key, gap = self.recorded_gap_closed(metrics, page_size)
        if gap is None and no_gap_to_close(metrics):
            return self.recorded_retention(metrics, page_size)
        return key, gap

    def _retention_refusal(self, key: str, retention: float | None, page_size: int) -> str | None:
        if retention is None:
            return (
                f"the pack's target does not beat its source (no gap to close) and it records "
                f"no measured {key} to check against the retention floor "
                f"{self.retention_floor:g}: run `sgl-kvmap eval PACK --record --page-size "
                f"{page_size} --tail-pages {self.tail_pages}`, or serve with --quality-floor none"
            )
        if retention < self.retention_floor:
            return (
                f"the pack's target does not beat its source (no gap to close) and its measured "
                f"{key} {retention:.3f} is below the retention floor {self.retention_floor:g}"
            )
        return None

    def recorded_gap_closed(
        self, metrics: dict[str, Any], page_size: int
    ) -> tuple[str, float | None]:
        """The gap closed a pack's ``metrics`` record for an engine of these settings and
        ``page_size``-token pages, by its key (None when absent or not a finite number), the
        first that applies of: the figure of served swaps (``sgl-kvmap bench --record``) when
        they were served as this engine serves (the same tail in tokens, page size, sinks,
        first-layer and derived-page policies); the library's figure of the hand-off as served
        (``sgl-kvmap eval --record``, ``eval_gap_closed_served``) when measured at this page
        size and tail with a first page the target computes (sinks "native" or "prime"); the
        library's figure of its own hand-off: with its tail when this engine recomputes one,
        else of the whole translation."""
        return self._recorded(metrics, page_size, "gap_closed")

    def recorded_retention(
        self, metrics: dict[str, Any], page_size: int
    ) -> tuple[str, float | None]:
        """The retention a pack's ``metrics`` record for this engine, chosen as
        ``recorded_gap_closed`` chooses (served swaps' point estimate, else the library's)."""
        return self._recorded(metrics, page_size, "retention")

    def _recorded(self, metrics: Any, page_size: int, figure: str) -> tuple[str, float | None]:
        metrics = metrics if isinstance(metrics, dict) else {}
        tail = bool(self.tail_pages)
        served = served_key("gap_closed_low" if figure == "gap_closed" else figure, tail)
        served_here = (
            metrics.get(SERVED_PAGE_SIZE) == page_size
            and _sinks_alike(metrics.get(SERVED_SINKS), self.sinks)
            and metrics.get(SERVED_FIRST_LAYER, "mapped") == self.first_layer
            and metrics.get(SERVED_DERIVED, "withhold") == self.derived
            and (not self.tail_pages or metrics.get(SERVED_TAIL) == self.tail_pages * page_size)
        )
        if served_here and _finite(metrics.get(served)) is not None:
            return served, _finite(metrics[served])
        as_served = f"eval_{figure}_served"
        evaluated_here = (
            metrics.get(EVAL_SERVED_PAGE_SIZE) == page_size
            and metrics.get(EVAL_SERVED_TAIL) == self.tail_pages * page_size
            and self.sinks in NATIVE_SINKS
        )
        if evaluated_here and _finite(metrics.get(as_served)) is not None:
            return as_served, _finite(metrics[as_served])
        library = f"eval_{figure}_tail" if tail else f"eval_{figure}"
        return library, _finite(metrics.get(library))

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> StorageSettings:
        """Read sgl-kvmap's keys from SGLang's extra config (other keys are SGLang's)."""
        values = {f.name: extra[f.name] for f in fields(cls) if f.name in extra}
        peers = values.get("peers", [])
        if not isinstance(peers, list):
            raise KVMapError(f"peers must be a list of objects, got {peers!r}")
        values["peers"] = tuple(PeerSettings.from_dict(peer) for peer in peers)
        if "interface_v1" in values:
            values["interface_v1"] = _flag(values["interface_v1"], "interface_v1")
        return cls(**values)

    def to_extra_config(self, **sglang_keys: Any) -> dict[str, Any]:
        """The extra-config JSON object for these settings (plus SGLang's own keys)."""
        out: dict[str, Any] = dict(BACKEND)
        out.update(sglang_keys)
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "peers":
                value = [{g.name: getattr(p, g.name) for g in fields(p)} for p in value]
            out[f.name] = value
        out["interface_v1"] = 1 if self.interface_v1 else 0
        return out


def prefetch_threshold_keys(tokens: int | None) -> dict[str, int]:
    """SGLang's extra-config key for a prefetch threshold other than its own (None: SGLang's)."""
    return {} if tokens is None else {"prefetch_threshold": tokens}


def _sinks_alike(recorded: Any, serving: str) -> bool:
    """Whether swaps served under sinks policy ``recorded`` were served as under ``serving``:
    "native" and "prime" both serve a first page the engine computed (priming only makes more
    swaps translate)."""
    return recorded == serving or (recorded in NATIVE_SINKS and serving in NATIVE_SINKS)


def no_gap_to_close(metrics: Any) -> bool:
    """Whether a pack's ``metrics`` say its target does not beat its source: the library's
    accuracy of the source at least the target's own (a gap closed is then undefined)."""
    metrics = metrics if isinstance(metrics, dict) else {}
    source = _finite(metrics.get("eval_source_accuracy"))
    target = _finite(metrics.get("eval_reference_accuracy"))
    return source is not None and target is not None and source >= target


def _finite(value: Any) -> float | None:
    """``value`` as a float when it is a finite number (an int too large for a float is not)."""
    if type(value) not in (int, float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


_TYPES = {"str": str, "bool": bool, "int": int}


def _check_types(settings, where: str) -> None:
    for f in fields(settings):
        want = _TYPES.get(f.type)
        value = getattr(settings, f.name)
        if want is not None and (type(value) is not want):
            raise KVMapError(f"{where}: {f.name} must be a JSON {_json_name(want)}, got {value!r}")


def _flag(value: Any, name: str) -> bool:
    """SGLang's 0/1 (or true/false) switches; anything else is refused."""
    if type(value) is bool or (type(value) is int and value in (0, 1)):
        return bool(value)
    raise KVMapError(f"{name} must be 0, 1, true or false, got {value!r}")


def _json_name(python_type: type) -> str:
    return {str: "string", bool: "true/false", int: "integer"}[python_type]
