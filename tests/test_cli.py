import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from sgl_kvmap.cli import main
from sgl_kvmap.fitting.config import FAMILY_RATES, DemoConfig, PackRecipe
from sgl_kvmap.sglang.launch import CPU_ENVIRONMENT

from .conftest import save_loaded, tiny_model


def succeed(args: list[str]):
    """Run the command line with ``args``; it must exit 0."""
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return result


def fail_in_one_line(args: list[str]) -> str:
    """Run the command line with ``args``; it must exit 1 with one line ``error: ...`` on
    stderr and nothing on stdout. Returns that line."""
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    assert result.stdout == "" and len(result.stderr.splitlines()) == 1, result.output
    assert result.stderr.startswith("error: ")
    return result.stderr


def refused_as_usage(args: list[str], option: str) -> str:
    """Run the command line with ``args``; click must refuse ``option`` (exit 2, its format)."""
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{option}'" in result.stderr, result.output
    return result.stderr


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


def test_a_damaged_pack_fails_in_one_line_with_the_reason(fitted_pack, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(fitted_pack[0], broken)
    (broken / "mapper.safetensors").write_bytes(b"0" * 100)
    assert "checksum" in fail_in_one_line(["inspect", str(broken)])
    verbose = CliRunner().invoke(main, ["--verbose", "inspect", str(broken)])
    assert verbose.exit_code == 1 and "Traceback (most recent call last)" in verbose.stderr
    assert verbose.stderr.splitlines()[-1].startswith("error: ") and "checksum" in verbose.stderr


def test_a_missing_pack_fails_in_one_line_that_names_it(tmp_path):
    for command in (["inspect"], ["eval"], ["tune", "--out", str(tmp_path / "t")]):
        line = fail_in_one_line([*command, str(tmp_path / "nowhere")])
        assert f"{tmp_path / 'nowhere'} is not a mapper pack" in line


def test_an_os_error_fails_in_one_line(fitted_pack, monkeypatch):
    """An OSError met anywhere in a command (here: reading the pack) is one line too."""
    from sgl_kvmap.core.mapper import KVMapper

    def unreadable(cls, folder):
        raise PermissionError(13, "Permission denied", str(folder))

    monkeypatch.setattr(KVMapper, "from_pretrained", classmethod(unreadable))
    assert "Permission denied" in fail_in_one_line(["inspect", str(fitted_pack[0])])


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
    args += ["--tune-steps", "0", "--overwrite"]  # the same folder again
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
    alone = fail_in_one_line([*args, str(fitted_pack[0]), "--store", "mooncake"])
    assert "--mooncake-master" in alone
    mooncake = succeed([*args, str(fitted_pack[0]), "--store", "mooncake", "--mooncake-master",
                        "10.0.0.5:50051"])  # fmt: skip
    lines = mooncake.output.splitlines()
    master = shlex.split(next(line for line in lines if line.startswith("mooncake_master")))
    assert "--rpc_port=50051" in master and "--enable_http_metadata_server=true" in master
    commands = [shlex.split(line) for line in lines if line.startswith("py")]
    flags = [launch_flags(c[3:]) for c in commands]
    extra = [json.loads(f["--hicache-storage-backend-extra-config"]) for f in flags]
    assert [sglang_parses(c[3:]).hicache_storage_backend for c in commands] == ["dynamic"] * 2
    assert all(e["master_server_address"] == "10.0.0.5:50051" for e in extra)
    assert all(e["metadata_server"] == "http://10.0.0.5:8080/metadata" for e in extra)
    assert all(e["inner_backend"] == "mooncake" and "file_storage_path" not in e for e in extra)
    wrong = fail_in_one_line(["sglang-args", "--engine", source, "--pack", str(fitted_pack[0])])
    assert "not both among the engines" in wrong


def test_sglang_args_for_cpu_engines_print_lines_a_shell_runs(fitted_pack, model_dirs):
    """``--device cpu``: each printed line is ``SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=<sgl-kvmap's
    CPU stand-ins> KVMAP_HICACHE_RESERVE_BYTES=<1 GiB> python -m sglang.launch_server ...`` with
    SGLang's CPU engine flags (torch-native attention) and ``--max-total-tokens`` when given,
    every flag taken by SGLang's own parser, the cache report among them; the default
    (``--device cuda``, no sizing) prints no environment and no flag of either."""
    source, target = model_dirs
    args = ["sglang-args", "--engine", source, "--engine", target, "--pack", str(fitted_pack[0])]
    cpu = commands_of(succeed([*args, "--device", "cpu", "--max-total-tokens", "4096"]).output)
    commands = [shlex.split(line) for line in cpu]
    assert len(commands) == 2
    for words in commands:
        assert [word.split("=")[0] for word in words[:3]] == [*CPU_ENVIRONMENT]
        assert words[3:6] == ["python", "-m", "sglang.launch_server"]
        parsed = sglang_parses(words[6:])
        assert (parsed.device, parsed.attention_backend) == ("cpu", "torch_native")
        assert parsed.max_total_tokens == 4096 and parsed.enable_hierarchical_cache
        assert parsed.enable_cache_report and parsed.sleep_on_idle
    gpu = commands_of(succeed(args).output)
    assert commands_of(succeed([*args, "--device", "cuda"]).output) == gpu
    assert len(gpu) == 2 and all(line.startswith("python -m sglang.launch_server ") for line in gpu)
    assert not any(flag in line for line in gpu for flag in ("--device", "--max-total-tokens"))
    sized = commands_of(succeed([*args, "--max-total-tokens", "65536"]).output)
    assert sized == [f"{line} --max-total-tokens 65536" for line in gpu]
    refused_as_usage([*args, "--device", "tpu"], "--device")
    refused_as_usage([*args, "--max-total-tokens", "0"], "--max-total-tokens")


def test_eval_record_writes_what_it_measured_into_the_pack(fitted_pack, text_dir, tmp_path):
    """``eval --record``: the pack (a copy) is saved again with the evaluation's figures among
    its metrics, the gap closed engines check against their floor included; a download in the
    Hugging Face cache is refused."""
    import shutil

    from sgl_kvmap.core.mapper import KVMapper
    from sgl_kvmap.sglang.settings import StorageSettings

    pack = Path(shutil.copytree(fitted_pack[0], tmp_path / "pack"))
    args = ["eval", str(pack), "--texts", str(text_dir / "eval"), "--prefix-len", "48"]
    args += ["--continuation", "16", "--tail", "4", "--windows", "2", "--json", "--record"]
    report = json.loads(succeed(args).stdout)
    metrics = KVMapper.from_pretrained(pack).info["metrics"]
    assert StorageSettings(tail_pages=1).recorded_gap_closed(metrics, page_size=16) == (
        "eval_gap_closed_tail",
        report["gap_closed_tail"],
    )
    assert metrics.get("eval_retention") == report["retention"] and metrics["eval_tail"] == 4
    assert metrics["eval_command"].startswith("sgl-kvmap eval")
    snapshot = Path(shutil.copytree(pack, tmp_path / "snapshots" / ("0" * 40)))
    refused_as_usage(["eval", str(snapshot), "--record"], "--record")


def test_sglang_args_say_which_packs_clear_the_quality_floor(fitted_pack, model_dirs, tmp_path):
    """Each engine's extra config carries the floor; a comment line per pack says the gap closed
    it records for the engines' mode and whether it is used (a pack that records none is not,
    at the default floor: better than staying on the source)."""
    from sgl_kvmap.core.mapper import KVMapper
    from sgl_kvmap.sglang import StorageSettings

    source, target = model_dirs
    args = ["sglang-args", "--engine", source, "--engine", f"{target}=big"]

    def printed(pack, *more):
        result = succeed([*args, "--pack", str(pack), *more])
        floors = [line for line in result.output.splitlines() if line.startswith("# pack ")]
        big = [launch_flags(shlex.split(c)) for c in commands_of(result.output)][1]
        extra = json.loads(big["--hicache-storage-backend-extra-config"])
        return floors, StorageSettings.from_extra_config(extra).quality_floor

    floors, floor = printed(fitted_pack[0])
    assert floor == 0.0 and len(floors) == 1
    assert "records no eval_gap_closed_tail; NOT used, big prefills instead" in floors[0]
    assert printed(fitted_pack[0], "--quality-floor", "none") == (
        [f"# pack {Path(source).resolve()} -> big records no eval_gap_closed_tail; used (no "
         "quality floor)"],
        None,
    )  # fmt: skip
    mapper = KVMapper.from_pretrained(fitted_pack[0])
    mapper.info["metrics"].update(eval_gap_closed_tail=0.25, eval_gap_closed=-0.5, eval_tail=32)
    recorded = mapper.save_pretrained(tmp_path / "recorded")
    floors, floor = printed(recorded, "--quality-floor", "0.2")
    assert (
        floor == 0.2
        and "records eval_gap_closed_tail 0.250 (measured with a 32-token tail" in (floors[0])
    )
    assert "these engines recompute 48); used: above" in floors[0]
    floors, _ = printed(recorded, "--tail-pages", "0")
    assert "records eval_gap_closed -0.500; NOT used" in floors[0]
    # a served figure (bench --record) is read first, where it was served as these engines serve
    mapper.info["metrics"].update(
        served_gap_closed_tail_low=0.4, served_swaps_tail=24, served_trace="a trace",
        served_gap_closed_low=-0.3, served_tail=48, served_page_size=16, served_sinks="native",
    )  # fmt: skip
    served = mapper.save_pretrained(tmp_path / "served")
    floors, _ = printed(served, "--quality-floor", "0.3")
    assert (
        "records served_gap_closed_tail_low 0.400 (the low end of its interval over 24"
        in (floors[0])
    )
    assert "bench --record` on a trace); used: above the quality floor 0.3" in floors[0]
    floors, _ = printed(served, "--tail-pages", "0")
    assert "records served_gap_closed_low -0.300" in floors[0] and "NOT used" in floors[0]
    others = (["--tail-pages", "2"], ["--page-size", "32"], ["--sinks", "translate"])
    for other in (*others, ["--derived", "share"]):
        floors, _ = printed(served, "--quality-floor", "0.3", *other)
        assert "records eval_gap_closed_tail 0.250" in floors[0] and "NOT used" in floors[0]
    result = succeed([*args, "--page-size", "16", "--prefetch-threshold", "32"])
    for command in commands_of(result.output):
        flags = launch_flags(shlex.split(command))
        extra = json.loads(flags["--hicache-storage-backend-extra-config"])
        assert flags["--page-size"] == "16" and extra["prefetch_threshold"] == 32
        assert extra["derived"] == "withhold"
    for command in commands_of(succeed([*args, "--derived", "share"]).output):
        extra = json.loads(
            launch_flags(shlex.split(command))["--hicache-storage-backend-extra-config"]
        )
        assert extra["derived"] == "share"
    refused_as_usage([*args, "--derived", "keep"], "--derived")
    refused_as_usage([*args, "--prefetch-threshold", "0"], "--prefetch-threshold")
    for bad in ("1.5", "nan", "-2", "high"):
        refused_as_usage(
            [*args, "--pack", str(recorded), "--quality-floor", bad], "--quality-floor"
        )


def test_sglang_args_read_the_hand_off_as_served_and_a_no_gap_packs_retention(
    fitted_pack, model_dirs, tmp_path
):
    """The library's figure of the hand-off as these engines serve it (``eval --record``) is
    read before its own hand-off's when measured at their page size and tail; a pack whose
    target does not beat its source is read by its retention against ``--retention-floor``,
    and the line says how to get a figure rather than asking for the one it already has."""
    from sgl_kvmap.core.mapper import KVMapper

    source, target = model_dirs
    args = ["sglang-args", "--engine", source, "--engine", f"{target}=big"]

    def floor_line(metrics, *more):
        mapper = KVMapper.from_pretrained(fitted_pack[0])
        mapper.info["metrics"].update(metrics)
        pack = mapper.save_pretrained(tmp_path / f"pack-{len(list(tmp_path.iterdir()))}")
        result = succeed([*args, "--pack", str(pack), *more])
        (line,) = [line for line in result.output.splitlines() if line.startswith("# pack ")]
        return line

    as_served = {"eval_served_page_size": 16, "eval_served_tail": 48}
    line = floor_line({"eval_gap_closed_tail": -0.5, **as_served, "eval_gap_closed_served": 0.3})
    assert "records eval_gap_closed_served 0.300 (the library's hand-off as these engines " in line
    assert "16-token pages, the first computed, a 48-token tail); used: above" in line
    line = floor_line({"eval_gap_closed_tail": -0.5, **as_served, "eval_gap_closed_served": 0.3},
                      "--tail-pages", "2")  # fmt: skip
    assert "records eval_gap_closed_tail -0.500" in line and "NOT used" in line
    no_gap = {"eval_source_accuracy": 0.75, "eval_reference_accuracy": 0.68, **as_served}
    line = floor_line({**no_gap, "eval_retention_served": 0.97})
    assert "records eval_retention_served 0.970" in line
    assert "used: no gap to close, retention at least 0.95" in line
    line = floor_line({**no_gap, "eval_retention_served": 0.97}, "--retention-floor", "0.98")
    assert "below the retention floor 0.98" in line and "NOT used" in line
    line = floor_line(no_gap)
    assert "no gap to close" in line and "eval PACK --record --page-size 16 --tail-pages 3" in line
    assert "--quality-floor none" in line and "quality_floor null" not in line
    refused_as_usage([*args, "--retention-floor", "1.5"], "--retention-floor")


def test_sglang_args_refuses_engine_lists_that_would_mix_up_kv(fitted_pack, model_dirs):
    """Before: two engines under one served name, or one model as two engines, were accepted
    (peers keyed by name or fingerprint collapsed: one engine then got another model's KV as
    its own); the same pack twice gave the target a duplicate peer; the page size had no
    upper bound."""
    source, target = model_dirs
    pack = str(fitted_pack[0])
    same_name = ["--engine", f"{source}=m", "--engine", f"{target}=m", "--pack", pack]
    assert "'m' is given to two engines" in fail_in_one_line(["sglang-args", *same_name])
    # two names SGLang's stores spell as one ("team/coder" and "team-coder" key the same files)
    one_in_store = ["--engine", f"{source}=team/coder", "--engine", f"{target}=team-coder"]
    message = fail_in_one_line(["sglang-args", *one_in_store, "--pack", pack])
    assert "'team/coder' and 'team-coder' are one name in the store" in message
    same_model = ["--engine", f"{source}=a", "--engine", f"{source}=b", "--engine", target]
    assert "serve the same model" in fail_in_one_line(["sglang-args", *same_model])
    twice = ["--engine", source, "--engine", target, "--pack", pack, "--pack", pack]
    assert "is given twice" in fail_in_one_line(["sglang-args", *twice])
    nameless = ["sglang-args", "--engine", "no/such/model=", "--engine", target]
    assert "MODEL_PATH=SERVED_NAME" in fail_in_one_line(nameless)
    refused_as_usage(["sglang-args", "--engine", source, "--page-size", "100000"], "--page-size")


def test_sglang_args_prints_absolute_paths_and_reads_equals_signs_in_them(
    fitted_pack, model_dirs, tmp_path, monkeypatch
):
    """A model folder whose path holds "=" is one path (before: split at the first "=" into a
    wrong path and a served name); relative model, pack and store paths are printed absolute,
    so the lines run from any folder."""
    source, target = model_dirs
    odd = tmp_path / "models=v2" / "small"
    odd.parent.mkdir()
    odd.symlink_to(Path(source).resolve())
    monkeypatch.chdir(tmp_path)
    pack = os.path.relpath(fitted_pack[0], tmp_path)
    args = ["sglang-args", "--engine", "models=v2/small", "--engine", f"{target}=big"]
    output = succeed([*args, "--pack", pack, "--store-path", "store"]).output
    flags = [launch_flags(shlex.split(line)[3:]) for line in commands_of(output)]
    assert flags[0]["--model-path"] == str(Path(source).resolve())
    assert flags[0]["--served-model-name"] == str(Path(source).resolve())
    extra = json.loads(flags[1]["--hicache-storage-backend-extra-config"])
    assert extra["file_storage_path"] == str(tmp_path / "store")
    assert Path(extra["peers"][0]["pack"]).is_absolute()
    assert Path(extra["peers"][0]["model_path"]) == Path(source).resolve()


def commands_of(output: str) -> list[str]:
    """The command lines of ``sglang-args``' output (its comment lines say what was measured
    on this machine, and name each engine)."""
    return [line for line in output.splitlines() if not line.startswith("#")]


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
        info = {"metrics": {}}

        def save_pretrained(self, out, overwrite):
            seen["out"] = out
            seen["command"] = self.info["metrics"]["command"]

    def build_pack(source, target, calibration, recipe):
        seen["recipe"] = recipe
        return Unsaved(), {}

    def run_demo(out, config):
        seen["demo"] = config
        return "table"

    monkeypatch.setattr(build, "build_pack", build_pack)
    monkeypatch.setattr(demo, "run_demo", run_demo)
    args = ["fit", *model_dirs, "--out", str(tmp_path / "pack")]
    succeed(args)
    assert seen["recipe"] == PackRecipe()
    # the card records the command line as given, not pytest's own sys.argv
    assert seen["command"] == shlex.join(["sgl-kvmap", *args])
    assert succeed(["demo"]).output == "table\n"
    assert seen["demo"] == DemoConfig()


def numeric_options():
    """(command, option) of every option of every command whose values are numbers."""
    numeric = (int, float)
    for name, command in main.commands.items():
        for param in command.params:
            if isinstance(param, click.Option) and not param.is_flag:
                if param.type in (click.INT, click.FLOAT) or isinstance(param.default, numeric):
                    yield name, param


def test_every_numeric_option_has_a_checked_type():
    """No option takes a bare int or float: each states its range (or a custom check)."""
    options = list(numeric_options())
    assert len(options) > 30
    for name, param in options:
        assert param.type not in (click.INT, click.FLOAT), f"{name} {param.opts[0]}"


@pytest.mark.parametrize(
    "args, option",
    [
        (["eval", "PACK", "--windows", "0"], "--windows"),
        (["eval", "PACK", "--windows", "-3"], "--windows"),
        (["eval", "PACK", "--speed-tokens", "-5"], "--speed-tokens"),
        (["eval", "PACK", "--speed-tokens", "1"], "--speed-tokens"),
        (["eval", "PACK", "--tail", "-1"], "--tail"),
        (["eval", "PACK", "--tail", "1000", "--prefix-len", "1000"], "--tail"),
        (["eval", "PACK", "--prefix-len", "1"], "--prefix-len"),
        (["eval", "PACK", "--continuation", "0"], "--continuation"),
        (["eval", "PACK", "--anchors", "-1"], "--anchors"),
        (["eval", "PACK", "--draft", "0"], "--draft"),
        (["eval", "PACK", "--sweeps", "-1"], "--sweeps"),
        (["fit", "S", "T", "--out", "OUT", "--sink-tokens", "-1"], "--sink-tokens"),
        (["fit", "S", "T", "--out", "OUT", "--ridge", "nan"], "--ridge"),
        (["fit", "S", "T", "--out", "OUT", "--ridge", "-1"], "--ridge"),
        (["fit", "S", "T", "--out", "OUT", "--attention-power", "inf"], "--attention-power"),
        (["fit", "S", "T", "--out", "OUT", "--tune-lr", "nan"], "--tune-lr"),
        (["fit", "S", "T", "--out", "OUT", "--tune-lr", "0"], "--tune-lr"),
        (["fit", "S", "T", "--out", "OUT", "--tokens", "0"], "--tokens"),
        (["fit", "S", "T", "--out", "OUT", "--window", "1"], "--window"),
        (["fit", "S", "T", "--out", "OUT", "--stride", "0"], "--stride"),
        (["fit", "S", "T", "--out", "OUT", "--tune-steps", "-1"], "--tune-steps"),
        (["fit", "S", "T", "--out", "OUT", "--rank", "0"], "--rank"),
        (["fit", "S", "T", "--out", "OUT", "--top-k", "-2"], "--top-k"),
        (["fit", "S", "T", "--out", "OUT", "--sink-tokens", "2000000"], "--sink-tokens"),
        (["sglang-args", "--engine", "M", "--page-size", "100000"], "--page-size"),
        (["tune", "PACK", "--out", "OUT", "--steps", "0"], "--steps"),
        (["tune", "PACK", "--out", "OUT", "--lr", "inf"], "--lr"),
        (["tune", "PACK", "--out", "OUT", "--tail", "47", "--prompt-len", "48"], "--tail"),
        (["tune", "PACK", "--out", "OUT", "--warmup", "-1"], "--warmup"),
        (["tune", "PACK", "--out", "OUT", "--eval-every", "0"], "--eval-every"),
        (["tune", "PACK", "--out", "OUT", "--residual-hidden", "-8"], "--residual-hidden"),
        (["demo", "--bench-tokens", "1"], "--bench-tokens"),
        (["demo", "--tail", "2000"], "--tail"),
        (["demo", "--windows", "0"], "--windows"),
        (["sglang-args", "--engine", "M", "--port", "-5"], "--port"),
        (["sglang-args", "--engine", "M", "--port", "70000"], "--port"),
        (["sglang-args", "--engine", "M", "--engine", "N", "--port", "65535"], "--port"),
        (["sglang-args", "--engine", "M", "--tp", "0"], "--tp"),
        (["sglang-args", "--engine", "M", "--page-size", "-1"], "--page-size"),
    ],
)
def test_bad_numbers_are_refused_naming_the_option(args, option, monkeypatch):
    """Refused before anything runs: nothing is loaded, fitted or launched."""
    from sgl_kvmap import demo
    from sgl_kvmap.core.mapper import KVMapper
    from sgl_kvmap.fitting import build

    def never(*args, **kwargs):
        raise AssertionError("ran with a bad number")

    monkeypatch.setattr(build, "build_pack", never)
    monkeypatch.setattr(demo, "run_demo", never)
    monkeypatch.setattr(KVMapper, "from_pretrained", never)
    refused_as_usage(args, option)


def test_cross_field_rules_of_the_configs_are_usage_errors(model_dirs, tmp_path):
    """What only a config's validation sees (calibration shorter than two windows) is refused
    as a usage error too, before any model loads."""
    result = CliRunner().invoke(
        main, ["fit", *model_dirs, "--out", str(tmp_path / "p"), "--tokens", "100"]
    )
    assert result.exit_code == 2 and "two windows of calibration" in result.stderr


def test_fit_refuses_an_existing_pack_before_fitting_unless_told_to_overwrite(
    fitted_pack, model_dirs, text_dir, tmp_path, monkeypatch
):
    import shutil

    from sgl_kvmap.fitting import build

    out = tmp_path / "pack"
    shutil.copytree(fitted_pack[0], out)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("mine")
    real_build = build.build_pack

    def never(*args, **kwargs):
        raise AssertionError("fitted before refusing the destination")

    monkeypatch.setattr(build, "build_pack", never)
    args = tiny_fit(model_dirs, out, text_dir / "calib") + ["--top-k", "2", "--tune-steps", "0"]
    assert "--overwrite" in fail_in_one_line(args)
    args_notes = [*args[:4], str(tmp_path / "notes"), *args[5:]]
    assert "is not a mapper pack" in fail_in_one_line(args_notes)
    assert (tmp_path / "notes" / "mine.txt").read_text() == "mine"
    tune_args = ["tune", str(fitted_pack[0]), "--out", str(out)]
    assert "--overwrite" in fail_in_one_line(tune_args)

    monkeypatch.setattr(build, "build_pack", real_build)
    before = (out / "kvmap.json").read_text()
    succeed([*args, "--overwrite", "--sink-tokens", "2"])
    assert (out / "kvmap.json").read_text() != before
    assert json.loads((out / "kvmap.json").read_text())["sink_tokens"] == 2


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    """A model folder of another geometry than the fitted pack's source (2 layers)."""
    return save_loaded(tiny_model("qwen2", seed=3, layers=2), tmp_path_factory.mktemp("other"))


def test_a_pack_for_other_models_is_refused_before_any_weight_loads(
    fitted_pack, other_model, tmp_path, monkeypatch
):
    """eval and tune compare the pack's fingerprints with the models' configs and tokenizers:
    the weight loader is replaced by one that fails, so a load would show."""
    from sgl_kvmap.models import capture

    def never(*args, **kwargs):
        raise AssertionError("loaded weights before checking the pair")

    monkeypatch.setattr(capture, "load_model", never)
    pack = str(fitted_pack[0])
    line = fail_in_one_line(["eval", pack, "--source", other_model])
    assert "this pack's source is" in line and "num_layers: 3 vs 2" in line
    line = fail_in_one_line(["tune", pack, "--out", str(tmp_path / "t"), "--target", other_model])
    assert "this pack's target is" in line


def run_cli(args: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess, float]:
    """``sgl-kvmap args`` in a fresh process (this checkout's package) and its seconds."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), **env}
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "sgl_kvmap.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done, time.monotonic() - start


@pytest.mark.parametrize("offline", [True, False])
def test_an_unknown_hub_id_fails_in_one_line_at_once(model_dirs, tmp_path, offline):
    """Offline, or online where the Hub cannot be reached (or has no such repo), a model given
    as a Hub id that is not cached is refused in one line within seconds (transformers alone
    retried the network for about a minute)."""
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1" if offline else "0"}
    args = ["fit", "sgl-kvmap-tests/no-such-model", model_dirs[1], "--out", str(tmp_path / "p")]
    done, seconds = run_cli(args, env)
    assert done.returncode == 1, done.stderr
    assert done.stdout == "" and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("error: sgl-kvmap-tests/no-such-model")
    assert ("HF_HUB_OFFLINE is set" in done.stderr) == offline
    assert seconds < 40  # a loaded 2-core machine needs up to ~25 s to import; the retries ~60
    assert not (tmp_path / "p").exists()


@pytest.fixture
def hf_caches(tmp_path, monkeypatch):
    """huggingface_hub's caches of Hub packs and of packs built here, in temporary folders, for
    commands run in this process (huggingface_hub reads HF_HOME once, on import)."""
    import huggingface_hub.utils._cache_assets as assets
    import huggingface_hub.utils._cache_manager as hub_cache
    from huggingface_hub import constants

    for module in (assets, constants):  # huggingface_hub's copy and the one sgl-kvmap reads
        monkeypatch.setattr(module, "HF_ASSETS_CACHE", str(tmp_path / "assets"))
    for module in (hub_cache, constants):
        monkeypatch.setattr(module, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return {"cache_dir": tmp_path / "hub", "assets_dir": tmp_path / "assets"}


def test_resolve_build_never_returns_another_recipes_pack_and_each_command_names_the_recipe(
    model_dirs, fitted_pack, hf_caches, monkeypatch
):
    """Issue 30 through the command line: after a cheap build (the benchmark's route), `resolve`
    takes it and says which recipe it is; `resolve --build` builds the default recipe's pack
    instead; `list` and `inspect` name every pack's recipe."""
    from sgl_kvmap.registry.resolve import resolve_pack

    from .test_resolve import SMALL_RECIPE, build_cheaply

    cheap = resolve_pack(*model_dirs, build=True, local_files_only=True, recipe=SMALL_RECIPE)
    cheap_recipe = f"recipe {SMALL_RECIPE.key()}: 512 calibration tokens, top-k 1, not tuned"
    found = succeed(["resolve", *model_dirs, "--offline"])
    assert found.stdout == f"{cheap}\n" and found.stderr.splitlines()[-1] == cheap_recipe
    asked = build_cheaply(monkeypatch)
    built = succeed(["resolve", *model_dirs, "--build", "--offline"])
    default = Path(built.stdout.strip())
    assert asked == [PackRecipe()] and default != cheap
    default_recipe = f"recipe {PackRecipe().key()} (the default): 512 calibration tokens, top-k 2"
    assert built.stderr.splitlines()[-1] == default_recipe + ", not tuned"
    assert succeed(["resolve", *model_dirs, "--offline"]).stdout == f"{default}\n"
    listed = succeed(["list"]).stdout.splitlines()
    assert len(listed) == 2
    assert listed[0].endswith(f"  {default_recipe}, not tuned  {default}")
    assert listed[1].endswith(f"  {cheap_recipe}  {cheap}")
    assert default_recipe in succeed(["inspect", str(default)]).stdout.splitlines()[3]
    lines = succeed(["inspect", str(fitted_pack[0])]).stdout.splitlines()
    assert lines[3] == "recipe 1,024 calibration tokens, top-k 2, not tuned"


def test_resolve_build_with_a_device_map_loads_the_models_sharded_and_builds_the_same_pack(
    model_dirs, hf_caches, monkeypatch
):
    """Issue 33: `resolve --build --device-map auto` (for a pair one device cannot hold) loads
    each model through accelerate's device map, here offloaded to disk but for 100 kB of CPU, and
    builds what the plain build does, bit for bit. Substituted:
    the fit runs STAND_IN's cheap recipe instead of the default's (as `build_cheaply` in the other
    build tests); the torchrun route (`--nproc 2`) adds `--device-map auto` to the `fit` it
    starts, whose sharded loading tests/test_distributed.py checks, and is not run here (the
    default recipe takes minutes)."""
    from sgl_kvmap.fitting.build import build_pack
    from sgl_kvmap.models.capture import LoadedModel
    from sgl_kvmap.registry import resolve

    from .test_resolve import STAND_IN

    asked, loaded = [], []

    def stand_in(source, target, calibration, recipe):
        asked.append(recipe)
        loaded.append((source, target))
        return build_pack(source, target, calibration, STAND_IN)

    monkeypatch.setattr(resolve, "build_pack", stand_in)
    offloaded = ["--device-map", "auto", "--max-memory", "cpu=100000"]  # most weights on disk
    sharded = succeed(["resolve", *model_dirs, "--build", "--offline", *offloaded])
    assert sharded.stderr.splitlines()[0] == (
        "a build fits in 1 process(es), each model across its process's devices"
    )
    assert asked == [PackRecipe()]
    for model in loaded[0]:
        assert isinstance(model, LoadedModel) and "disk" in model.model.hf_device_map.values()
    sharded_pack = Path(sharded.stdout.strip())
    want = load_file(sharded_pack / "mapper.safetensors")
    shutil.rmtree(sharded_pack.parent)
    plain = succeed(["resolve", *model_dirs, "--build", "--offline"])
    assert plain.stderr.splitlines()[0] == "a build fits in 1 process(es)"
    assert Path(plain.stdout.strip()) == sharded_pack and loaded[1] == model_dirs
    got = load_file(sharded_pack / "mapper.safetensors")
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)


def test_bench_refuses_an_out_it_could_not_write_before_any_work(tmp_path, monkeypatch):
    """Before: `bench` ran its replays (minutes to an hour) and only then found that --out was
    another folder of the user's or under a file."""
    from sgl_kvmap.bench import run

    def never(*args, **kwargs):
        raise AssertionError("worked before checking --out")

    monkeypatch.setattr(run, "pair_and_packs", never)
    (tmp_path / "a-file").write_text("x")
    line = fail_in_one_line(["bench", "--out", str(tmp_path / "a-file" / "run")])
    assert "a-file is not a folder" in line
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "data.csv").write_text("1")
    assert "not a benchmark run's output" in fail_in_one_line(
        ["bench", "--out", str(tmp_path / "mine")]
    )
    assert (tmp_path / "mine" / "data.csv").read_text() == "1"
