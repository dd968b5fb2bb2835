import json
import sysconfig
from pathlib import Path

import pytest
from click.testing import CliRunner

from sgl_kvmap.cli import main
from sgl_kvmap.fitting.config import FAMILY_RATES, DemoConfig, PackRecipe

from .conftest import save_loaded


def succeed(args: list[str]):
    """Run the command line with ``args``; it must exit 0."""
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return result


def printed_json(output: str) -> dict:
    """The JSON summary `fit` and `tune` print above their last line."""
    return json.loads(output[: output.rindex("}") + 1])


def tiny_fit(model_dirs, out, *calibration) -> list[str]:
    """`fit` arguments for the tiny pair: a pack at ``out`` from 1,024 tokens of ``calibration``
    (folders or files)."""
    args = ["fit", *model_dirs, "--out", str(out), "--tokens", "1024", "--window", "128"]
    for text in calibration:
        args += ["--calibration", str(text)]
    return args


@pytest.fixture(scope="module")
def model_dirs(tiny_pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return save_loaded(tiny_pair[0], root / "src"), save_loaded(tiny_pair[1], root / "tgt")


@pytest.fixture(scope="module")
def fitted_pack(model_dirs, text_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("packs") / "pack"
    args = tiny_fit(model_dirs, out, text_dir / "calib")
    args += ["--top-k", "2", "--attention-power", "0.5", "--tune-steps", "0"]
    result = succeed(args)
    return out, result.stdout


def test_fit_writes_a_valid_pack_and_prints_its_summary(fitted_pack):
    out, output = fitted_pack
    summary = printed_json(output)
    assert summary["k"] == 2 and summary["rank"] is None  # an explicit --top-k: k layers
    assert summary["train_tokens"] > 0
    assert (out / "mapper.safetensors").is_file()
    recipe = json.loads((out / "kvmap.json").read_text())["calibration"]
    assert recipe["attention_power"] == 0.5 and recipe["heldout_every"] == 8


def test_inspect_shows_the_pair(fitted_pack, model_dirs):
    result = succeed(["inspect", str(fitted_pack[0])])
    assert model_dirs[0] in result.output and "kv 1x32" in result.output and "k 2" in result.output


def test_eval_json_has_every_baseline(fitted_pack, text_dir):
    args = [
        "eval",
        str(fitted_pack[0]),
        "--texts",
        str(text_dir / "eval"),
        "--prefix-len",
        "48",
        "--continuation",
        "16",
        "--tail",
        "4",
        "--windows",
        "2",
        "--anchors",
        "6",
        "--draft",
        "3",
        "--sweeps",
        "1",
        "--speed-tokens",
        "40",
        "--json",
    ]
    result = succeed(args)
    report = json.loads(result.stdout)
    speed = report["speed"]  # the same hand-off, timed against re-prefill
    assert speed["tokens"] == 40 and speed["tail"] == 4 and speed["anchors"] == 6
    assert speed["prefill_seconds"] > 0 and speed["total_seconds"] > speed["map_seconds"] > 0
    table = succeed(args[:-1])  # the same run as a table
    assert "bootstrap intervals over the 2 windows" in table.stdout
    assert "cost at 40 tokens" in table.stdout and "6 anchors, 4-token tail" in table.stdout
    assert {"reference", "mapped", "mapped_tail", "source", "no_prefix", "attention_cosine"} <= set(
        report
    )
    assert report["windows"] == 2 and report["tail"] == 4
    want = "4-token tail + 6 anchors by a 3-token source draft (1 parallel sweep)"
    assert report["repair"] == want
    assert report["repaired"]["nll"] > 0 and "retention_repaired" in report


def test_a_damaged_pack_fails_with_the_reason(fitted_pack, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(fitted_pack[0], broken)
    (broken / "mapper.safetensors").write_bytes(b"0" * 100)
    result = CliRunner().invoke(main, ["inspect", str(broken)])
    assert result.exit_code != 0
    assert "checksum" in str(result.exception)


def test_bad_top_k_is_a_usage_error(model_dirs, tmp_path):
    result = CliRunner().invoke(
        main, ["fit", *model_dirs, "--out", str(tmp_path / "p"), "--top-k", "lots"]
    )
    assert result.exit_code == 2 and "auto" in result.output


def test_fit_defaults_to_an_auto_rank_pack_tuned_at_its_familys_rate(
    model_dirs, text_dir, tmp_path
):
    email = Path(sysconfig.get_paths()["stdlib"]) / "email"  # text for 120 tuning windows
    args = tiny_fit(model_dirs, tmp_path / "p", text_dir, email)
    result = succeed(args)
    pack = json.loads((tmp_path / "p" / "kvmap.json").read_text())
    summary = printed_json(result.stdout)
    assert pack["calibration"]["rank"] == "auto"
    # the guard chose by held-out R2 (which family wins depends on this repository's own text)
    assert pack["rank"] == summary["rank"]
    tuning = pack["calibration"]["tuning"]
    family = "k-layer" if pack["rank"] is None else "reduced-rank"
    assert (tuning["steps"], tuning["warmup"]) == (120, 20)
    assert tuning["lr"] == summary["tune_lr"] == FAMILY_RATES[family]
    args += ["--tune-steps", "0"]
    succeed([*args, "--rank", "96"])
    assert json.loads((tmp_path / "p" / "kvmap.json").read_text())["rank"] == 96
    bad = CliRunner().invoke(main, [*args, "--rank", "many"])
    assert bad.exit_code == 2 and "'auto', 'none' or an integer" in bad.output


def test_top_k_with_a_rank_is_a_usage_error(model_dirs, tmp_path):
    args = ["fit", *model_dirs, "--out", str(tmp_path / "p"), "--top-k", "2"]
    both = CliRunner().invoke(main, [*args, "--rank", "auto"])
    assert both.exit_code == 2 and "--rank none" in both.output


def test_tune_writes_a_tuned_pack_and_its_curve(fitted_pack, text_dir, tmp_path):
    args = [
        "tune",
        str(fitted_pack[0]),
        "--out",
        str(tmp_path / "t"),
        "--calibration",
        str(text_dir / "calib"),
        "--steps",
        "4",
        "--eval-every",
        "2",
        "--prompt-len",
        "48",
        "--continuation",
        "16",
        "--lr",
        "1e-2",
        "--objective",
        "kl",
        "--warmup",
        "1",
        "--tail",
        "4",
    ]
    result = succeed(args)
    summary = printed_json(result.stdout)
    assert [point["step"] for point in summary["curve"]] == [0, 2, 4]
    assert all("heldout_kl" in point for point in summary["curve"])
    pack = json.loads((tmp_path / "t" / "kvmap.json").read_text())
    assert pack["calibration"]["tuning"]["steps"] == 4
    assert pack["calibration"]["tuning"]["objective"] == "kl"
    assert pack["calibration"]["tuning"]["warmup"] == 1
    assert pack["calibration"]["tuning"]["tail"] == 4
    assert pack["calibration"]["heldout_every"] == 8  # the fit's recipe is kept beside it
    assert pack["metrics"]["tune_best_step"] == summary["tune_best_step"]


def test_fit_tunes_with_the_rate_and_objective_it_is_given(model_dirs, text_dir, tmp_path):
    args = tiny_fit(model_dirs, tmp_path / "p", text_dir)
    args += ["--top-k", "2", "--tune-steps", "2", "--tune-lr", "0.01", "--tune-objective", "kl"]
    result = succeed(args)
    summary = printed_json(result.stdout)
    assert summary["tune_steps"] == 2 and summary["tune_objective"] == "kl"
    tuning = json.loads((tmp_path / "p" / "kvmap.json").read_text())["calibration"]["tuning"]
    assert (tuning["steps"], tuning["lr"], tuning["objective"]) == (2, 0.01, "kl")


def test_sglang_args_give_the_target_its_peer_and_pack(fitted_pack, model_dirs):
    import shlex

    from sgl_kvmap.sglang import StorageSettings

    source, target = model_dirs
    args = ["sglang-args", "--engine", source, "--engine", f"{target}=big", "--pack"]
    result = succeed([*args, str(fitted_pack[0]), "--port", "31000"])
    commands = [shlex.split(line) for line in result.output.splitlines() if line.startswith("py")]
    assert len(commands) == 2
    assert "# prefetch deadline:" in result.output and "1 thread" in result.output
    parsed = [sglang_parses(c[3:]) for c in commands]  # SGLang's own parser takes every flag
    assert parsed[1].hicache_storage_prefetch_policy == "timeout"
    flags = [launch_flags(c[3:]) for c in commands]
    assert [f["--port"] for f in flags] == ["31000", "31001"]
    assert flags[1]["--served-model-name"] == "big"
    assert all(f["--hicache-storage-backend"] == "dynamic" for f in flags)
    assert all("--enable-hierarchical-cache" in f for f in flags)
    extra = [json.loads(f["--hicache-storage-backend-extra-config"]) for f in flags]
    assert extra[1]["hicache_storage_pass_prefix_keys"] is True and extra[1]["interface_v1"] == 1
    to_target = StorageSettings.from_extra_config(extra[1])
    assert to_target.translate and [p.model_name for p in to_target.peers] == [source]
    assert to_target.peers[0].pack == str(fitted_pack[0].resolve())
    assert not StorageSettings.from_extra_config(extra[0]).translate  # no pack INTO the source
    assert extra[1]["prefetch_timeout_base"] >= 1 and extra[1]["prefetch_timeout_per_ki_token"] > 0
    assert "prefetch_timeout_base" not in extra[0]  # SGLang's defaults where nothing translates
    mooncake = CliRunner().invoke(main, [*args, str(fitted_pack[0]), "--store", "mooncake"])
    assert mooncake.exit_code == 2 and "'mooncake' is not 'file'" in mooncake.output
    wrong = CliRunner().invoke(
        main, ["sglang-args", "--engine", source, "--pack", str(fitted_pack[0])]
    )
    assert wrong.exit_code != 0 and "not both among the engines" in str(wrong.exception)


def sglang_parses(argv: list[str]):
    """``argv`` as SGLang 0.5.23's server parses it (argparse.Namespace)."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser.parse_args(argv)


def launch_flags(argv: list[str]) -> dict[str, str | None]:
    """--flag value pairs (None for a bare flag)."""
    flags, i = {}, 0
    while i < len(argv):
        has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        flags[argv[i]] = argv[i + 1] if has_value else None
        i += 2 if has_value else 1
    return flags


def test_without_options_fit_and_demo_run_the_library_defaults(model_dirs, tmp_path, monkeypatch):
    """The options' defaults are read from the configs: no option given, `fit` builds exactly
    ``PackRecipe()`` and `demo` runs exactly ``DemoConfig()``."""
    from sgl_kvmap import demo
    from sgl_kvmap.fitting import build

    seen = {}

    class Unsaved:
        def save_pretrained(self, out):
            seen["out"] = out

    def build_pack(source, target, calibration, recipe):
        seen["recipe"] = recipe
        return Unsaved(), {}

    def run_demo(out, config):
        seen["demo"] = config
        return "table"

    monkeypatch.setattr(build, "build_pack", build_pack)
    monkeypatch.setattr(demo, "run_demo", run_demo)
    succeed(["fit", *model_dirs, "--out", str(tmp_path / "pack")])
    assert seen["recipe"] == PackRecipe()
    assert succeed(["demo"]).output == "table\n"
    assert seen["demo"] == DemoConfig()
