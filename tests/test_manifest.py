"""kvmap.json: one schema for types and ranges, a digest over what decides the mapping, and a
property: whatever is done to a pack's files, loading gives the same mapper or a PackError."""

import copy
import json
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sgl_kvmap.core import pack
from sgl_kvmap.core.errors import PackError
from sgl_kvmap.core.manifest import manifest_digest, parse_manifest
from sgl_kvmap.core.mapper import KVMapper

from .test_pack import edit_json


@pytest.fixture(scope="module")
def pack_files(tiny_mapper, tmp_path_factory) -> dict[str, bytes]:
    folder = tiny_mapper.save_pretrained(tmp_path_factory.mktemp("manifest") / "pack")
    return {name: (folder / name).read_bytes() for name in pack.PACK_FILES}


@pytest.fixture(scope="module")
def manifest(pack_files) -> dict:
    return json.loads(pack_files[pack.CONFIG_FILE])


def parse(value) -> dict:
    text = value if isinstance(value, str) else json.dumps(value)
    return parse_manifest(text.encode(), "kvmap.json")


@pytest.mark.parametrize(
    "text, message",
    [
        ("[1, 2]", "not an sgl-kvmap pack"),
        ('"sgl-kvmap"', "not an sgl-kvmap pack"),
        ("3", "not an sgl-kvmap pack"),
        ("null", "not an sgl-kvmap pack"),
        ("[" * 100_000 + "]" * 100_000, "not valid JSON"),
        (b"\xff\xfe{}", "not valid JSON"),
    ],
)
def test_manifests_that_are_not_objects_are_refused(text, message):
    data = text if isinstance(text, bytes) else text.encode()
    with pytest.raises(PackError, match=message):
        parse_manifest(data, "kvmap.json")


def set_field(path: str, value):
    """An edit of the manifest at a dotted ``path`` (``source.head_dim``, ``selection.0.1``)."""

    def edit(data):
        *parents, last = path.split(".")
        for key in parents:
            data = data[int(key)] if isinstance(data, list) else data[key]
        if isinstance(data, list):
            data[int(last)] = value
        elif value is DELETE:
            del data[last]
        else:
            data[last] = value

    return edit


DELETE = object()


@pytest.mark.parametrize(
    "path, value, message",
    [
        ("tensors_sha256", DELETE, "'tensors_sha256' is a required property"),
        ("tensors_sha256", "abc", "does not match"),
        ("source", [], "source: .* is not of type 'object'"),
        ("target", "qwen", "target: .* is not of type 'object'"),
        ("source.head_dim", 16.0, "source.head_dim: 16.0 is not of type 'integer'"),
        ("source.rope_style", "spiral", "source.rope_style"),
        ("source.extra", 1, "source: Additional properties"),
        ("metrics", "great", "metrics: 'great' is not of type 'object'"),
        ("metrics", [0.9], "metrics: .* is not of type 'object'"),
        ("calibration", 7, "calibration: 7 is not of type 'object'"),
        ("format_version", 1.0, "pack format version 1.0"),
        ("format_version", True, "pack format version True"),
        ("sink_tokens", "3", "sink_tokens: '3' is not of type 'integer'"),
        ("sink_tokens", 2.9, "sink_tokens: 2.9 is not of type 'integer'"),
        ("sink_tokens", True, "sink_tokens: True is not of type 'integer'"),
        ("sink_tokens", -7, "sink_tokens: -7 is less than the minimum of 0"),
        ("sink_tokens", 1e30, "sink_tokens: 1e\\+30 is "),
        ("ridge", -1.0, "ridge: -1.0 is less than the minimum of 0"),
        ("ridge", "1e-3", "ridge: '1e-3' is not of type 'number'"),
        ("ridge", DELETE, "'ridge' is a required property"),
        ("rank", 0, "rank: 0 is not valid"),
        ("selection", [], "selection: \\[\\] should be non-empty"),
        ("selection.0", [0.0], "selection.0.0: 0.0 is not of type 'integer'"),
        ("selection.0", ["0"], "selection.0.0: '0' is not of type 'integer'"),
        ("selection.0", [1, 1], "selection.0: .* has non-unique elements"),
        ("selection.0", [-1], "selection.0.0: -1 is less than the minimum of 0"),
        ("surprise", {}, "Additional properties are not allowed \\('surprise'"),
    ],
)
def test_every_field_is_checked_for_type_and_range(manifest, path, value, message):
    edited = copy.deepcopy(manifest)
    set_field(path, value)(edited)
    with pytest.raises(PackError, match=message):
        parse(edited)


@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_ridge_must_be_a_finite_number(manifest, text):
    raw = json.dumps({**manifest, "ridge": "RIDGE"}).replace('"RIDGE"', text)
    with pytest.raises(PackError, match="not valid JSON"):
        parse(raw)


def test_a_saved_manifest_passes_its_schema(manifest):
    assert parse(manifest) == manifest


def test_the_digest_covers_the_mapping_not_the_notes(manifest):
    same = copy.deepcopy(manifest)
    same["metrics"]["note"] = 1.0
    same["calibration"] = {"text": "elsewhere"}
    same["library_version"] = "9.9"
    assert manifest_digest(same) == manifest_digest(manifest)
    for path, value in [
        ("ridge", manifest["ridge"] * 2),
        ("sink_tokens", manifest["sink_tokens"] + 1),
        ("selection.0", [0]),
        ("source.model_id", "other"),
    ]:
        changed = copy.deepcopy(manifest)
        set_field(path, value)(changed)
        assert manifest_digest(changed) != manifest_digest(manifest), path


@pytest.mark.parametrize(
    "path, value",
    [("selection.0", [0]), ("selection.1", [0, 2]), ("ridge", 10.0), ("sink_tokens", 3)],
)
def test_a_changed_but_valid_manifest_is_refused_like_an_edited_tensor(
    pack_files, tmp_path, path, value
):
    """A valid but different selection would reinterpret the weights: the digest refuses it."""
    folder = write_pack(tmp_path / "pack", pack_files)
    KVMapper.from_pretrained(folder)
    edit_json(folder, set_field(path, value))
    with pytest.raises(PackError, match="digest"):
        KVMapper.from_pretrained(folder)


def test_notes_may_be_edited_without_resaving(pack_files, tmp_path):
    folder = write_pack(tmp_path / "pack", pack_files)
    edit_json(folder, lambda d: d["metrics"].update(eval_retention=0.75))
    assert KVMapper.from_pretrained(folder).info["metrics"]["eval_retention"] == 0.75


def test_inspect_reports_a_manifest_with_broken_metrics_in_one_line(pack_files, tmp_path):
    from click.testing import CliRunner

    from sgl_kvmap.cli import main

    folder = write_pack(tmp_path / "pack", pack_files)
    edit_json(folder, lambda d: d.update(metrics=[1, 2]))
    result = CliRunner().invoke(main, ["inspect", str(folder)])
    assert result.exit_code == 1
    assert "metrics" in result.output and "Traceback" not in result.output


# -- the property --------------------------------------------------------------------------

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=6,
)


def json_paths(value, prefix=()):
    """Every path into a JSON value (tuples of keys and indices), the root included."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from json_paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from json_paths(item, (*prefix, index))


@st.composite
def manifest_edits(draw, manifest):
    """kvmap.json with one value replaced, removed or added somewhere in its tree."""
    edited = copy.deepcopy(manifest)
    path = draw(st.sampled_from(list(json_paths(manifest))[1:]))
    *parents, last = path
    node = edited
    for key in parents:
        node = node[key]
    action = draw(st.sampled_from(["replace", "remove", "add"]))
    if action == "remove":
        del node[last]
    elif action == "add" and isinstance(node[last], dict):
        node[last][draw(st.text(max_size=6))] = draw(JSON_VALUES)
    elif action == "add" and isinstance(node[last], list):
        node[last].append(draw(JSON_VALUES))
    else:
        node[last] = draw(JSON_VALUES)
    return json.dumps(edited).encode()


@st.composite
def byte_edits(draw, data: bytes):
    """``data`` with bytes overwritten, cut off or appended."""
    action = draw(st.sampled_from(["overwrite", "truncate", "append"]))
    if action == "truncate":
        return data[: draw(st.integers(0, len(data) - 1))]
    if action == "append":
        return data + draw(st.binary(min_size=1, max_size=16))
    at = draw(st.integers(0, len(data) - 1))
    new = draw(st.binary(min_size=1, max_size=8))
    return data[:at] + new + data[at + len(new) :]


def write_pack(folder: Path, files: dict[str, bytes]) -> Path:
    folder.mkdir()
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


def same_mapping(a: KVMapper, b: KVMapper) -> bool:
    fields = ("source", "target", "selection", "ridge", "sink_tokens", "rank", "residual_hidden")
    if any(getattr(a, f) != getattr(b, f) for f in fields):
        return False
    return all(
        torch.equal(x.weight, y.weight) and torch.equal(x.bias, y.bias)
        for kind in ("k", "v")
        for x, y in zip(a.maps[kind], b.maps[kind], strict=True)
    )


@st.composite
def damaged_packs(draw, files):
    name = draw(st.sampled_from([pack.CONFIG_FILE, pack.TENSORS_FILE]))
    data = files[name]
    if name == pack.CONFIG_FILE and draw(st.booleans()):
        edited = draw(manifest_edits(json.loads(data)))
    else:
        edited = draw(byte_edits(data))
    return {**files, name: edited}


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_loading_a_damaged_pack_gives_the_same_mapper_or_a_pack_error(
    pack_files, tiny_mapper, data
):
    files = data.draw(damaged_packs(pack_files))
    with tempfile.TemporaryDirectory() as root:
        folder = write_pack(Path(root) / "pack", files)
        try:
            loaded = KVMapper.from_pretrained(folder)
        except PackError:
            return
    assert same_mapping(loaded, tiny_mapper)
