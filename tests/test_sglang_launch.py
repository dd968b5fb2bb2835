"""The prefetch deadline ``sglang-args`` sets for engines that translate."""

import pytest

from sgl_kvmap.sglang.launch import PrefetchDeadline, prefetch_deadline


@pytest.mark.parametrize(
    "measured",
    [
        [(512, 0.30), (2048, 1.10)],  # a slow CPU at one thread
        [(512, 0.004), (2048, 0.006)],  # a GPU
        [(512, 2.0), (2048, 7.5)],  # an AVX2-only CPU in bfloat16
    ],
)
def test_the_deadline_leaves_the_margin_at_every_length(measured):
    """SGLang cuts a prefetch at base + per_ki_token x tokens / 1024 seconds: the deadline is at
    least three times the (linear) hand-over time at 2,048 and 8,192 tokens, never below
    SGLang's own defaults (1 s + 0.25 s per 1K tokens)."""
    deadline = prefetch_deadline(measured)
    (n1, t1), (n2, t2) = measured
    per_token = (t2 - t1) / (n2 - n1)
    for tokens in (2048, 8192):
        assert deadline.seconds(tokens) >= 3 * (t1 + per_token * (tokens - n1)) - 1e-6
        assert deadline.seconds(tokens) >= PrefetchDeadline().seconds(tokens)
    assert deadline.sglang_keys() == {
        "prefetch_timeout_base": deadline.base,
        "prefetch_timeout_per_ki_token": deadline.per_ki_token,
    }


def test_cpu_engine_lines_run_as_printed_in_a_shell(model_folders, tmp_path):
    """``device="cpu"``: the environment SGLang's CPU engine needs (its switch, sgl-kvmap's CPU
    stand-ins on PYTHONPATH, a host-memory reserve), then ``python -m sglang.launch_server`` with
    its flags; ``shell_line`` of it, run by bash, starts ``python`` with exactly those arguments
    (the JSON extra config intact) and the variables set. A stand-in ``python`` first on PATH
    records what it was started with."""
    import json
    import os
    import subprocess
    import sys

    from sgl_kvmap.sglang.launch import (
        CPU_ENGINE_FOLDER,
        EngineSpec,
        LaunchOptions,
        engine_commands,
        shell_line,
    )

    engines = [EngineSpec(model_folders["source"], "small", port=31000)]
    options = LaunchOptions(store_path="/tmp/a b", device="cpu", max_total_tokens=64)
    (argv,) = engine_commands(engines, [], options)
    assert argv[:3] == [
        "SGLANG_USE_CPU_ENGINE=1",
        f"PYTHONPATH={CPU_ENGINE_FOLDER}",
        f"KVMAP_HICACHE_RESERVE_BYTES={1 << 30}",
    ]
    assert argv[3:6] == ["python", "-m", "sglang.launch_server"]
    assert (CPU_ENGINE_FOLDER / "sitecustomize.py").is_file()
    assert (CPU_ENGINE_FOLDER / "sgl_kernel" / "kvcacheio.py").is_file()
    assert argv[-6:] == [
        "--device", "cpu", "--attention-backend", "torch_native", "--max-total-tokens", "64"
    ]  # fmt: skip
    recorder = tmp_path / "python"
    recorder.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        "names = ('SGLANG_USE_CPU_ENGINE', 'PYTHONPATH', 'KVMAP_HICACHE_RESERVE_BYTES')\n"
        "print(json.dumps([[os.environ.get(n) for n in names], sys.argv[1:]]))\n"
    )
    recorder.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    env.pop("SGLANG_USE_CPU_ENGINE", None)
    ran = subprocess.run(["bash", "-c", shell_line(argv)], env=env, capture_output=True, text=True)
    variables = [word.split("=", 1)[1] for word in argv[:3]]
    assert json.loads(ran.stdout) == [variables, argv[4:]]


def test_cuda_engine_lines_are_unchanged_by_the_cpu_options(model_folders):
    """The default device is cuda: no environment word, no CPU flag; ``max_total_tokens`` adds
    only its flag; an unknown device is refused."""
    from sgl_kvmap.core.errors import KVMapError
    from sgl_kvmap.sglang.launch import EngineSpec, LaunchOptions, engine_commands

    engines = [EngineSpec(model_folders["source"], "small")]
    (default,) = engine_commands(engines, [])
    assert default[:3] == ["python", "-m", "sglang.launch_server"]
    assert "--device" not in default and "--max-total-tokens" not in default
    assert engine_commands(engines, [], LaunchOptions(device="cuda")) == [default]
    (sized,) = engine_commands(engines, [], LaunchOptions(max_total_tokens=8))
    assert sized == [*default, "--max-total-tokens", "8"]
    with pytest.raises(KVMapError, match="device must be one of"):
        LaunchOptions(device="tpu")


def test_the_prefetch_threshold_reaches_sglangs_parser(model_folders):
    """``prefetch_threshold`` goes into every engine's extra config, where SGLang's own parser
    (``HybridCacheController.parse_storage_backend_extra_config``, what attaching the storage
    backend calls) reads it; by default it is one page, and with None SGLang keeps its 256
    tokens. Below one token it is refused."""
    import json

    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
        HybridCacheController,
    )

    from sgl_kvmap.core.errors import KVMapError
    from sgl_kvmap.sglang.launch import (
        PAGE_SIZE,
        PREFETCH_THRESHOLD,
        EngineSpec,
        LaunchOptions,
        engine_commands,
    )

    engines = [EngineSpec(model_folders["source"], "small")]

    def parsed_threshold(options: LaunchOptions) -> int:
        (argv,) = engine_commands(engines, [], options)
        extra = argv[argv.index("--hicache-storage-backend-extra-config") + 1]
        _, threshold, *_ = HybridCacheController.parse_storage_backend_extra_config(extra)
        json.loads(extra)  # one JSON word on the command line
        return threshold

    assert parsed_threshold(LaunchOptions(page_size=16, prefetch_threshold=32)) == 32
    assert parsed_threshold(LaunchOptions()) == PREFETCH_THRESHOLD == PAGE_SIZE
    assert parsed_threshold(LaunchOptions(prefetch_threshold=None)) == 256
    with pytest.raises(KVMapError, match="prefetch threshold 0 < 1"):
        LaunchOptions(prefetch_threshold=0)


def test_a_recorded_figure_too_large_for_a_float_counts_as_none():
    """Before: a pack recording an integer figure of 10**400 raised OverflowError in
    ``sglang-args`` (and in a server's floor check); it is now no measured figure: refused with
    the message that says what to run."""
    from sgl_kvmap.sglang.settings import StorageSettings

    settings = StorageSettings(tail_pages=0)
    metrics = {"eval_gap_closed": 10**400, "eval_retention": -(10**400)}
    assert settings.recorded_gap_closed(metrics, 16) == ("eval_gap_closed", None)
    assert "records no measured eval_gap_closed" in settings.floor_refusal(metrics, 16)
