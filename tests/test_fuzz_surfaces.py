"""Property-based fuzz of the surfaces issue 34 left unfuzzed: page records as a reader finds
them in a store, the extra config SGLang hands KVMapStorage, and `sgl-kvmap sglang-args`'
argument lists. Each input ends in a result or in the project's one clear refusal, never in
another exception (tests/test_manifest.py and tests/test_bench_workload.py fuzz the pack files
and the traces)."""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from sgl_kvmap.core.errors import KVMapError
from sgl_kvmap.sglang.pages import DTYPES, PageFormat
from sgl_kvmap.sglang.records import RECORD_BYTES, PageRecord

from .conftest import hicache_storage_config

FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# text a user or a file may hold: control characters, quotes, '=' and separators included
TEXT = st.text(alphabet=st.characters(codec="utf-8") | st.sampled_from("\x00\x1b\n\r=/@ ."))
# numbers past float's range and the edges of int64, which JSON holds and Python reads
EXTREMES = st.sampled_from([10**400, -(10**400), 2**63, -(2**63) - 1, float("nan"), -0.0])
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | EXTREMES
    | TEXT.filter(lambda s: len(s) < 12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)

# -- page records ---------------------------------------------------------------------------

RECORD = PageRecord(
    index=3,
    parent="p" * 64,
    page=PageFormat("page_first", 64, 28, 2, 128, torch.bfloat16),
    tp_rank=0,
    tp_size=1,
    model="a" * 32 + ":" + "b" * 32,
    crc32=1234,
)


def as_tensor(data: bytes) -> torch.Tensor:
    return torch.tensor(list(data), dtype=torch.uint8)


def parsed_or_refused(data: bytes) -> PageRecord | None:
    """The record ``data`` holds, or None where the reader refuses it with a KVMapError."""
    try:
        return PageRecord.from_tensor(as_tensor(data))
    except KVMapError:
        return None


@st.composite
def byte_edits(draw, data: bytes) -> bytes:
    """``data`` with bytes overwritten, flipped, cut off or appended."""
    action = draw(st.sampled_from(["overwrite", "flip", "truncate", "append"]))
    if action == "truncate":
        return data[: draw(st.integers(0, len(data) - 1))]
    if action == "append":
        return data + draw(st.binary(min_size=1, max_size=16))
    at = draw(st.integers(0, len(data) - 1))
    if action == "flip":
        return data[:at] + bytes([data[at] ^ (1 << draw(st.integers(0, 7)))]) + data[at + 1 :]
    new = draw(st.binary(min_size=1, max_size=8))
    return data[:at] + new + data[at + len(new) :]


@st.composite
def forged_records(draw) -> bytes:
    """A record whose fields are edited, added or removed and whose checksum is then made to
    match (a writer of another version, or a hostile one): only the fields' own checks
    remain."""
    fields = json.loads(bytes(RECORD.to_tensor().numpy()).decode())
    del fields["checksum"]
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from([*fields, "page.dtype", "page.page_size", "page.layout", "x"]))
        value = draw(
            JSON_VALUES | st.sampled_from([*DTYPES, "int8", 0, -1, 10**15, 2**63, True, ""])
        )
        if key.startswith("page."):
            if isinstance(fields.get("page"), dict):
                fields["page"][key[5:]] = value
        elif draw(st.booleans()) and key in fields:
            del fields[key]
        else:
            fields[key] = value
    checksum = zlib.crc32(json.dumps(fields, sort_keys=True).encode())
    return json.dumps({**fields, "checksum": checksum}, sort_keys=True).encode().ljust(RECORD_BYTES)


@FUZZ
@given(data=st.binary(min_size=RECORD_BYTES, max_size=RECORD_BYTES) | st.binary(max_size=64))
def test_random_bytes_are_refused_as_a_page_record(data):
    assert parsed_or_refused(data) is None


@FUZZ
@given(data=st.data())
def test_a_damaged_record_reads_as_itself_or_is_refused(data):
    damaged = data.draw(byte_edits(bytes(RECORD.to_tensor().numpy())))
    assert parsed_or_refused(damaged) in (RECORD, None)


@FUZZ
@given(data=forged_records())
def test_a_forged_record_is_a_valid_record_or_refused(data):
    """Whatever a record with a matching checksum claims, it parses only into a record whose
    own checks hold, and that record writes back as itself."""
    record = parsed_or_refused(data)
    if record is not None:
        assert record.index >= 0 and 0 <= record.tp_rank < record.tp_size
        assert record.page.dtype in DTYPES.values() and record.page.numel > 0
        assert PageRecord.from_tensor(record.to_tensor()) == record


def test_the_fuzzed_record_is_a_valid_one():
    assert parsed_or_refused(bytes(RECORD.to_tensor().numpy())) == RECORD
    assert dataclasses.replace(RECORD, index=0, parent="").first_token == 0


# -- the extra config SGLang passes to KVMapStorage ------------------------------------------

SETTING_KEYS = [
    "inner_backend",
    "translate",
    "sinks",
    "tail_pages",
    "concurrent_translations",
    "interface_v1",
    "model_path",
    "stats_path",
    "audit_translations",
    "quality_floor",
    "peers",
    "hicache_storage_pass_prefix_keys",
    "file_storage_path",
]
PEER_KEYS = ["model_name", "pack", "model_path", "tp_size", "dtype"]


# paths the process cannot make a folder at: a NUL, under a file, the file itself
UNUSABLE_PATHS = st.sampled_from(["a\x00b", "a-file/stats", "a-file", ""])


@st.composite
def extra_configs(draw, folder: str) -> dict:
    """An extra config as SGLang would pass it (its backend keys, files under ``folder``) with
    up to four keys set to anything JSON holds, peers included (relative paths land in the
    current folder, which holds a file ``a-file``)."""
    extra = {
        "backend_name": "kvmap",
        "module_path": "sgl_kvmap.sglang.storage",
        "class_name": "KVMapStorage",
        "interface_v1": 1,
        "file_storage_path": folder,
    }
    peer = st.dictionaries(st.sampled_from(PEER_KEYS) | TEXT, JSON_VALUES, max_size=4)
    for _ in range(draw(st.integers(0, 4))):
        key = draw(st.sampled_from(SETTING_KEYS + SETTING_KEYS + SETTING_KEYS) | TEXT)
        if key == "peers":
            value = draw(st.lists(peer, max_size=2))
        elif key.endswith("_path"):
            value = draw(UNUSABLE_PATHS | JSON_VALUES)
        else:
            value = draw(EXTREMES | JSON_VALUES)
        extra[key] = value
    return extra


def storage_config(extra: dict):
    return hicache_storage_config("fuzzed-model", extra)


@pytest.fixture
def in_tmp_path(tmp_path):
    """The test runs in ``tmp_path`` (fuzzed relative paths land there), beside a file
    ``a-file``."""
    (tmp_path / "a-file").write_text("not a folder")
    before = os.getcwd()
    os.chdir(tmp_path)
    yield tmp_path
    os.chdir(before)


@pytest.fixture(scope="module")
def factory():
    """SGLang's storage backend factory (SGLang imported once, before the fuzz's clock)."""
    pytest.importorskip("sglang")
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    import sgl_kvmap.sglang.storage  # noqa: F401

    return StorageBackendFactory


@FUZZ
@given(data=st.data())
def test_an_extra_config_builds_kvmap_storage_or_is_refused_in_one_line(factory, in_tmp_path, data):
    """Through SGLang's own factory, as a server builds its storage backend: the backend, or
    one KVMapError whose message is one line."""
    from sgl_kvmap.sglang.settings import StorageSettings
    from sgl_kvmap.sglang.storage import KVMapStorage

    extra = data.draw(extra_configs(str(in_tmp_path / "store")))
    try:
        storage = factory.create_backend("dynamic", storage_config(extra), None)
    except KVMapError as error:
        assert "\n" not in str(error)
        return
    assert isinstance(storage, KVMapStorage)
    assert storage.settings == StorageSettings.from_extra_config(extra)


# -- sglang-args ----------------------------------------------------------------------------

OPTIONS = [
    "--engine",
    "--pack",
    "--store",
    "--store-path",
    "--page-size",
    "--port",
    "--tp",
    "--prefetch-policy",
    "--device",
    "--max-total-tokens",
    "--tail-pages",
    "--concurrent-translations",
    "--audit-translations",
    "--quality-floor",
    "--no-such-option",
]


@pytest.fixture(scope="module")
def deployment_args(served_pair) -> list[str]:
    """Values the fuzz mixes in: the pair's model folders (with served names), its packs."""
    a, b = served_pair["names"]
    packs = list(served_pair["packs"].values())
    return [a, b, f"{a}=small", f"{b}=large", f"{a}=", f"{b}=x=y", *packs]


@st.composite
def argument_lists(draw, values: list[str]) -> list[str]:
    """Options with values that fit them (model folders, packs, small numbers, choices), values
    that do not (any text, huge numbers), stray words; often after two well-formed engines,
    so the checks past parsing run too."""
    models, packs = values[:6], values[6:]
    numbers = st.integers(-3, 70000).map(str) | st.integers(-(2**70), 2**70).map(str)
    numbers |= st.sampled_from(["nan", "1e9", "0x10", "-0", "0.5"])
    fitting = {
        "--engine": st.sampled_from(models),
        "--pack": st.sampled_from(packs),
        "--store": st.sampled_from(["file", "mooncake"]),
        "--store-path": st.sampled_from(["store", "a-file", "a-file/store"]),
        "--prefetch-policy": st.sampled_from(["timeout", "best_effort", "wait_complete"]),
        "--device": st.sampled_from(["cpu", "cuda", "tpu"]),
        "--quality-floor": st.sampled_from(["0", "-1", "1.5", "nan", "none"]),
    }
    args = ["--engine", models[0], "--engine", models[1]] if draw(st.booleans()) else []
    for _ in range(draw(st.integers(0, 6))):
        option = draw(st.sampled_from(OPTIONS))
        args.append(option)
        if option != "--audit-translations":
            fits = fitting.get(option, st.integers(0, 8).map(str))
            args.append(draw(numbers | TEXT if draw(st.integers(0, 4)) == 0 else fits))
        if draw(st.integers(0, 9)) == 0:
            args.append(draw(TEXT))  # a stray word
    return [arg for arg in args if "\x00" not in arg]  # no OS passes a NUL in an argument


@pytest.fixture
def offline_and_untimed(monkeypatch):
    """No Hub (a model or pack argument that is not a folder is not one: the Hub's own
    failures are fuzzed in tests/test_hub_*.py) and a translation timing that takes no time
    (the deadline's arithmetic runs on it as on a measured one)."""
    from sgl_kvmap.core import sources
    from sgl_kvmap.registry import packs
    from sgl_kvmap.sglang import translation

    def no_hub(repo_id, *args, **kwargs):
        raise KVMapError(f"{repo_id} is not in the local cache (offline)")

    monkeypatch.setattr(sources, "_source", sources.local_folders)
    monkeypatch.setattr(packs, "fetch_pack", no_hub)
    monkeypatch.setattr(
        translation, "hand_over_seconds", lambda mapper, n, page, **kw: 0.01 + n * 1e-5
    )


@settings(FUZZ, max_examples=120)
@given(data=st.data())
def test_sglang_args_exit_0_or_refuse_in_one_line_whatever_the_arguments(
    deployment_args, offline_and_untimed, in_tmp_path, data
):
    from sgl_kvmap.cli import main

    args = data.draw(argument_lists(deployment_args))
    result = CliRunner().invoke(main, ["sglang-args", *args], color=True)
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        args,
        result.exception,
    )
    assert result.exit_code in (0, 1, 2), (args, result.output)
    event(f"exit {result.exit_code}")
    if result.exit_code == 1:
        assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, args
    elif result.exit_code == 2:
        assert "Error: " in result.stderr and "Traceback" not in result.stderr, args
    else:
        assert result.stdout.startswith("#") and "python -m sglang.launch_server" in result.stdout
    assert not set(result.stderr) & set("\x1b\r\x0b\x0c"), args  # typed control characters


def test_the_fuzzed_arguments_reach_a_launch_line(deployment_args, offline_and_untimed):
    """The well-formed start the fuzz builds on succeeds, so the fuzz also runs past parsing."""
    from sgl_kvmap.cli import main

    a, b = deployment_args[:2]
    result = CliRunner().invoke(
        main, ["sglang-args", "--engine", a, "--engine", b, "--pack", deployment_args[-1]]
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.count("python -m sglang.launch_server") == 2
    assert Path(a).is_dir()
