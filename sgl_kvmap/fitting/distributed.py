"""Data-parallel statistics over torch.distributed ranks (torchrun; NCCL on GPUs, gloo on CPU).

The statistics are sums, so the capture splits over processes: rank r of W takes calibration
windows r, r + W, r + 2W, ... (the held-out ones included, each still held out by its index in
the whole list), every rank shifts its moments by window 0's feature means (as one process
does: a rank that does not own window 0 runs it once for the shift), the float64 moments are
all-reduced, and rank 0 alone selects layers, solves and writes the pack. When the recipe tunes,
every rank solves the same statistics, takes rank 0's weights and tunes data-parallel
(``tune.tune_mapper``: gradients averaged over ranks), and rank 0 writes the result.

Equality with one process: every window's float32 products are the ones a single process
adds; only the order of the float64 additions differs (rank r's running sum, then the
reduction over ranks). With two ranks the result equals, bit for bit, a single process that
sums the two shards apart and adds them; against the sequential one-process sum each entry
differs by at most about n_windows * 2^-52 times the sum of its windows' absolute values.

Failure: a rank that raises, or dies, leaves no pack: rank 0 writes only after every rank's
moments arrived, and every surviving rank ends with one line that names the failed rank
(read from the rendezvous store, where each rank records its progress).

A model too big for one device loads sharded inside its rank (``Loading.placement``:
accelerate's ``device_map="auto"`` over the rank's own block of GPUs, then the CPU, then disk);
its captured K/V are what it computes whole (``models.placement``), so the statistics do not
depend on where its weights sit, and a checkpoint resumes under another placement.

Resume: with a checkpoint folder, each rank saves its own running statistics every few
windows (``calibrate.save_state``, atomic), in a file named by the run's plan (models, windows,
settings, rank and world size); a rerun of the same plan loads it and captures the rest only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ..core.errors import KVMapError
from ..core.fit import KINDS
from ..core.mapper import KVMapper
from ..core.stats import ACC, MOMENT_FIELDS, Moments
from ..models.capture import LoadedModel, load_model, model_device
from ..models.placement import (
    Loading,
    Placement,
    describe_placement,
    is_dispatched,
    process_gpus,
)
from .calibrate import (
    CalibrationState,
    add_windows,
    calibration_token_windows,
    fit_from_statistics,
    load_state,
    save_state,
    text_description,
    window_features,
)
from .calibrate import _recipe as calibration_recipe
from .config import CHECKPOINT_EVERY, PackRecipe

log = logging.getLogger(__name__)

# ranks wait for rank 0's solve and tuning, which may take long on a large pair
COLLECTIVE_TIMEOUT = timedelta(hours=6)
_KEY = "sgl_kvmap/fit"


@dataclass(frozen=True)
class Ranks:
    """This process's place: ``rank`` of ``world`` processes, ``local_rank`` on its node."""

    rank: int
    world: int
    local_rank: int = 0
    local_world: int | None = None  # processes on this node (None: all ``world`` of them)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def __str__(self) -> str:
        return f"rank {self.rank} of {self.world}"


def ranks_from_env(environ=os.environ) -> Ranks | None:
    """The ranks torchrun (or any launcher of torch.distributed's env:// convention) set in
    the environment, or None when this process runs alone."""
    world = int(environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    local_world = int(environ.get("LOCAL_WORLD_SIZE", str(world)))
    return Ranks(int(environ["RANK"]), world, int(environ.get("LOCAL_RANK", "0")), local_world)


def shard(n_windows: int, ranks: Ranks | None) -> list[int]:
    """The window indices (of ``n_windows``) this rank captures: every world-th from its rank."""
    if ranks is None:
        return list(range(n_windows))
    return list(range(ranks.rank, n_windows, ranks.world))


def rank_gpus(ranks: Ranks | None, sharded: bool = False) -> list[int]:
    """The GPUs a rank computes on: its local rank's, or, when its models load sharded, an
    equal block of its node's GPUs (``placement.process_gpus``); none without GPUs."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local_rank = 0 if ranks is None else ranks.local_rank
    if count == 0 or not sharded:
        return [local_rank] if count else []
    local_world = 1 if ranks is None else (ranks.local_world or ranks.world)
    return process_gpus(local_rank, local_world, count)


def rank_device(ranks: Ranks | None, sharded: bool = False) -> torch.device:
    """The device a rank computes on (its collectives' and its models' inputs): its first GPU
    when there is one, else the CPU."""
    gpus = rank_gpus(ranks, sharded)
    return torch.device("cuda", gpus[0]) if gpus else torch.device("cpu")


def describe_devices(ranks: Ranks | None, loading: Loading = Loading()) -> str:
    """What a fit uses, in words (printed by the command line)."""
    sharded = loading.placement is not None
    device = rank_device(ranks, sharded)
    kind = "GPU" if device.type == "cuda" else "CPU"
    dtype = str(loading.dtype).removeprefix("torch.")
    where = describe_placement(loading.placement, rank_gpus(ranks, sharded))
    if ranks is None:
        return f"fitting in 1 process on {device}, {where}, in {dtype}"
    backend = "nccl" if device.type == "cuda" else "gloo"
    per_process = f"one {kind} device per process" if not sharded else where
    return f"fitting in {ranks.world} processes ({backend}), {per_process}, in {dtype}"


@contextlib.contextmanager
def process_group(ranks: Ranks, sharded: bool = False) -> Iterator[None]:
    """torch.distributed's default group for ``ranks`` (env:// rendezvous, NCCL on GPUs, gloo on
    CPU), destroyed on the way out; SIGTERM (a launcher stopping the survivors of a failed
    rank) is raised as an error, so each rank still reports the failure in one line.
    ``sharded``: the ranks' models load across several GPUs each (``rank_gpus``)."""
    device = rank_device(ranks, sharded)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, rank=ranks.rank, world_size=ranks.world, timeout=COLLECTIVE_TIMEOUT
    )
    previous = signal.signal(signal.SIGTERM, _stopped)
    try:
        _store().set(f"{_KEY}/host/{ranks.rank}", f"{socket.gethostname()}:{os.getpid()}")
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        dist.destroy_process_group()


class StoppedByLauncher(KVMapError):
    """SIGTERM: the launcher stops the other ranks because one failed."""


def _stopped(signum, frame):
    raise StoppedByLauncher("stopped by the launcher")


def plan_digest(
    src: LoadedModel,
    tgt: LoadedModel,
    windows: list[torch.Tensor],
    recipe: PackRecipe,
    both_directions: bool = False,
) -> str:
    """A digest of what a rank's statistics depend on: both models, every window's token ids,
    the calibration settings and the directions (a checkpoint of another plan is not loaded)."""
    digest = hashlib.sha256()
    settings = {"calibration": asdict(recipe.calibration), "both": both_directions}
    dtypes = [str(model.model.dtype) for model in (src, tgt)]
    if dtypes != [str(torch.float32)] * 2:  # other statistics (where weights sit does not count)
        settings["dtypes"] = dtypes
    for part in (src.spec.fingerprint, tgt.spec.fingerprint, json.dumps(settings, sort_keys=True)):
        digest.update(part.encode())
    for window in windows:
        digest.update(window.to(torch.int64).numpy().tobytes())
    return digest.hexdigest()[:16]


def checkpoint_path(folder: Path, digest: str, ranks: Ranks | None) -> Path:
    """Where this rank keeps its running statistics for the plan ``digest``."""
    world, rank = (1, 0) if ranks is None else (ranks.world, ranks.rank)
    return Path(folder) / f"statistics-{digest}-rank{rank}-of-{world}.safetensors"


def collect_shard(
    src: LoadedModel,
    tgt: LoadedModel,
    windows: list[torch.Tensor],
    recipe: PackRecipe,
    ranks: Ranks | None,
    both_directions: bool = False,
    checkpoint: Path | None = None,
    every: int = CHECKPOINT_EVERY,
) -> CalibrationState:
    """This rank's statistics of its ``shard`` of ``windows`` (``windows`` counts its windows
    done), resumed from and saved to ``checkpoint`` (every ``every`` windows) when given."""
    config = recipe.calibration
    mine = shard(len(windows), ranks)
    state = _resumed(checkpoint, src, tgt, both_directions, config.attention_power)
    if not state.forward.train:
        _start_at_window_zero(state, src, tgt, windows[0], config)
    if state.windows:
        log.info("%s: resuming after %d of its %d windows", ranks, state.windows, len(mine))
    while state.windows < len(mine):
        todo = mine[state.windows : state.windows + every]
        (state,) = add_windows(src, tgt, windows, todo, config, [state])
        if checkpoint is not None:
            save_state(state, checkpoint)
    return state


def _resumed(checkpoint, src, tgt, both_directions: bool, power: float) -> CalibrationState:
    if checkpoint is None or not Path(checkpoint).is_file():
        return CalibrationState.empty(src.spec, tgt.spec, both_directions, power)
    state = load_state(checkpoint, src.spec, tgt.spec)
    device = model_device(src.model)  # where the features, so the sums, are
    for stats in (state.forward, state.reverse):
        for split in () if stats is None else (stats.train, stats.heldout):
            for kind in KINDS:
                split[kind] = _moved(split[kind], device)
    return state


def _moved(m: Moments, device: torch.device) -> Moments:
    """``m`` with its tensors on ``device``."""
    if m.sum_x.device == device:
        return m
    tensors = {name: getattr(m, name).to(device) for name in MOMENT_FIELDS}
    return Moments(n=m.n, **tensors)


def _start_at_window_zero(state, src, tgt, window: torch.Tensor, config) -> None:
    """Shift every moment by window 0's means, as a single process shifts them."""
    x, y = (window_features(model, window, config) for model in (src, tgt))
    state.forward.start(x, y)
    if state.reverse is not None:
        state.reverse.start(y, x)


def all_reduced(state: CalibrationState, ranks: Ranks) -> CalibrationState:
    """Every rank's statistics summed over ranks (float64; on the CPU after), in place; windows
    summed, capture time the slowest rank's. Moments whose shift differs from rank 0's (a
    nondeterministic forward of window 0) are moved to rank 0's first (``Moments.reshifted``)."""
    for stats in (state.forward, state.reverse):
        for split in () if stats is None else (stats.train, stats.heldout):
            for kind in KINDS:
                split[kind] = _reduced(split[kind])
    counts = torch.tensor([state.windows, state.capture_seconds], dtype=ACC, device=_device())
    seconds = counts[1:].clone()
    dist.all_reduce(counts)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    state.windows, state.capture_seconds = int(counts[0].item()), seconds.item()
    return state


def _device() -> torch.device:
    """Where this rank's collectives' tensors live (NCCL takes GPU tensors only)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _reduced(m: Moments) -> Moments:
    m = _moved(m, _device())
    shift_x, shift_y = m.shift_x.clone(), m.shift_y.clone()
    dist.broadcast(shift_x, 0)
    dist.broadcast(shift_y, 0)
    if not (torch.equal(shift_x, m.shift_x) and torch.equal(shift_y, m.shift_y)):
        m = m.reshifted(shift_x, shift_y)
    n = torch.tensor([m.n], dtype=ACC, device=m.sum_x.device)
    dist.all_reduce(n)
    for name in MOMENT_FIELDS[2:]:
        dist.all_reduce(getattr(m, name))
    m.n = int(n.item()) if isinstance(m.n, int) else n.item()
    return _moved(m, torch.device("cpu"))  # the solves run in float64 on the CPU, as alone


def collect_distributed(
    src: LoadedModel,
    tgt: LoadedModel,
    windows: list[torch.Tensor],
    recipe: PackRecipe,
    ranks: Ranks,
    both_directions: bool = False,
    checkpoints: Path | None = None,
    every: int = CHECKPOINT_EVERY,
) -> CalibrationState:
    """The statistics of all ``windows``, captured across ranks and all-reduced (every rank
    returns them). Call inside ``process_group``. A rank whose own capture fails records why
    in the store before raising."""
    try:
        checkpoint = _checkpoint(checkpoints, src, tgt, windows, recipe, ranks, both_directions)
        state = collect_shard(src, tgt, windows, recipe, ranks, both_directions, checkpoint, every)
    except BaseException as err:
        _record_failure(ranks, err)
        raise
    _store().set(f"{_KEY}/captured/{ranks.rank}", "1")
    return all_reduced(state, ranks)


def fit_resumable(
    source: str | LoadedModel,
    target: str | LoadedModel,
    calibration: list[str | Path] | None,
    recipe: PackRecipe,
    ranks: Ranks | None,
    save: Callable[[KVMapper, dict], None],
    checkpoints: Path | None = None,
    every: int = CHECKPOINT_EVERY,
    loading: Loading = Loading(),
) -> None:
    """``build.build_pack`` that can resume (``checkpoints``) and split over ``ranks`` (None: this
    process alone): the statistics data-parallel, then rank 0 solves, tunes and calls
    ``save(mapper, summary)``. Across ranks, every rank returns once rank 0 has saved, or raises
    one KVMapError that names the failed rank (then nothing was saved). ``loading``: how each
    process loads the models named by path (dtype; whole, or sharded across its devices)."""
    models = (source, target, loading)
    if ranks is None:
        src, tgt, windows = _models_and_windows(models, calibration, recipe, None)
        checkpoint = _checkpoint(checkpoints, src, tgt, windows, recipe, None)
        state = collect_shard(src, tgt, windows, recipe, None, False, checkpoint, every)
        save(*_solved(state, src, tgt, calibration, recipe, None, len(windows)))
        return
    with process_group(ranks, sharded=loading.placement is not None):
        try:
            _fit_on_ranks(models, calibration, recipe, ranks, save, checkpoints, every)
        except BaseException as err:
            raise KVMapError(_failure_line(ranks, err)) from err


def _fit_on_ranks(models, calibration, recipe, ranks, save, checkpoints, every) -> None:
    try:
        src, tgt, windows = _models_and_windows(models, calibration, recipe, ranks)
    except BaseException as err:
        _record_failure(ranks, err)
        raise
    state = collect_distributed(src, tgt, windows, recipe, ranks, False, checkpoints, every)
    try:  # tuning is data-parallel: then every rank needs the fitted map
        if ranks.is_main or recipe.tuning is not None:
            built = _solved(state, src, tgt, calibration, recipe, ranks, len(windows))
        if ranks.is_main:
            save(*built)
    except BaseException as err:
        _record_failure(ranks, err)
        raise
    if ranks.is_main:
        _store().set(f"{_KEY}/saved", "1")
    else:
        _wait_for_rank_zero(ranks)
    dist.barrier()  # no rank leaves (rank 0 may host the store) while another still reads it


def _models_and_windows(models, calibration, recipe, ranks):
    source, target, loading = models
    src, tgt = load_pair(source, target, loading, ranks)
    windows = calibration_token_windows(src.tokenizer, calibration, recipe.calibration)
    return src, tgt, windows


def _checkpoint(folder, src, tgt, windows, recipe, ranks, both=False) -> Path | None:
    if folder is None:
        return None
    path = checkpoint_path(folder, plan_digest(src, tgt, windows, recipe, both), ranks)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _solved(state, src, tgt, calibration, recipe, ranks: Ranks | None, n_windows: int):
    """The mapper fitted from the whole statistics, and tuned (on every rank, data-parallel,
    from rank 0's fitted weights), with its summary."""
    from .build import tuned

    processes = 1 if ranks is None else ranks.world

    info = {"text": text_description(calibration)}
    info["tokens"] = n_windows * recipe.calibration.window
    info.update(calibration_recipe(recipe.calibration))
    log.info(
        "statistics: %d tokens in %.1f s in %d process(es) (%.0f tokens/s)",
        info["tokens"],
        state.capture_seconds,
        processes,
        info["tokens"] / max(state.capture_seconds, 1e-9),
    )
    mapper, report = fit_from_statistics(
        state.forward, recipe.calibration, info, state.capture_seconds
    )
    if ranks is not None and recipe.tuning is not None:  # every rank solved: tuning follows
        mapper = mapper.apply(_from_rank_zero)  # replicas start equal, whatever the solver did
    return tuned(mapper, report.summary(), src, tgt, calibration, recipe)


def _from_rank_zero(tensor: torch.Tensor) -> torch.Tensor:
    copy = tensor.detach().clone().contiguous()
    dist.broadcast(copy, 0)
    return copy


def _wait_for_rank_zero(ranks: Ranks, poll_seconds: float = 0.5) -> None:
    """Wait until rank 0 saved the pack; raise when it failed instead."""
    store = _store()
    waited = 0.0
    while not store.check([f"{_KEY}/saved"]):
        if store.check([f"{_KEY}/failed/0"]) or _gone(store, 0):
            raise KVMapError("rank 0 failed")
        if waited > COLLECTIVE_TIMEOUT.total_seconds():
            raise KVMapError("rank 0 did not finish in time")
        time.sleep(poll_seconds)
        waited += poll_seconds


def load_pair(
    source: str | LoadedModel,
    target: str | LoadedModel,
    loading: Loading = Loading(),
    ranks: Ranks | None = None,
) -> tuple[LoadedModel, LoadedModel]:
    """Both models, loaded as ``loading`` says (a loaded model is taken as it is), on this
    rank's device or, with a placement, across its devices."""
    return _loaded_for_rank(source, loading, ranks, "source"), _loaded_for_rank(
        target, loading, ranks, "target"
    )


def _loaded_for_rank(model, loading: Loading, ranks: Ranks | None, role: str) -> LoadedModel:
    if isinstance(model, LoadedModel) or loading.placement is None:
        if not isinstance(model, LoadedModel):
            model = load_model(str(model), dtype=loading.dtype)
        return _on_device(model, ranks)
    rank = 0 if ranks is None else ranks.rank
    arguments = loading.placement.loader_arguments(rank_gpus(ranks, True), f"{role}-rank{rank}")
    return load_model(str(model), dtype=loading.dtype, placement=arguments)


def _on_device(model: LoadedModel, ranks: Ranks | None) -> LoadedModel:
    device = rank_device(ranks)
    if device.type != "cpu" and not is_dispatched(model.model):
        model.model.to(device)
    return model


def _store():
    """The rendezvous store of the default group (torchrun's agent's, or rank 0's)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def _record_failure(ranks: Ranks, err: BaseException) -> None:
    """Leave this rank's own failure in the store, for the other ranks' error lines."""
    if isinstance(err, (StoppedByLauncher, dist.DistBackendError)):
        return  # not this rank's own failure: another one's
    with contextlib.suppress(Exception):
        _store().set(f"{_KEY}/failed/{ranks.rank}", f"{type(err).__name__}: {err}"[:300])


def _failure_line(ranks: Ranks, err: BaseException) -> str:
    """One line: which rank failed and why, as far as the store tells."""
    failed = _failed_ranks(ranks)
    if not failed and isinstance(err, StoppedByLauncher):
        return f"{ranks} was stopped by the launcher, no rank having failed; no pack written"
    if not failed:
        return f"{ranks} failed: {_one_line(err)}; no pack written"
    names = ", ".join(f"rank {rank}" + (f" ({why})" if why else "") for rank, why in failed)
    return f"{names} of {ranks.world} failed; no pack written ({ranks} stopped)"


def _failed_ranks(ranks: Ranks) -> list[tuple[int, str]]:
    """(rank, reason) of the ranks that failed: those that recorded an error, else those whose
    process is gone (same host), else those that never finished their capture."""
    try:
        store = _store()
        recorded = [
            (rank, store.get(f"{_KEY}/failed/{rank}").decode())
            for rank in range(ranks.world)
            if store.check([f"{_KEY}/failed/{rank}"])
        ]
        if recorded:
            return recorded
        gone = [(rank, "its process died") for rank in range(ranks.world) if _gone(store, rank)]
        if gone:
            return gone
        return [
            (rank, "did not finish its capture")
            for rank in range(ranks.world)
            if not store.check([f"{_KEY}/captured/{rank}"])
        ]
    except Exception:  # the store's host is gone: rank 0, or the launcher's agent
        return [(0, "the rendezvous store stopped answering")] if not ranks.is_main else []


def _gone(store, rank: int) -> bool:
    if not store.check([f"{_KEY}/host/{rank}"]):
        return False
    host, pid = store.get(f"{_KEY}/host/{rank}").decode().rsplit(":", 1)
    if host != socket.gethostname():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return _is_zombie(int(pid))


def _is_zombie(pid: int) -> bool:
    """A dead child not yet reaped by its launcher still answers ``kill(pid, 0)``."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


def _one_line(err: BaseException) -> str:
    return " ".join(f"{type(err).__name__}: {err}".split())[:300]


def fit_under_torchrun(
    source: str,
    target: str,
    out: Path,
    recipe: PackRecipe,
    nproc: int,
    placement: Placement | None = None,
) -> None:
    """Run ``sgl-kvmap fit`` under torchrun in ``nproc`` processes, writing (or replacing) the
    pack at ``out``; ``placement``: with ``--device-map auto`` and its budgets. Only the default
    recipe (what the command's defaults fit) can be asked for this way. Raises KVMapError when
    the fit fails (its ranks' lines are on stderr)."""
    if recipe != PackRecipe():
        raise KVMapError("a build across processes fits the default recipe only")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
    ]
    command += ["-m", "sgl_kvmap", "fit", str(source), str(target), "--out", str(out)]
    command += [] if placement is None else placement.fit_arguments()
    done = subprocess.run([*command, "--overwrite"], stdout=subprocess.DEVNULL)
    if done.returncode != 0:
        raise KVMapError(f"the fit in {nproc} processes failed (exit {done.returncode})")
