"""``sgl-kvmap bench``: the workload routed by every policy, replayed in every mode.

A policy that swaps nothing is replayed once (reprefill: no mode changes a request that stays on
its model's own cache). Every other policy is replayed in reprefill first (its answers are the
quality reference), then in each translating mode, each replay on fresh engines and a fresh
store (``replay.replay``).
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import date
from pathlib import Path

from ..core.errors import KVMapError, PackError
from ..core.files import replacing_folder, writable_place
from ..fitting.config import CalibrationConfig, PackRecipe
from ..sglang.launch import PREFETCH_THRESHOLD, PrefetchDeadline
from ..sglang.settings import INNER_BACKENDS, StorageSettings
from .records import MODES, REFERENCE_MODE, RequestRecord
from .replay import MODE_SETTINGS, Deployment, ReplayPlan, replay
from .routing import DEFAULT_ROUTER_TOKENS, parse_policy, swapped
from .workload import Turn, WorkloadConfig, ideal_reuse, shared_opening

# Packs the default run can build in minutes on a CPU when none is cached or on the Hub: both
# directions from one pass over a quarter of the calibration default, 4 source layers per
# target layer (no search over k or rank), not tuned. Better packs (`sgl-kvmap fit`, the Hub)
# are used whenever the registry has them.
BENCH_RECIPE = PackRecipe(CalibrationConfig(tokens=4096, top_k=4), tuning=None)
# one policy of each kind that swaps often enough to measure on the default slice (swap-0.1 and
# swap-0.25 are there to ask for); with every mode this keeps the default run within minutes
BENCH_POLICIES = (
    "sticky",
    "alternate",
    "swap-0.5",
    "escalate-2",
    f"router-{DEFAULT_ROUTER_TOKENS}",
)
STORE_LINES = {
    "file": "file (SGLang's file store in a fresh folder per replay)",
    "mooncake": "mooncake (a fresh mooncake_master per replay on 127.0.0.1; each engine its own "
    "client over TCP, mounting room for every page)",
}
RECORDS_FILE = "records.jsonl"
RUN_FILE = "run.json"


@dataclass(frozen=True)
class BenchConfig:
    """What one benchmark run replays. policies: routing policy names (``routing``); modes: how
    swapped requests are served (``records.MODES``; reprefill always runs, it is the reference);
    quality_tokens: the greedy answer judged on swapped requests; device_tokens: each engine's
    device KV pool (its host pool is twice that, SGLang's default ratio); deadline: SGLang's
    prefetch stop policy and deadline (what ``sglang-args`` sets: measured on the machine by
    ``launch.measured_deadline``); prefetch_threshold: tokens a prefetch needs (as ``sglang-args``
    sets it; None: SGLang's own); quality_floor: the engines' floor on the gap closed a
    pack records (``StorageSettings.quality_floor``; None, the default here, measures what
    translation does with any pack, where ``sglang-args`` would keep a pack below its floor
    unused); tail_pages: the pages the ``tail`` mode recomputes; warm_opening: every engine
    serves the slice's shared opening (``workload.shared_opening``) before the replay, so a
    swap's first pages are its own; sinks: whether the engines may translate a prefix's first
    page (``StorageSettings.sinks``); first_layer: whether they serve the pack's map of layer 0
    or their own for translated tokens (``StorageSettings.first_layer``); derived: whether they
    share the pages they compute over translated KV for their peers to translate
    (``StorageSettings.derived``); store: the store the
    engines share, a fresh one for each replay (``replay.fresh_store``: ``file``, or
    ``mooncake``, a local master)."""

    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    policies: tuple[str, ...] = BENCH_POLICIES
    modes: tuple[str, ...] = MODES
    quality_tokens: int = 8
    device_tokens: int = 8192
    seed: int = 0
    deadline: PrefetchDeadline = field(default_factory=PrefetchDeadline)
    prefetch_threshold: int | None = PREFETCH_THRESHOLD
    quality_floor: float | None = None
    tail_pages: int = MODE_SETTINGS["tail"]["tail_pages"]
    warm_opening: bool = True
    sinks: str = StorageSettings.sinks
    first_layer: str = StorageSettings.first_layer
    derived: str = StorageSettings.derived
    store: str = "file"

    def __post_init__(self) -> None:
        for name in self.policies:
            parse_policy(name)
        StorageSettings(  # their checks
            sinks=self.sinks, first_layer=self.first_layer, derived=self.derived
        )
        if self.store not in INNER_BACKENDS:
            raise KVMapError(
                f"unknown store {self.store!r}; stores are {', '.join(INNER_BACKENDS)}"
            )
        unknown = sorted(set(self.modes) - set(MODES))
        if unknown or not self.modes:
            raise KVMapError(f"unknown mode(s) {unknown}; modes are {', '.join(MODES)}")
        if isinstance(self.tail_pages, bool) or not isinstance(self.tail_pages, int):
            raise KVMapError(f"tail_pages must be a whole number, got {self.tail_pages!r}")
        if self.tail_pages < 1:
            raise KVMapError(f"tail_pages of the tail mode must be >= 1, got {self.tail_pages}")
        if self.quality_tokens < 1:
            raise KVMapError(f"quality_tokens must be >= 1, got {self.quality_tokens}")
        if self.device_tokens < 2 * self.workload.page_size:
            raise KVMapError(f"device_tokens {self.device_tokens} is smaller than two pages")

    @property
    def replayed_modes(self) -> tuple[str, ...]:
        """Reprefill first (the reference), then the translating modes asked for."""
        return (REFERENCE_MODE, *(m for m in self.modes if m != REFERENCE_MODE))


def plan(turns: list[Turn], config: BenchConfig) -> list[tuple[ReplayPlan, tuple[str, ...]]]:
    """Each policy's routing of ``turns`` and the modes it is replayed in."""
    ideal = ideal_reuse(turns, config.workload.page_size)
    plans = []
    for name in config.policies:
        models = parse_policy(name).route(turns, config.seed)
        flags = swapped(turns, models)
        modes = config.replayed_modes if any(flags) else (REFERENCE_MODE,)
        plans.append((ReplayPlan(name, turns, models, flags, ideal), modes))
    return plans


def run_bench(
    deployment: Deployment,
    turns: list[Turn],
    config: BenchConfig,
    on_request: Callable[[RequestRecord], None] | None = None,
) -> list[RequestRecord]:
    """Every (policy, mode) replay of ``turns``; the records in replay order."""
    records = []
    opening = shared_opening(turns, config.workload.page_size) if config.warm_opening else ()
    for replay_plan, modes in plan(turns, config):
        for mode in modes:
            tail = {"tail_pages": config.tail_pages} if mode == "tail" else {}
            records += replay(
                deployment,
                replay_plan,
                mode,
                quality_tokens=config.quality_tokens,
                device_tokens=config.device_tokens,
                page_size=config.workload.page_size,
                deadline=config.deadline,
                prefetch_threshold=config.prefetch_threshold,
                overrides={
                    "quality_floor": config.quality_floor,
                    "sinks": config.sinks,
                    "first_layer": config.first_layer,
                    "derived": config.derived,
                    **tail,
                },
                opening=opening,
                on_request=on_request,
                store=config.store,
            )
    return records


def replays_of(turns: list[Turn], config: BenchConfig) -> int:
    """How many requests the run serves (for a progress bar)."""
    return sum(len(turns) * len(modes) for _, modes in plan(turns, config))


def header(
    config: BenchConfig,
    names: dict[str, str],
    packs: dict[tuple[str, str], str],
    turns: list[Turn],
    command: str,
    engines: str = "in-process SGLang engines",
) -> dict:
    """The run's facts, printed above its figures; ``names`` and ``packs``: the pair's
    (``Deployment``'s); ``command``: the command line that ran it; ``engines``: what served."""
    workload = config.workload
    deadline = config.deadline
    return {
        "command": command,
        "pair": f"{_short(names['small'])} <-> {_short(names['large'])}",
        "models": f"small {names['small']}, large {names['large']}",
        "packs": ", ".join(f"{a} -> {b}: {p}" for (a, b), p in packs.items()),
        "trace": Path(workload.trace_path).name
        + (", each session its own opening" if workload.openings == "distinct" else ""),
        "scale": f"1/{workload.scale} (blocks of {workload.block_tokens} tokens)",
        "requests": len(turns),
        "sessions": len({t.session for t in turns}),
        "page_size": workload.page_size,
        "date": date.today().isoformat(),
        "prefetch": f"{deadline.policy}, deadline {deadline.base:g} s + "
        f"{deadline.per_ki_token:g} s per 1K tokens, threshold "
        f"{config.prefetch_threshold or 'SGLang default (256 tokens)'}",
        "machine": f"{platform.machine()}, {_cores()} cores, {engines}",
        "store": STORE_LINES[config.store],
        "config": _config_json(config),
    }


def save_run(records: list[RequestRecord], run_header: dict, out: Path) -> Path:
    """records.jsonl, run.json and the report (summary.md, plots) into ``out``, all at once."""
    from .report import write_report

    with replacing_folder(out, _only_an_earlier_run) as folder:
        lines = (json.dumps(r.to_json()) + "\n" for r in records)
        (folder / RECORDS_FILE).write_text("".join(lines))
        (folder / RUN_FILE).write_text(json.dumps(run_header, indent=2) + "\n")
        write_report(records, run_header, folder)
    return out / "summary.md"


def record_in_packs(
    records: list[RequestRecord], config: BenchConfig, packs: dict, run_header: dict
) -> list[str]:
    """Write into each pack of ``packs`` ((sender, receiver) -> folder) the figures of the swaps
    it translated (``report.served_record``), with how they were served (page size, sinks,
    first-layer and derived-page policies, the tail mode's tail in tokens) and on what (the
    run's trace and command), in place of any served figures it recorded before: what the
    engines' quality floor reads (``StorageSettings.recorded_gap_closed``). A pack none of
    whose swaps translated anything is left as it was. Returns a line per pack saying what it
    did."""
    from ..core.mapper import KVMapper
    from ..sglang.settings import (
        SERVED_DERIVED,
        SERVED_FIRST_LAYER,
        SERVED_PAGE_SIZE,
        SERVED_SINKS,
        SERVED_TAIL,
        served_key,
    )
    from .report import served_record

    lines = []
    for (_, receiver), pack in packs.items():
        figures = served_record(records, receiver)
        if not figures:
            lines.append(f"{pack}: no swap into {receiver} translated anything; nothing recorded")
            continue
        mapper = KVMapper.from_pretrained(pack)
        metrics = mapper.info.get("metrics", {})
        metrics = {key: value for key, value in metrics.items() if not key.startswith("served_")}
        metrics.update(figures)
        metrics[SERVED_PAGE_SIZE] = config.workload.page_size
        metrics[SERVED_SINKS] = config.sinks
        metrics[SERVED_FIRST_LAYER] = config.first_layer
        metrics[SERVED_DERIVED] = config.derived
        if served_key("swaps", tail=True) in figures:
            metrics[SERVED_TAIL] = config.tail_pages * config.workload.page_size
        metrics["served_trace"] = (
            f"{run_header['trace']}, {run_header['requests']} requests, scale {run_header['scale']}"
        )
        metrics["served_command"] = run_header["command"]
        mapper.info["metrics"] = metrics
        mapper.save_pretrained(pack, overwrite=True)
        recorded = ", ".join(f"{key} {value:.3g}" for key, value in figures.items())
        lines.append(f"recorded in {pack}: {recorded}")
    return lines


def check_out(out: Path) -> None:
    """Refuse, before any work, an ``out`` that ``save_run`` would refuse or could not write."""
    out = Path(out)
    if out.exists() or out.is_symlink():
        _only_an_earlier_run(out)
    problem = writable_place(out)
    if problem:
        raise KVMapError(f"cannot write the run to {out}: {problem}; choose another --out")


def _short(model: str) -> str:
    """A model's name for titles: a folder's own name, or the Hub id."""
    return Path(model).name if Path(model).exists() else model


def _only_an_earlier_run(folder: Path) -> None:
    """Refuse to replace ``folder`` unless it holds only what a benchmark run writes."""
    from .report import FIGURES, SUMMARY_FILE

    ours = {RECORDS_FILE, RUN_FILE, SUMMARY_FILE, *FIGURES}
    if not folder.is_dir() or folder.is_symlink() or not (folder / RUN_FILE).is_file():
        raise KVMapError(
            f"{folder} exists and is not a benchmark run's output; choose another --out"
        )
    # a folder or link under one of our names is the user's, never ours
    foreign = sorted(
        p.name for p in folder.iterdir() if p.name not in ours or p.is_symlink() or not p.is_file()
    )
    if foreign:
        raise KVMapError(f"{folder} holds files a benchmark run did not write: {foreign}")


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _config_json(config: BenchConfig) -> dict:
    data = asdict(config)
    data["workload"]["trace"] = str(config.workload.trace_path)
    return data


def load_deployment(
    small: str | None = None,
    large: str | None = None,
    packs: dict[tuple[str, str], str] | None = None,
    recipe: PackRecipe = BENCH_RECIPE,
) -> Deployment:
    """The two engines' models (loaded) and packs, as ``pair_and_packs`` finds them."""
    from ..models.capture import load_model

    names, chosen = pair_and_packs(small, large, packs, recipe)
    models = {role: load_model(name) for role, name in names.items()}
    return Deployment(models, names, chosen)


def pair_and_packs(
    small: str | None = None,
    large: str | None = None,
    packs: dict[tuple[str, str], str] | None = None,
    recipe: PackRecipe = BENCH_RECIPE,
) -> tuple[dict[str, str], dict[tuple[str, str], str]]:
    """The two engines' models, {"small", "large"}: folders or Hub ids (default: the embedded
    Qwen2.5-Coder 0.5B/1.5B pair, fetched and converted once), and a pack each way: those
    given, else the registry's whatever their recipe (local cache, then the Hub), else built
    here with ``recipe`` once and cached."""
    from ..fitting.default_pair import LARGE, SMALL, ensure_model

    names = {
        "small": str(small or ensure_model(SMALL)),
        "large": str(large or ensure_model(LARGE)),
    }
    chosen = dict(packs or {})
    if len(chosen) < 2:
        up, down = _registry_packs(names["small"], names["large"], recipe)
        chosen.setdefault(("small", "large"), str(up))
        chosen.setdefault(("large", "small"), str(down))
    return names, chosen


def _registry_packs(small: str, large: str, recipe: PackRecipe, **options) -> tuple[Path, Path]:
    """The registry's packs both ways, whatever recipe made them (the demo's, a fit's, the
    Hub's); when it lacks either, ``recipe``'s packs, those missing built here (once; kept
    under that recipe, so a lookup for another recipe never takes them). ``options``: as
    ``resolve_pack`` takes them."""
    from ..registry.resolve import resolve_pack_pair

    try:
        return resolve_pack_pair(small, large, **options)
    except PackError:
        return resolve_pack_pair(small, large, build=True, recipe=recipe, **options)
