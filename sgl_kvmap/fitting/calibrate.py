"""fit_mapper: run both models over calibration text, stream statistics, fit, select k.

One pass over the text captures both models' caches window by window; each window goes to
the training or the held-out statistics, and may feed both directions (and several token
weightings) at once. Memory stays flat in the number of tokens. Held-out windows come from
held-out FILES (every ``heldout_every``-th file of the shuffled list), so held-out R^2 measures
text the maps were not fitted on, as choosing k requires.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from ..core.errors import KVMapError
from ..core.files import staged_file
from ..core.fit import (
    KINDS,
    Geometry,
    LayerMap,
    Ridge,
    candidate_ks,
    candidate_ranks,
    fit_maps,
    fit_reduced_rank,
    heldout_r2,
    heldout_r2_reduced,
    probe_scores,
    top_k_selection,
)
from ..core.mapper import KVMapper, content_features
from ..core.spec import ModelSpec, check_pair
from ..core.stats import Moments, moments_from_tensors, moments_to_tensors
from ..core.token_weights import attention_received, token_weights
from ..models.capture import LoadedModel, loaded, model_device, run
from ..models.placement import gathered
from .config import AUTO_K, CalibrationConfig
from .texts import calibration_windows, check_tokenizer, expand_paths, shuffled, stdlib_files

log = logging.getLogger(__name__)


@dataclass
class FitReport:
    """What the fit measured. probe_scores: [Lt, Ls]; per_k: k -> held-out R^2 (mean over
    layers and heads) for K and V (key "chosen": the per-layer selection, with auto-layer);
    chosen_k: the largest k used; layer_ks: k of every target layer; r2_k/r2_v: held-out R^2
    per target layer of the maps as chosen; rank: the reduced rank (None: a k-layer map),
    with per_k holding "rank N" entries for every rank tried."""

    chosen_k: int
    layer_ks: list[int]
    per_k: dict
    probe_scores: torch.Tensor
    r2_k: list[float]
    r2_v: list[float]
    train_tokens: int
    heldout_tokens: int
    capture_seconds: float
    solve_seconds: float
    rank: int | None = None

    @property
    def heldout(self) -> dict[str, float]:
        """Mean held-out R^2 (K, V) of the maps as chosen."""
        return self.per_k["chosen" if "chosen" in self.per_k else self.chosen_k]

    def summary(self) -> dict[str, Any]:
        best = self.heldout
        return {
            "k": self.chosen_k,
            "rank": self.rank,
            "heldout_r2_k": best["k"],
            "heldout_r2_v": best["v"],
            "heldout_r2_k_k1": self.per_k[1]["k"] if 1 in self.per_k else None,
            "heldout_r2_v_k1": self.per_k[1]["v"] if 1 in self.per_k else None,
            "train_tokens": self.train_tokens,
            "heldout_tokens": self.heldout_tokens,
            "fit_seconds": round(self.capture_seconds + self.solve_seconds, 1),
        }


@dataclass
class PairStatistics:
    """Training and held-out moments of one direction (source -> target), for K and V."""

    source: ModelSpec
    target: ModelSpec
    train: dict[str, Moments] = field(default_factory=dict)
    heldout: dict[str, Moments] = field(default_factory=dict)

    def update(
        self,
        x: dict[str, torch.Tensor],
        y: dict[str, torch.Tensor],
        held_out: bool,
        weight: torch.Tensor | None = None,
    ) -> None:
        """Add one window's ``content_features`` of the source (x) and the target (y), rows
        weighted by ``weight: [rows]`` (None: unweighted)."""
        if not self.train:
            self.start(x, y)
        for kind in KINDS:
            (self.heldout if held_out else self.train)[kind].update(x[kind], y[kind], weight)

    def start(self, x: dict[str, torch.Tensor], y: dict[str, torch.Tensor]) -> None:
        """Empty moments shifted by the means of these features (rows unweighted): the first
        window's, whichever process adds it (so moments of several processes add as is)."""
        for kind in KINDS:
            shift_x, shift_y = x[kind].mean(0), y[kind].mean(0)
            self.train[kind] = Moments.empty(shift_x, shift_y)
            self.heldout[kind] = Moments.empty(shift_x, shift_y)

    def merged(self, other: PairStatistics) -> PairStatistics:
        """Statistics of both samples (e.g. two corpora captured apart), training with training
        and held-out with held-out; the fit on them is the fit on one pass over both."""
        if (self.source, self.target) != (other.source, other.target):
            raise KVMapError("cannot merge statistics of different model pairs")
        if not other.train:
            return self
        if not self.train:
            return other
        return PairStatistics(
            self.source,
            self.target,
            {kind: self.train[kind].merged(other.train[kind]) for kind in KINDS},
            {kind: self.heldout[kind].merged(other.heldout[kind]) for kind in KINDS},
        )


@dataclass
class CalibrationState:
    """Statistics after the first ``windows`` calibration windows; more windows can be added.

    Window i is held out when (i + 1) % heldout_every == 0, so a state grown in steps equals
    one collected in a single pass over the same windows. attention_power: the token weighting
    (``CalibrationConfig.attention_power``) these statistics were collected with.
    """

    forward: PairStatistics
    reverse: PairStatistics | None
    windows: int = 0
    capture_seconds: float = 0.0
    attention_power: float = 0.0

    def merged(self, other: CalibrationState) -> CalibrationState:
        """Both states' statistics in one (same directions and token weighting); its windows
        and capture time are the sums. A merged state is fitted, not grown further."""
        if self.attention_power != other.attention_power:
            raise KVMapError("cannot merge statistics of different token weightings")
        if (self.reverse is None) != (other.reverse is None):
            raise KVMapError("cannot merge statistics of one direction with both directions'")
        reverse = None if self.reverse is None else self.reverse.merged(other.reverse)
        return CalibrationState(
            self.forward.merged(other.forward),
            reverse,
            self.windows + other.windows,
            self.capture_seconds + other.capture_seconds,
            self.attention_power,
        )

    @classmethod
    def empty(
        cls, source: ModelSpec, target: ModelSpec, both_directions: bool, attention_power: float
    ) -> CalibrationState:
        reverse = PairStatistics(target, source) if both_directions else None
        return cls(PairStatistics(source, target), reverse, attention_power=attention_power)


def fit_mapper(
    source: str | LoadedModel,
    target: str | LoadedModel,
    calibration: list[str | Path] | None = None,
    config: CalibrationConfig = CalibrationConfig(),
    both_directions: bool = False,
) -> list[tuple[KVMapper, FitReport]]:
    """Fit source -> target (and target -> source if ``both_directions``) on calibration text.

    ``source``/``target``: anything transformers loads, or an already loaded model.
    ``calibration``: files/folders; default: the Python standard library's sources.
    Returns one (mapper, report) per direction, source -> target first.
    """
    src, tgt = loaded(source), loaded(target)
    for model in (src, tgt):  # before their tokenizers are compared
        check_tokenizer(model.tokenizer)
    check_pair(src.spec, tgt.spec)
    windows = calibration_token_windows(src.tokenizer, calibration, config)
    state = collect_statistics(src, tgt, windows, config, both_directions)
    recipe = {"text": text_description(calibration), "tokens": len(windows) * config.window}
    recipe.update(_recipe(config))
    directions = [state.forward, state.reverse] if both_directions else [state.forward]
    return [fit_from_statistics(s, config, recipe, state.capture_seconds) for s in directions]


def save_state(state: CalibrationState, path: Path) -> None:
    """Write collected statistics to one safetensors file (atomic: temp file + rename)."""
    tensors = {}
    for name, stats in (("forward", state.forward), ("reverse", state.reverse)):
        for split in ("train", "heldout") if stats is not None else ():
            for kind, m in getattr(stats, split).items():
                tensors.update(moments_to_tensors(m, f"{name}.{split}.{kind}"))
    meta = {"windows": str(state.windows), "capture_seconds": str(state.capture_seconds)}
    meta["attention_power"] = str(state.attention_power)
    meta["forward_fingerprints"] = (
        f"{state.forward.source.fingerprint},{state.forward.target.fingerprint}"
    )
    with staged_file(Path(path)) as staging:
        save_file(tensors, staging, metadata=meta)


def load_state(path: Path, source: ModelSpec, target: ModelSpec) -> CalibrationState:
    """Read statistics saved by ``save_state`` for this (source, target) pair."""
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    if meta["forward_fingerprints"] != f"{source.fingerprint},{target.fingerprint}":
        raise KVMapError(f"{path} holds statistics of another model pair")
    directions = []
    for name, (s, t) in (("forward", (source, target)), ("reverse", (target, source))):
        if f"{name}.train.k.n" not in tensors:
            directions.append(None)
            continue
        split = {
            sp: {k: moments_from_tensors(tensors, f"{name}.{sp}.{k}") for k in KINDS}
            for sp in ("train", "heldout")
        }
        directions.append(PairStatistics(s, t, split["train"], split["heldout"]))
    return CalibrationState(
        *directions,
        int(meta["windows"]),
        float(meta["capture_seconds"]),
        float(meta.get("attention_power", 0.0)),
    )


def calibration_files(calibration, heldout_every: int) -> tuple[list[Path], list[Path]]:
    """(training, held-out) calibration files, each in shuffled order: every ``heldout_every``-th
    file of the shuffled list is held out (at least one), so no file feeds both."""
    files = shuffled(expand_paths(calibration) if calibration else stdlib_files())
    held = set(files[heldout_every - 1 :: heldout_every] or files[-1:])
    train_files = [f for f in files if f not in held]
    if not train_files:
        raise KVMapError("calibration needs at least two text files (training and held-out)")
    return train_files, [f for f in files if f in held]


def calibration_token_windows(
    tokenizer, calibration, config: CalibrationConfig
) -> list[torch.Tensor]:
    """The calibration windows ``[window]`` of token ids for ``config`` (stdlib by default).

    Window i is a held-out window when (i + 1) % heldout_every == 0 (as ``collect_statistics``
    counts them); held-out windows are cut from every heldout_every-th file of the shuffled file
    list (at least one file), training windows from the others, so no file feeds both. The list
    for a budget is a prefix of the list for any larger budget (statistics can be grown).
    """
    every = config.heldout_every
    train_files, heldout_files = calibration_files(calibration, every)
    streams = {
        held: calibration_windows(tokenizer, subset, config.window, config.per_file_tokens)
        for held, subset in ((False, train_files), (True, heldout_files))
    }
    planned = config.tokens // config.window  # may far exceed the text: never materialised
    windows = []
    for i in range(planned):
        window = next(streams[_is_heldout(i, planned, every)], None)
        if window is None:
            break
        windows.append(window)
    taken = {i for i in range(len(windows)) if _is_heldout(i, planned, every)}
    if len(windows) < 2 or taken != _heldout_indices(len(windows), every):
        raise KVMapError(
            f"calibration text gave {len(windows)} window(s) of {config.window} tokens, too few "
            f"for a training / held-out split (every {every}th window); pass more text"
        )
    return windows


def text_description(calibration) -> str:
    return ", ".join(map(str, calibration)) if calibration else "Python standard library sources"


def collect_statistics(
    src: LoadedModel,
    tgt: LoadedModel,
    windows: list[torch.Tensor],
    config: CalibrationConfig,
    both_directions: bool = False,
    state: CalibrationState | None = None,
) -> CalibrationState:
    """Run both models over ``windows`` (those past ``state.windows`` when resuming) and add
    every window's content-space K/V to the statistics of one or both directions, tokens
    weighted as ``config.attention_power`` says."""
    if state is None:
        state = CalibrationState.empty(src.spec, tgt.spec, both_directions, config.attention_power)
    if both_directions and state.reverse is None:
        raise KVMapError("cannot add the reverse direction to statistics collected without it")
    if state.attention_power != config.attention_power:
        raise KVMapError(
            f"statistics weighted with attention power {state.attention_power} cannot be grown "
            f"with power {config.attention_power}"
        )
    (state,) = collect_many(src, tgt, windows, config, [state])
    return state


def collect_many(
    src: LoadedModel,
    tgt: LoadedModel,
    windows: list[torch.Tensor],
    config: CalibrationConfig,
    states: list[CalibrationState],
) -> list[CalibrationState]:
    """Grow several statistics (each its own token weighting and directions) in ONE pass over
    ``windows``: each model runs once per window whatever the number of states. All states
    must hold the same number of windows."""
    done = {state.windows for state in states}
    if len(done) != 1:
        raise KVMapError(f"statistics to grow together hold different window counts: {done}")
    return add_windows(src, tgt, windows, range(done.pop(), len(windows)), config, states)


def add_windows(
    src: LoadedModel,
    tgt: LoadedModel,
    windows: list[torch.Tensor],
    indices,
    config: CalibrationConfig,
    states: list[CalibrationState],
) -> list[CalibrationState]:
    """Add the windows at ``indices`` (positions in ``windows``, the whole calibration list,
    which says which are held out) to every state, each model running once per window; each
    state's ``windows`` grows by their number."""
    powers = {state.attention_power for state in states} - {0.0}
    heldout = _heldout_indices(len(windows), config.heldout_every)
    rows = _kept_rows(config)
    started = time.perf_counter()
    for i in tqdm(indices, desc="calibration windows", unit="win"):
        (src_features, src_received), (tgt_features, tgt_received) = (
            _window_features(model, windows[i], rows, want_attention=bool(powers))
            for model in (src, tgt)
        )
        for state in states:
            power = state.attention_power
            state.forward.update(
                src_features, tgt_features, i in heldout, _weights(tgt_received, power)
            )
            if state.reverse is not None:
                state.reverse.update(
                    tgt_features, src_features, i in heldout, _weights(src_received, power)
                )
    for state in states:
        state.windows += len(indices)
        state.capture_seconds += time.perf_counter() - started
    return states


def window_features(model: LoadedModel, ids: torch.Tensor, config: CalibrationConfig):
    """The content-space K/V of one window's kept rows, as the statistics add them."""
    return _window_features(model, ids, _kept_rows(config), want_attention=False)[0]


def _kept_rows(config: CalibrationConfig) -> slice:
    return slice(config.skip_first, None, config.stride)


def _window_features(model: LoadedModel, ids: torch.Tensor, rows: slice, want_attention: bool):
    """(content_features of one window, attention each kept row receives or None)."""
    device = model_device(model.model)
    result = run(model.model, ids.to(device), want_queries=want_attention)
    cache = gathered(result.cache, device)  # a model sharded across GPUs: one device
    features = content_features(cache, model.spec, rows)
    if not want_attention:
        return features, None
    queries = [q.to(device) for q in result.queries]
    return features, attention_received(queries, cache.keys)[rows]


def _weights(received: torch.Tensor | None, power: float) -> torch.Tensor | None:
    return None if power == 0 else token_weights(received, power)


@dataclass(frozen=True)
class _FitInputs:
    """What either map family is fitted from: one direction's statistics (``everything``: its
    training and held-out moments merged, for the final maps), the settings, the geometry and
    ridge they give, and what the pack records (``recipe``, ``capture_seconds``)."""

    split: PairStatistics
    everything: dict[str, Moments]
    config: CalibrationConfig
    geo: Geometry
    ridge: Ridge
    recipe: dict | None
    capture_seconds: float

    def report(self, started: float, **measured) -> FitReport:
        """The fit's report: what it ``measured``, these statistics' token counts, the capture
        time and the time since ``started``."""
        return FitReport(
            train_tokens=round(self.split.train["k"].n),
            heldout_tokens=round(self.split.heldout["k"].n),
            capture_seconds=self.capture_seconds,
            solve_seconds=time.perf_counter() - started,
            **measured,
        )

    def mapper(self, selection, maps, report: FitReport, projections=None) -> KVMapper:
        """The fitted mapper, with the settings and the report the pack records."""
        return KVMapper(
            self.split.source,
            self.split.target,
            selection,
            maps,
            self.config.ridge,
            self.config.sink_tokens,
            _info(self.recipe, report),
            projections=projections,
        )


def fit_from_statistics(
    split: PairStatistics,
    config: CalibrationConfig,
    recipe: dict | None = None,
    capture_seconds: float = 0.0,
) -> tuple[KVMapper, FitReport]:
    """Select source layers, choose k on the held-out moments, and fit the final maps on all
    (or, with ``config.rank``, fit the reduced-rank map; with rank "auto", keep the k-layer
    map instead where its held-out R^2 beats the reduced-rank one by more than k_tolerance)."""
    started = time.perf_counter()
    source, target = split.source, split.target
    geo = Geometry(
        source.num_layers, source.kv_width, target.num_layers, target.kv_width, target.head_dim
    )
    ridge = Ridge(config.ridge, config.ridge_relative)
    # the final maps are fitted on train + held-out: merged once, whichever family is fitted
    everything = {kind: split.train[kind].merged(split.heldout[kind]) for kind in KINDS}
    inputs = _FitInputs(split, everything, config, geo, ridge, recipe, capture_seconds)
    if config.rank is None:
        return _fit_k_layers(inputs, started)
    reduced = _fit_reduced_rank(inputs, started)
    if config.rank != "auto":
        return reduced
    k_layers = _fit_k_layers(inputs, time.perf_counter())
    return _better_map(reduced, k_layers, config.k_tolerance)


def _better_map(reduced, k_layers, tolerance: float) -> tuple[KVMapper, FitReport]:
    """The reduced-rank fit unless the k-layer fit's held-out R^2 (mean of K and V) is better
    by more than ``tolerance``; the report keeps both families' scores and both solve times.
    (On the Qwen pair the reduced-rank map wins downstream at 128k calibration tokens and
    loses, on R^2 and downstream, for 1.5B -> 0.5B at 16k: docs/LOG.md.)"""
    (_, r_report), (_, k_report) = reduced, k_layers
    choice = _smallest_within({0: r_report.heldout, 1: k_report.heldout}, tolerance)
    mapper, report = (reduced, k_layers)[choice]
    other = (k_report, r_report)[choice]
    report.per_k = {**{k: v for k, v in other.per_k.items() if k != "chosen"}, **report.per_k}
    report.solve_seconds = r_report.solve_seconds + k_report.solve_seconds
    mapper.info["metrics"].update({k: v for k, v in report.summary().items() if v is not None})
    log.info("rank auto: kept the %s map", "k-layer" if choice else f"rank-{report.rank}")
    return mapper, report


def _fit_k_layers(inputs: _FitInputs, started: float) -> tuple[KVMapper, FitReport]:
    """fit_from_statistics for k selected source layers per target layer (a fixed k above the
    source's layer count reads every source layer)."""
    split, config, geo, ridge = inputs.split, inputs.config, inputs.geo, inputs.ridge
    source, target = split.source, split.target
    if config.top_k not in AUTO_K and int(config.top_k) > source.num_layers:
        config = dataclasses.replace(config, top_k=source.num_layers)
    scores = probe_scores(split.train, geo, ridge)
    ks = (
        candidate_ks(source.num_layers)
        if config.top_k in AUTO_K
        else sorted({1, int(config.top_k)})
    )
    per_k, per_layer = {}, {}
    for k in tqdm(
        ks, desc=f"choosing k ({source.num_layers}->{target.num_layers} layers)", unit="k"
    ):
        selected = top_k_selection(scores, k)
        per_layer[k] = heldout_r2(split.train, split.heldout, selected, geo, ridge)
        per_k[k] = {kind: per_layer[k][kind].mean().item() for kind in KINDS}
    layer_ks = _choose_layer_ks(per_k, per_layer, config)
    selection = [top_k_selection(scores, k)[layer] for layer, k in enumerate(layer_ks)]
    if config.top_k == "auto-layer":
        per_layer["chosen"] = heldout_r2(split.train, split.heldout, selection, geo, ridge)
        per_k["chosen"] = {kind: per_layer["chosen"][kind].mean().item() for kind in KINDS}
    chosen = "chosen" if config.top_k == "auto-layer" else layer_ks[0]
    heldout = per_k[chosen]
    maps = fit_maps(inputs.everything, selection, geo, ridge)
    report = inputs.report(
        started,
        chosen_k=max(layer_ks),
        layer_ks=layer_ks,
        per_k=per_k,
        probe_scores=scores.float(),
        r2_k=per_layer[chosen]["k"].tolist(),
        r2_v=per_layer[chosen]["v"].tolist(),
    )
    mapper = inputs.mapper(selection, maps, report)
    log.info(
        "fitted %s -> %s: k=%s, held-out R2 K %.3f V %.3f",
        source.model_id,
        target.model_id,
        layer_ks if config.top_k == "auto-layer" else chosen,
        heldout["k"],
        heldout["v"],
    )
    return mapper, report


def _fit_reduced_rank(inputs: _FitInputs, started: float) -> tuple[KVMapper, FitReport]:
    """fit_from_statistics for ``config.rank``: held-out R^2 of the train-fitted maps, then the
    final maps on all windows."""
    split, config, geo, ridge = inputs.split, inputs.config, inputs.geo, inputs.ridge
    ranks = candidate_ranks(geo) if config.rank == "auto" else [config.rank]
    per_layer = heldout_r2_reduced(split.train, split.heldout, geo, ridge, ranks)
    per_rank = {r: {kind: v.mean().item() for kind, v in per_layer[r].items()} for r in ranks}
    rank = _smallest_within(per_rank, config.k_tolerance)
    fitted = {kind: fit_reduced_rank(inputs.everything[kind], geo, ridge, rank) for kind in KINDS}
    report = inputs.report(
        started,
        chosen_k=geo.source_layers,
        layer_ks=[geo.source_layers] * geo.target_layers,
        per_k={"chosen": per_rank[rank], **{f"rank {r}": v for r, v in per_rank.items()}},
        probe_scores=torch.empty(0),
        r2_k=per_layer[rank]["k"].tolist(),
        r2_v=per_layer[rank]["v"].tolist(),
        rank=rank,
    )
    mapper = inputs.mapper(
        [list(range(geo.source_layers))] * geo.target_layers,
        {kind: [_float32(m) for m in fitted[kind][1]] for kind in KINDS},
        report,
        projections={kind: fitted[kind][0].float() for kind in KINDS},
    )
    log.info(
        "fitted reduced-rank %d map: held-out R2 K %.3f V %.3f",
        rank,
        *(report.heldout[kind] for kind in KINDS),
    )
    return mapper, report


def _float32(m: LayerMap) -> LayerMap:
    return LayerMap(m.weight.float(), m.bias.float())


def _info(recipe: dict | None, report: FitReport) -> dict:
    return {
        "calibration": recipe or {},
        "metrics": {key: v for key, v in report.summary().items() if v is not None},
    }


def _heldout_indices(n_windows: int, every: int) -> set[int]:
    """Every ``every``-th window, or the last one when there are fewer than ``every``."""
    return {i for i in range(n_windows) if _is_heldout(i, n_windows, every)}


def _is_heldout(i: int, n_windows: int, every: int) -> bool:
    """Whether window ``i`` of ``n_windows`` is in ``_heldout_indices(n_windows, every)``."""
    return (i + 1) % every == 0 or (n_windows < every and i == n_windows - 1)


def _choose_layer_ks(per_k, per_layer, config: CalibrationConfig) -> list[int]:
    """k of every target layer: fixed, one auto k for all, or an auto k per layer."""
    layers = len(next(iter(per_layer.values()))["k"])
    if config.top_k not in AUTO_K:
        return [int(config.top_k)] * layers
    if config.top_k == "auto":
        return [_smallest_within(per_k, config.k_tolerance)] * layers
    return [
        _smallest_within(
            {k: {kind: r[kind][layer] for kind in KINDS} for k, r in per_layer.items()},
            config.k_tolerance,
        )
        for layer in range(layers)
    ]


def _smallest_within(r2_by_k: dict, tolerance: float) -> int:
    """Smallest k whose held-out R^2 (mean of K and V) is within ``tolerance`` of the best."""
    score = {k: (float(r["k"]) + float(r["v"])) / 2 for k, r in r2_by_k.items()}
    best = max(score.values())
    return min(k for k, s in score.items() if s >= best - tolerance)


def _recipe(config: CalibrationConfig) -> dict[str, Any]:
    """Everything in the config that shaped the fit (tokens and text are recorded apart)."""
    return {key: value for key, value in asdict(config).items() if key != "tokens"}
