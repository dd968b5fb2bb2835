"""Fitting across processes (sgl_kvmap/fitting/distributed.py): two real gloo ranks on CPU,
started by torchrun or by multiprocessing (spawn, the env:// rendezvous torchrun sets up),
against the one-process fit of the same tiny pair and text."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from sgl_kvmap.cli import main
from sgl_kvmap.core.stats import MOMENT_FIELDS, Moments
from sgl_kvmap.fitting.calibrate import (
    CalibrationState,
    calibration_token_windows,
    collect_statistics,
    load_state,
)
from sgl_kvmap.fitting.config import CalibrationConfig, PackRecipe, TuneConfig
from sgl_kvmap.fitting.distributed import Ranks, collect_shard, shard
from sgl_kvmap.models.capture import load_model
from sgl_kvmap.models.placement import Loading, Placement

from .conftest import TINY_TUNING, fit_tiny_mapper, save_loaded

WINDOWS = 16  # of 128 tokens: 8 per rank
CALIBRATION = CalibrationConfig(tokens=WINDOWS * 128, window=128, top_k=2)
FIT_ARGS = ["--tokens", str(WINDOWS * 128), "--window", "128", "--top-k", "2", "--tune-steps", "0"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def folders(tiny_pair, text_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("distributed")
    return {
        "source": Path(save_loaded(tiny_pair[0], root / "src")),
        "target": Path(save_loaded(tiny_pair[1], root / "tgt")),
        "text": text_dir / "calib",
        "root": root,
    }


def fit_args(folders, out: Path, *extra: str) -> list[str]:
    source, target, text = (str(folders[key]) for key in ("source", "target", "text"))
    return ["fit", source, target, "--out", str(out), "--calibration", text, *FIT_ARGS, *extra]


@pytest.fixture(scope="module")
def one_process_pack(folders) -> dict[str, torch.Tensor]:
    out = folders["root"] / "one-process"
    result = CliRunner().invoke(main, fit_args(folders, out))
    assert result.exit_code == 0, result.output
    return load_file(out / "mapper.safetensors")


def assert_same_pack(folder: Path, want: dict[str, torch.Tensor]) -> None:
    got = load_file(folder / "mapper.safetensors")
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, job: str, args: list, logs: Path, die_after):
    """One rank, as torchrun starts it: env:// rendezvous, stdout/stderr to files. ``job``:
    "cli" runs the command line ``args``; "stats" saves the all-reduced statistics of
    ``args`` = (source, target, text[, loading]) to logs/stats-rank{rank}.safetensors (and,
    loaded by a placement, where its models' modules sit to logs/placement-rank{rank}). The rank
    counts its model forwards (logs/forwards-rank{rank}) and, after ``die_after[rank]`` of
    them, dies at once (os._exit: no cleanup, as a killed process)."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    for fd, name in ((1, "stdout"), (2, "stderr")):
        os.dup2(os.open(logs / f"{name}-rank{rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    torch.set_num_threads(1)
    from sgl_kvmap.fitting import calibrate

    forward, forwards = calibrate._window_features, []

    def counted(*a, **kw):
        if len(forwards) == die_after.get(rank, -1):
            os._exit(9)
        forwards.append(1)
        (logs / f"forwards-rank{rank}").write_text(str(len(forwards)))
        return forward(*a, **kw)

    calibrate._window_features = counted
    if job == "cli":
        main(args)
    if job == "tune":
        return _tune_on_rank(rank, args, logs)
    from sgl_kvmap.fitting.calibrate import calibration_token_windows, save_state
    from sgl_kvmap.fitting.distributed import (
        collect_distributed,
        load_pair,
        process_group,
        ranks_from_env,
    )

    ranks = ranks_from_env()
    src, tgt = load_pair(*args[:2], *args[3:], ranks=ranks)
    if args[3:]:
        placed = [m.model.hf_device_map for m in (src, tgt)]
        (logs / f"placement-rank{rank}.json").write_text(json.dumps(placed))
    windows = calibration_token_windows(src.tokenizer, [args[2]], CALIBRATION)
    with process_group(ranks):
        state = collect_distributed(src, tgt, windows, PackRecipe(CALIBRATION), ranks)
    save_state(state, logs / f"stats-rank{rank}.safetensors")


TUNING = TuneConfig(steps=6, lr=3e-2, warmup=0, **{**TINY_TUNING, "eval_every": 3})


def _tune_on_rank(rank: int, args, logs: Path) -> None:
    """Tune the tiny pair's fitted map data-parallel; save the tuned map and its curve."""
    from sgl_kvmap.fitting.distributed import process_group, ranks_from_env
    from sgl_kvmap.fitting.tune import tune_mapper

    src, tgt = (load_model(str(path)) for path in args[:2])
    with process_group(ranks_from_env()):
        tuned, report = tune_mapper(fit_tiny_mapper(src, tgt), src, tgt, [args[2]], TUNING)
    tuned.save_pretrained(logs / f"tuned-rank{rank}")
    (logs / f"curve-rank{rank}.json").write_text(json.dumps(report.curve))


def spawn_ranks(job: str, args, logs: Path, world: int = 2, die_after=None) -> list[int]:
    """Run ``world`` ranks of ``job`` (see ``_rank_main``); their exit codes."""
    logs.mkdir(parents=True, exist_ok=True)
    spawn, port = multiprocessing.get_context("spawn"), free_port()
    processes = [
        spawn.Process(target=_rank_main, args=(rank, world, port, job, args, logs, die_after or {}))
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=180)
    for process in processes:  # a hung rank: killed, so no rank outlives the test
        if process.is_alive():
            process.kill()
            process.join()
    return [process.exitcode for process in processes]


def forwards(logs: Path, rank: int) -> int:
    path = logs / f"forwards-rank{rank}"
    return int(path.read_text()) if path.exists() else 0


def test_shards_cover_every_window_once():
    for n, world in ((16, 2), (7, 3), (2, 4)):
        parts = [shard(n, Ranks(rank, world)) for rank in range(world)]
        assert sorted(sum(parts, [])) == list(range(n))
        assert parts == [shard(n, Ranks(rank, world)) for rank in range(world)]  # deterministic


def test_all_reduced_statistics_equal_one_process(folders, tmp_path):
    """Both ranks end with the same statistics, equal bit for bit to one process that sums
    the two shards apart and adds them, and to the sequential one-process sum within float64
    reassociation: n_windows * 2^-52 * (sum of the windows' absolute contributions)."""
    logs = tmp_path / "logs"
    args = [folders["source"], folders["target"], folders["text"]]
    assert spawn_ranks("stats", args, logs) == [0, 0]
    src, tgt = load_model(str(folders["source"])), load_model(str(folders["target"]))
    ranked = [load_state(logs / f"stats-rank{r}.safetensors", src.spec, tgt.spec) for r in (0, 1)]
    with _one_thread():
        windows, shards = _shards_in_one_process(src, tgt, folders)
        sequential = collect_statistics(src, tgt, windows, CALIBRATION)
        single = [_single_window(src, tgt, windows, i, sequential) for i in range(WINDOWS)]
    assert ranked[0].windows == ranked[1].windows == WINDOWS
    for split in ("train", "heldout"):
        for kind in ("k", "v"):
            got = [getattr(state.forward, split)[kind] for state in ranked]
            shard_sum = getattr(shards[0].forward, split)[kind].merged(
                getattr(shards[1].forward, split)[kind]
            )
            whole = getattr(sequential.forward, split)[kind]
            parts = [getattr(s.forward, split)[kind] for s in single]
            for name in ("sum_x", "sum_y", "xx", "xy", "yy"):
                a, b = getattr(got[0], name), getattr(got[1], name)
                assert torch.equal(a, b) and torch.equal(a, getattr(shard_sum, name)), name
                magnitude = sum(getattr(p, name).abs() for p in parts)
                bound = WINDOWS * 2.0**-52 * magnitude
                assert ((a - getattr(whole, name)).abs() <= bound).all(), (split, kind, name)
            assert got[0].n == whole.n and torch.equal(got[0].shift_x, whole.shift_x)


def test_offloaded_ranks_capture_what_whole_models_do(folders, tmp_path):
    """Two ranks that each load both models with most of their weights on disk (accelerate)
    end with, bit for bit, the statistics of whole models summed shard by shard."""
    logs, budget = tmp_path / "logs", Placement(max_memory=(("cpu", 100_000),))
    args = [folders["source"], folders["target"], folders["text"], Loading(placement=budget)]
    assert spawn_ranks("stats", args, logs) == [0, 0]
    for rank in (0, 1):
        placed = json.loads((logs / f"placement-rank{rank}.json").read_text())
        assert all("disk" in where.values() for where in placed), placed
    src, tgt = load_model(str(folders["source"])), load_model(str(folders["target"]))
    got = load_state(logs / "stats-rank0.safetensors", src.spec, tgt.spec)
    with _one_thread():
        _, shards = _shards_in_one_process(src, tgt, folders)
    for split in ("train", "heldout"):
        for kind in ("k", "v"):
            a = getattr(shards[0].forward, split)[kind]
            want = a.merged(getattr(shards[1].forward, split)[kind])
            have = getattr(got.forward, split)[kind]
            assert have.n == want.n
            assert all(torch.equal(getattr(have, f), getattr(want, f)) for f in MOMENT_FIELDS)


@contextlib.contextmanager
def _one_thread():
    """Torch at one thread inside, as the ranks run their forwards (bit for bit only so)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _shards_in_one_process(src, tgt, folders) -> tuple[list, list[CalibrationState]]:
    """The calibration windows, and the two ranks' shards of them collected in this process."""
    windows = calibration_token_windows(src.tokenizer, [folders["text"]], CALIBRATION)
    recipe = PackRecipe(CALIBRATION)
    return windows, [collect_shard(src, tgt, windows, recipe, Ranks(r, 2)) for r in (0, 1)]


def _single_window(src, tgt, windows, i, sequential) -> CalibrationState:
    """Window ``i``'s own contribution, shifted as the whole statistics are."""
    state = CalibrationState.empty(src.spec, tgt.spec, False, 0.0)
    for split in ("train", "heldout"):
        for kind in ("k", "v"):
            m = getattr(sequential.forward, split)[kind]
            getattr(state.forward, split)[kind] = Moments.empty(m.shift_x, m.shift_y)
    from sgl_kvmap.fitting.calibrate import add_windows

    (state,) = add_windows(src, tgt, windows, [i], CALIBRATION, [state])
    return state


def test_torchrun_fits_the_one_process_pack(folders, one_process_pack, tmp_path):
    """`sgl-kvmap fit --nproc 2` relaunches itself under torchrun: two ranks, one pack."""
    out = tmp_path / "pack"
    command = [sys.executable, "-m", "sgl_kvmap", *fit_args(folders, out, "--nproc", "2")]
    done = run_in_own_session(command, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fitting in 2 processes (gloo)" in done.stderr
    assert done.stdout.rstrip().endswith(f"pack written to {out}")
    assert_same_pack(out, one_process_pack)


def test_two_nodes_fit_the_one_process_pack(folders, one_process_pack, tmp_path):
    """Two torchrun invocations, one process each, meet at a c10d rendezvous on 127.0.0.1 as
    two nodes would: one of them is rank 0 and writes the pack, the other writes nothing."""
    out, port = tmp_path / "pack", free_port()
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1"]
    launcher += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=kvmap"]
    command = [*launcher, "-m", "sgl_kvmap", *fit_args(folders, out)]
    nodes = [start_in_own_session(command) for _ in range(2)]
    done = [finish_in_own_session(node, command, timeout=300) for node in nodes]
    assert [node.returncode for node in done] == [0, 0], done[0].stderr[-3000:]
    written = [node.stdout.rstrip().endswith(f"pack written to {out}") for node in done]
    assert sorted(written) == [False, True]
    assert_same_pack(out, one_process_pack)


def run_in_own_session(command: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run ``command`` (which starts torchrun and its ranks) in a new session; on a timeout
    kill the whole session, so no rank outlives the test."""
    return finish_in_own_session(start_in_own_session(command), command, timeout)


def start_in_own_session(command: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        command,
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def finish_in_own_session(
    process: subprocess.Popen, command: list[str], timeout: float
) -> subprocess.CompletedProcess:
    """Wait for ``process`` (started by ``start_in_own_session``); on a timeout kill its whole
    session."""
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def test_a_killed_rank_leaves_no_pack_and_a_rerun_resumes(folders, one_process_pack, tmp_path):
    out, logs, checkpoints = tmp_path / "out" / "pack", tmp_path / "logs", tmp_path / "ck"
    args = fit_args(folders, out, "--checkpoints", str(checkpoints), "--checkpoint-every", "2")
    out.parent.mkdir()
    # rank 1: 2 forwards for window 0's shift, 4 for its first 2 windows (saved), 2 for its
    # 3rd; dies in its 4th, before the next save
    exits = spawn_ranks("cli", args, logs, die_after={1: 8})
    assert exits == [1, 9]
    error = [line for line in (logs / "stderr-rank0").read_text().splitlines() if "error" in line]
    assert len(error) == 1 and error[0].startswith("error: rank 1 (its process died) of 2 failed")
    assert not out.exists() and list(out.parent.iterdir()) == []  # no pack, no staging folder
    assert len(list(checkpoints.iterdir())) == 2  # both ranks' running statistics
    exits = spawn_ranks("cli", args, tmp_path / "rerun")
    assert exits == [0, 0], (tmp_path / "rerun" / "stderr-rank0").read_text()[-2000:]
    assert_same_pack(out, one_process_pack)
    assert forwards(tmp_path / "rerun", 0) == 0  # rank 0 had finished its 8 windows
    assert forwards(tmp_path / "rerun", 1) == 2 * (8 - 2)  # rank 1 captured only what it lacked


def test_tuning_is_data_parallel_with_replicated_weights(folders, tmp_path):
    """Two ranks tune on disjoint windows with averaged gradients: they end with the same
    weights and curve; the held-out scores, split between them and all-reduced, are the
    one-process scores of the same map."""
    logs = tmp_path / "logs"
    args = [folders["source"], folders["target"], folders["text"]]
    assert spawn_ranks("tune", args, logs) == [0, 0]
    tuned = [load_file(logs / f"tuned-rank{r}" / "mapper.safetensors") for r in (0, 1)]
    assert tuned[0].keys() == tuned[1].keys()
    assert all(torch.equal(tuned[0][name], tuned[1][name]) for name in tuned[0])
    curves = [json.loads((logs / f"curve-rank{r}.json").read_text()) for r in (0, 1)]
    assert curves[0] == curves[1] and [p["step"] for p in curves[0]] == [0, 3, 6]
    from sgl_kvmap.fitting.tune import tune_mapper

    src, tgt = (load_model(str(folders[key])) for key in ("source", "target"))
    alone = tune_mapper(fit_tiny_mapper(src, tgt), src, tgt, [folders["text"]], TUNING)[1]
    for key in ("heldout_nll", "heldout_accuracy"):
        assert curves[0][0][key] == pytest.approx(alone.curve[0][key], rel=1e-5)
    # one step reads a window per rank: the two runs see different windows, so they part
    assert curves[0][1]["train_loss"] != pytest.approx(alone.curve[1]["train_loss"], rel=1e-6)
