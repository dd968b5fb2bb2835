"""Pack folders: round trips, format versions, damage refused, loads independent of the file."""

import hashlib
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save

from sgl_kvmap.core import pack
from sgl_kvmap.core.errors import PackError
from sgl_kvmap.core.mapper import KVMapper, content_features
from sgl_kvmap.fitting.calibrate import PairStatistics, fit_from_statistics
from sgl_kvmap.fitting.config import CalibrationConfig
from sgl_kvmap.models.capture import capture_kv

from .conftest import random_cache, with_random_residual


@pytest.fixture(scope="module")
def stats(tiny_pair) -> PairStatistics:
    source, target = tiny_pair
    stats = PairStatistics(source.spec, target.spec)
    for i in range(4):
        ids = torch.randint(0, 100, (64,))
        x = content_features(capture_kv(source.model, ids), source.spec, slice(1, None))
        y = content_features(capture_kv(target.model, ids), target.spec, slice(1, None))
        stats.update(x, y, held_out=i == 3)
    return stats


@pytest.fixture(scope="module")
def mapper(stats) -> KVMapper:
    fitted, _ = fit_from_statistics(
        stats, CalibrationConfig(top_k=2), recipe={"text": "random ids", "tokens": 256}
    )
    fitted.info["metrics"]["eval_retention"] = 0.5
    return fitted


@pytest.fixture(scope="module")
def reduced(stats) -> KVMapper:
    """A reduced-rank mapper of the same pair (rank 5)."""
    return fit_from_statistics(stats, CalibrationConfig(rank=5))[0]


@pytest.fixture
def saved(mapper, tmp_path):
    return mapper.save_pretrained(tmp_path / "pack")


def test_round_trip_keeps_everything(mapper, saved, tiny_pair):
    loaded = KVMapper.from_pretrained(saved)
    assert loaded.selection == mapper.selection and loaded.ridge == mapper.ridge
    assert loaded.source == mapper.source and loaded.target.fingerprint == mapper.target.fingerprint
    assert loaded.info["metrics"]["eval_retention"] == 0.5
    cache = capture_kv(tiny_pair[0].model, torch.randint(0, 100, (20,)))
    for a, b in zip(loaded.map(cache).keys, mapper.map(cache).keys):
        assert torch.equal(a, b)
    assert sorted(p.name for p in saved.iterdir()) == [
        "README.md",
        "kvmap.json",
        "mapper.safetensors",
    ]
    card = (saved / "README.md").read_text()
    assert "tiny-qwen2-1" in card and "eval_retention | 0.5" in card


def test_reduced_rank_round_trip_keeps_the_projections(reduced, tiny_pair, tmp_path):
    folder = reduced.save_pretrained(tmp_path / "reduced")
    config = json.loads((folder / "kvmap.json").read_text())
    assert (config["format_version"], config["rank"]) == (2, 5)
    loaded = KVMapper.from_pretrained(folder)
    assert loaded.rank == 5 and torch.equal(loaded.projections["v"], reduced.projections["v"])
    cache = capture_kv(tiny_pair[0].model, torch.randint(0, 100, (20,)))
    for a, b in zip(loaded.map(cache).values, reduced.map(cache).values):
        assert torch.equal(a, b)
    assert "shared projection of rank 5" in (folder / "README.md").read_text()
    # projections present, rank dropped
    edit_json(folder, lambda d: d.update(rank=None), resign=True)
    with pytest.raises(PackError, match="inconsistent pack"):
        KVMapper.from_pretrained(folder)


def test_packs_without_projections_stay_version_1(saved):
    assert json.loads((saved / "kvmap.json").read_text())["format_version"] == 1


def test_json_is_sorted_and_indented(saved):
    text = (saved / "kvmap.json").read_text()
    data = json.loads(text)
    assert text == json.dumps(data, indent=2, sort_keys=True) + "\n"


def edit_json(folder, fn, resign: bool = False):
    """Apply ``fn`` to ``folder``'s kvmap.json. ``resign``: also record the edited manifest's
    digest and checksum in the tensors file, as a deliberate forger would, so that the checks
    behind the digest are reached."""
    path = folder / "kvmap.json"
    data = json.loads(path.read_text())
    fn(data)
    if resign:
        tensors = load_file(folder / "mapper.safetensors")
        blob = save(tensors, metadata=pack._metadata(data))
        (folder / "mapper.safetensors").write_bytes(blob)
        data["tensors_sha256"] = hashlib.sha256(blob).hexdigest()
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda f: (f / "mapper.safetensors").unlink(), "mapper.safetensors is missing"),
        (lambda f: (f / "kvmap.json").unlink(), "kvmap.json is missing"),
        (lambda f: (f / "kvmap.json").write_text("{not json"), "not valid JSON"),
        (
            lambda f: (f / "mapper.safetensors").write_bytes(
                (f / "mapper.safetensors").read_bytes()[:-8]
            ),
            "checksum",
        ),
        (lambda f: edit_json(f, lambda d: d.update(format_version=99)), "format version 99"),
        (lambda f: edit_json(f, lambda d: d.update(format="other")), "not an sgl-kvmap pack"),
        (lambda f: edit_json(f, lambda d: d["target"].update(head_dim=64)), "digest"),
        (lambda f: edit_json(f, lambda d: d["target"].update(head_dim=64), True), "fingerprint"),
        (lambda f: edit_json(f, lambda d: d["selection"].pop()), "digest"),
        (lambda f: edit_json(f, lambda d: d["selection"].pop(), True), "inconsistent pack"),
        (lambda f: edit_json(f, lambda d: d["selection"][0].reverse()), "digest"),
        (lambda f: edit_json(f, lambda d: d["selection"][0].reverse(), True), "ascending"),
        (lambda f: edit_json(f, lambda d: d.update(sink_tokens=2)), "digest"),
        (lambda f: edit_json(f, lambda d: d.pop("ridge")), "ridge"),
    ],
)
def test_damaged_packs_are_refused_with_a_clear_message(saved, damage, message):
    damage(saved)
    with pytest.raises(PackError, match=message):
        KVMapper.from_pretrained(saved)


def test_a_failed_save_leaves_the_old_pack_and_no_debris(mapper, saved, monkeypatch):
    before = (saved / "mapper.safetensors").read_bytes()

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(pack.registry(), "render_card", broken)
    with pytest.raises(OSError, match="disk full"):
        mapper.save_pretrained(saved, overwrite=True)
    assert (saved / "mapper.safetensors").read_bytes() == before
    assert sorted(p.name for p in saved.parent.iterdir()) == [".pack.lock", "pack"]


@pytest.mark.parametrize("change", ["truncated in place", "overwritten", "deleted"])
def test_a_loaded_pack_no_longer_depends_on_its_file(mapper, saved, change):
    """What was verified is what runs: after loading, the tensors file is truncated in place
    (as ``cp`` over it does), overwritten with other bytes or deleted; the loaded mapper still
    maps exactly as before. Run in a child process, because a memory-mapped load dies there
    with SIGBUS instead of failing an assertion."""
    import subprocess
    import sys

    script = f"""
import os, torch
from sgl_kvmap.core.cache import KVCache
from sgl_kvmap.core.mapper import KVMapper
m = KVMapper.from_pretrained({str(saved)!r})
g, s = torch.Generator().manual_seed(0), m.source
layers = [torch.randn(9, s.num_kv_heads, s.head_dim, generator=g) for _ in range(2 * s.num_layers)]
cache = KVCache(layers[: s.num_layers], layers[s.num_layers :], torch.arange(9))
before = m.map(cache)
path = {str(saved / pack.TENSORS_FILE)!r}
change = {change!r}
if change == "truncated in place":
    os.truncate(path, 8)
elif change == "overwritten":
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.write(bytes(size))
else:
    os.remove(path)
after = m.map(cache)
pairs = zip(after.keys + after.values, before.keys + before.values)
assert all(torch.equal(a, b) for a, b in pairs)
print("unchanged")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "unchanged"


def test_pack_round_trip_keeps_the_residual(tiny_pair, reduced_mapper, tmp_path):
    cache = random_cache(tiny_pair[0])
    mapper = with_random_residual(reduced_mapper, cache)
    folder = mapper.save_pretrained(tmp_path / "residual")
    config = json.loads((folder / "kvmap.json").read_text())
    assert (config["format_version"], config["rank"], config["residual_hidden"]) == (3, 16, 8)
    assert "non-linear residual of width 8" in (folder / "README.md").read_text()
    loaded = KVMapper.from_pretrained(folder)
    assert loaded.residual_hidden == 8
    want, got = mapper.map(cache), loaded.map(cache)
    for a, b in zip(want.keys + want.values, got.keys + got.values):
        assert torch.equal(a, b)
    # a pack that drops the residual from its description must not load as the plain map
    edit_json(folder, lambda d: d.update(residual_hidden=None), resign=True)
    with pytest.raises(PackError, match="does not describe"):
        KVMapper.from_pretrained(folder)


def test_plain_reduced_rank_packs_stay_version_2(reduced_mapper, tmp_path):
    config = json.loads(
        (reduced_mapper.save_pretrained(tmp_path / "plain") / "kvmap.json").read_text()
    )
    assert (config["format_version"], config["residual_hidden"]) == (2, None)


def _destinations(root, mapper):
    """Every kind of destination a save can meet, by name."""
    (root / "empty").mkdir()
    (root / "file").write_text("not a pack")
    (root / "folder").mkdir()
    (root / "folder" / "notes.txt").write_text("mine")
    mapper.save_pretrained(root / "pack")
    mapper.save_pretrained(root / "pack_and_more")
    (root / "pack_and_more" / "notes.txt").write_text("mine")
    return ["new", "empty", "file", "folder", "pack", "pack_and_more"]


@pytest.mark.parametrize("overwrite", [False, True])
def test_check_destination_refuses_what_saving_refuses(mapper, tmp_path, overwrite):
    """The early check (`sgl-kvmap fit` runs it before fitting) and the save agree on every
    destination: a new or empty folder, a pack only with overwrite, nothing else."""
    writable = {"new", "empty"} | ({"pack"} if overwrite else set())
    for name in _destinations(tmp_path, mapper):
        folder = tmp_path / name
        if name in writable:
            pack.check_destination(folder, overwrite)
            mapper.save_pretrained(folder, overwrite=overwrite)
            continue
        with pytest.raises(PackError) as early:
            pack.check_destination(folder, overwrite)
        with pytest.raises(PackError) as late:
            mapper.save_pretrained(folder, overwrite=overwrite)
        assert str(early.value) == str(late.value)  # one rule, one message
        assert ("--overwrite" in str(early.value)) == (name == "pack")


def forge_weight(folder, name: str, value: float) -> None:
    """Set one entry of tensor ``name`` to ``value`` and re-sign the pack (checksum and
    metadata), as a hostile publisher would: only the value checks can catch it."""
    path = folder / "kvmap.json"
    data = json.loads(path.read_text())
    tensors = load_file(folder / "mapper.safetensors")
    tensors[name].view(-1)[0] = value
    blob = save(tensors, metadata=pack._metadata(data))
    (folder / "mapper.safetensors").write_bytes(blob)
    data["tensors_sha256"] = hashlib.sha256(blob).hexdigest()
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("value", [1e5, -3e38])
def test_a_pack_with_huge_but_finite_weights_is_refused(saved, value):
    """Before: weights of 1e5 (or 3e38) passed every check, and the engine's translation wrote
    NaN/inf KV into its pool."""
    forge_weight(saved, "k.0.weight", value)
    with pytest.raises(PackError, match="beyond the 65504"):
        KVMapper.from_pretrained(saved)


def _fifo(path):
    path.unlink()
    os.mkfifo(path)


def _dev_zero(path):
    path.unlink()
    path.symlink_to("/dev/zero")


def _huge(path):
    data = json.loads(path.read_text())
    data["notes"] = "x" * (5 << 20)
    path.write_text(json.dumps(data))


def _folder(path):
    path.unlink()
    path.mkdir()


@pytest.mark.parametrize(
    "damage, message",
    [
        (_fifo, "kvmap.json is a FIFO or device"),
        (_dev_zero, "kvmap.json is a FIFO or device"),
        (_huge, "kvmap.json is larger than 4,194,304 bytes"),
        (_folder, "kvmap.json is a folder"),
    ],
)
def test_a_manifest_that_is_not_a_small_regular_file_is_refused_at_once(saved, damage, message):
    """Before: a FIFO blocked the reader, a link to /dev/zero read without end, a 200 MB
    manifest was read and parsed, a folder gave "[Errno 21]". The load runs on a thread here so
    that a reader that blocks fails the test instead of hanging it."""
    import threading

    damage(saved / "kvmap.json")
    outcome = []

    def load():
        try:
            KVMapper.from_pretrained(saved)
        except Exception as error:  # noqa: BLE001 - the test inspects it
            outcome.append(error)

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(timeout=30)
    if reader.is_alive():  # unblock a FIFO reader before failing
        with (
            open(saved / "kvmap.json", "wb", buffering=0)
            if damage is _fifo
            else open(os.devnull) as _
        ):
            pass
        pytest.fail("loading the pack blocked")
    assert len(outcome) == 1 and isinstance(outcome[0], PackError), outcome
    assert message in str(outcome[0])
