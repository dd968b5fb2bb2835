"""Models loaded sharded or offloaded by accelerate (sgl_kvmap/models/placement.py), against the
same models loaded whole: what the capture reads, the statistics, and `fit --device-map`."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from sgl_kvmap.cli import main
from sgl_kvmap.core.errors import KVMapError
from sgl_kvmap.core.stats import MOMENT_FIELDS
from sgl_kvmap.fitting.calibrate import calibration_token_windows
from sgl_kvmap.fitting.config import CalibrationConfig, PackRecipe
from sgl_kvmap.fitting.distributed import collect_shard, load_pair, plan_digest
from sgl_kvmap.models.capture import run
from sgl_kvmap.models.placement import Loading, Placement, parse_max_memory, process_gpus

# 100 kB of CPU per model: the tiny models' embeddings and at most a layer; the rest on disk
OFFLOADED = Placement(max_memory=(("cpu", 100_000),))
FIT_ARGS = ["--tokens", "1024", "--window", "128", "--top-k", "2", "--tune-steps", "0"]


def pair(model_folders, loading: Loading):
    return load_pair(model_folders["source"], model_folders["target"], loading)


def assert_offloaded(models) -> None:
    """Each model has weights on disk (accelerate reads them back for every forward)."""
    for model in models:
        assert "disk" in model.model.hf_device_map.values(), model.model.hf_device_map


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offloaded_models_compute_what_whole_ones_do(model_folders, dtype):
    """Every layer's post-RoPE K/V and queries, and the logits, of a model with most of its
    weights on disk equal, bit for bit, the whole model's: accelerate's hooks put the same
    weights back before each module runs the same CPU kernels, and leave the cache alone."""
    whole, offloaded = (
        pair(model_folders, Loading(dtype)),
        pair(model_folders, Loading(dtype, OFFLOADED)),
    )
    assert_offloaded(offloaded)
    ids = torch.randint(0, 100, (48,), generator=torch.Generator().manual_seed(0))
    for a, b in zip(whole, offloaded):
        want, got = (run(m.model, ids, logits_to_keep=4, want_queries=True) for m in (a, b))
        assert got.cache.keys[0].dtype == dtype
        tensors = zip(
            got.cache.keys + got.cache.values + got.queries,
            want.cache.keys + want.cache.values + want.queries,
        )
        assert all(torch.equal(g, w) for g, w in tensors)
        assert torch.equal(got.logits, want.logits)


def test_offloaded_models_give_the_same_statistics_and_plan(model_folders, text_dir):
    """The statistics (attention-weighted, so the recorded queries count too) of offloaded
    models are the whole models' bit for bit, and so is the checkpoint plan: a fit resumes
    under another placement, not under another capture dtype."""
    config = CalibrationConfig(tokens=8 * 128, window=128, top_k=2, attention_power=1.0)
    recipe, states, digests = PackRecipe(config), [], []
    for loading in (Loading(), Loading(placement=OFFLOADED), Loading(torch.bfloat16)):
        src, tgt = pair(model_folders, loading)
        windows = calibration_token_windows(src.tokenizer, [text_dir / "calib"], config)
        digests.append(plan_digest(src, tgt, windows, recipe))
        if loading.dtype == torch.float32:
            states.append(collect_shard(src, tgt, windows, recipe, None))
    assert digests[0] == digests[1] != digests[2]
    whole, offloaded = states
    assert whole.windows == offloaded.windows == 8
    for split in ("train", "heldout"):
        for kind in ("k", "v"):
            a, b = (getattr(s.forward, split)[kind] for s in (whole, offloaded))
            assert a.n == b.n
            assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in MOMENT_FIELDS), split


def test_fit_device_map_writes_the_whole_models_pack(model_folders, text_dir, tmp_path):
    source, target, text = model_folders["source"], model_folders["target"], text_dir / "calib"
    packs = []
    for name, extra in (
        ("whole", []),
        ("offloaded", ["--device-map", "auto", "--max-memory", "cpu=100000"]),
    ):
        args = ["fit", source, target, "--out", str(tmp_path / name), "--calibration", str(text)]
        result = CliRunner().invoke(main, [*args, *FIT_ARGS, *extra])
        assert result.exit_code == 0, result.output
        packs.append(load_file(tmp_path / name / "mapper.safetensors"))
    assert "each model across CPU, disk (accelerate, device_map=auto)" in result.stderr
    assert packs[0].keys() == packs[1].keys()
    assert all(torch.equal(packs[0][name], packs[1][name]) for name in packs[0])


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--max-memory", "cpu=1GiB"], "only with --device-map auto"),
        (
            ["--device-map", "auto", "--max-memory", "tpu=1GiB"],
            "DEVICE=SIZE with DEVICE gpu or cpu",
        ),
        (["--device-map", "auto", "--max-memory", "cpu=lots"], "'lots' is not a size"),
    ],
)
def test_fit_refuses_bad_placement_options_before_loading(model_folders, tmp_path, extra, says):
    args = ["fit", model_folders["source"], model_folders["target"], "--out", str(tmp_path / "p")]
    result = CliRunner().invoke(main, [*args, *extra])
    assert result.exit_code == 2 and says in result.stderr, result.output
    assert not (tmp_path / "p").exists()


def test_each_process_owns_an_equal_block_of_its_nodes_gpus():
    assert [process_gpus(rank, 2, 4) for rank in (0, 1)] == [[0, 1], [2, 3]]
    assert process_gpus(0, 1, 3) == [0, 1, 2] and process_gpus(1, 2, 0) == []
    with pytest.raises(KVMapError, match="cannot each own a GPU"):
        process_gpus(0, 3, 2)


def test_max_memory_sizes():
    assert parse_max_memory("gpu=2GiB") == ("gpu", 2 * 2**30)
    assert parse_max_memory("cpu=1000") == ("cpu", 1000)
    with pytest.raises(KVMapError, match="must be positive"):
        Placement(max_memory=(("cpu", 0),))


def test_a_process_budgets_only_its_own_gpus(monkeypatch):
    """A rank's models never spill onto another rank's GPUs: the budget names the process's
    GPUs and the CPU only, each at its --max-memory cap or at what accelerate finds free."""
    free = {0: 10, 1: 11, 2: 12, 3: 13, "cpu": 99}
    monkeypatch.setattr("accelerate.utils.get_max_memory", lambda: dict(free))
    assert Placement().budget([2, 3]) == {2: 12, 3: 13, "cpu": 99}
    capped = Placement(max_memory=(("gpu", 5), ("cpu", 7)))
    assert capped.budget([0, 1]) == {0: 5, 1: 5, "cpu": 7} and capped.budget([]) == {"cpu": 7}
    arguments = capped.loader_arguments([1], "target-rank1")
    assert arguments == {"device_map": "auto", "max_memory": {1: 5, "cpu": 7}}


def test_a_placement_passed_on_as_fit_options_reads_back_the_same(tmp_path):
    """What a build under torchrun (`resolve --build --nproc N --device-map auto ...`) hands the
    `fit` it starts: click parses those options back into the same placement."""
    from sgl_kvmap.cli import _loading, fit

    placement = Placement(max_memory=(("gpu", 5 * 2**30), ("cpu", 7000)), offload_folder=tmp_path)
    args = ["src", "tgt", "--out", str(tmp_path / "pack"), *placement.fit_arguments()]
    with fit.make_context("fit", args) as ctx:
        params = ctx.params
        loading = _loading(
            ctx, "float32", params["device_map"], params["max_memory"], params["offload_folder"]
        )
    assert loading == Loading(placement=placement)
