"""Saving a pack never destroys data: faults at every step, real kills, real concurrent writers
and readers, ordinary permissions.

Faults are injected in child processes by replacing one step of ``sgl_kvmap.core.files`` (or
the card renderer: the card is the last file written) with ``os._exit``, which ends the
process at once as a kill would: no ``finally`` runs, nothing is cleaned. Everything else is
the real code on the real file system."""

import dataclasses
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sgl_kvmap.core import files
from sgl_kvmap.core.errors import PackError
from sgl_kvmap.core.mapper import KVMapper


@pytest.fixture
def versions(tiny_mapper, tmp_path) -> dict[str, Path]:
    """Two different packs of one pair ("A", "B": different ridge and metrics), saved apart."""
    b = dataclasses.replace(
        tiny_mapper, ridge=tiny_mapper.ridge * 2, info={"metrics": {"version": "B"}}
    )
    a = dataclasses.replace(tiny_mapper, info={"metrics": {"version": "A"}})
    return {name: m.save_pretrained(tmp_path / "src" / name) for name, m in [("A", a), ("B", b)]}


def version_of(folder: Path) -> str:
    """Which of the two packs ``folder`` (``ROOT/out/NAME``) holds, whole ("A" or "B");
    PackError otherwise."""
    mapper = KVMapper.from_pretrained(folder)
    name = mapper.info["metrics"]["version"]
    assert KVMapper.from_pretrained(folder.parents[1] / "src" / name).ridge == mapper.ridge
    return name


def beside(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.parent.iterdir())


def python(script: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, **kwargs)


SAVE_WITH_FAULT = """
import os, sys
from sgl_kvmap.core import files, pack
from sgl_kvmap.core.mapper import KVMapper

def die(*args, **kwargs):
    os._exit(9)

step, new, dest = sys.argv[1:]
if step == "while writing":
    pack.registry().render_card = die
elif step == "before sync":
    files._sync_folder = die
elif step == "before swap":
    files._swap_into_place = die
elif step == "after swap":
    swap = files._swap_into_place
    files._swap_into_place = lambda *a: (swap(*a), die())
KVMapper.from_pretrained(new).save_pretrained(dest, overwrite=True)
"""


@pytest.mark.parametrize(
    "step, holds",
    [("while writing", "A"), ("before sync", "A"), ("before swap", "A"), ("after swap", "B")],
)
def test_a_save_killed_at_any_step_leaves_one_whole_pack_and_the_next_save_cleans_up(
    versions, tmp_path, step, holds
):
    dest = KVMapper.from_pretrained(versions["A"]).save_pretrained(tmp_path / "out" / "pack")
    killed = subprocess.run(
        [sys.executable, "-c", SAVE_WITH_FAULT, step, str(versions["B"]), str(dest)],
        capture_output=True,
        text=True,
    )
    assert killed.returncode == 9, killed.stderr[-2000:]
    assert version_of(dest) == holds
    assert any(".pack.kvmap-" in name for name in beside(dest))  # the killed writer's debris
    KVMapper.from_pretrained(versions["A"]).save_pretrained(dest, overwrite=True)
    assert version_of(dest) == "A"
    assert beside(dest) == [".pack.lock", "pack"]


def test_a_failing_swap_keeps_the_old_pack(versions, tmp_path, monkeypatch):
    dest = KVMapper.from_pretrained(versions["A"]).save_pretrained(tmp_path / "out" / "pack")

    def refuse(a, b):
        raise OSError(5, "input/output error")

    monkeypatch.setattr(files, "_exchange", refuse)
    with pytest.raises(OSError, match="input/output error"):
        KVMapper.from_pretrained(versions["B"]).save_pretrained(dest, overwrite=True)
    assert version_of(dest) == "A" and beside(dest) == [".pack.lock", "pack"]


def test_without_an_atomic_exchange_a_failed_move_is_rolled_back(versions, tmp_path, monkeypatch):
    """The fallback for file systems without ``RENAME_EXCHANGE``: old aside, new in, old out.
    Here the second rename (new into place) fails; the old pack must be put back."""
    dest = KVMapper.from_pretrained(versions["A"]).save_pretrained(tmp_path / "out" / "pack")
    monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    KVMapper.from_pretrained(versions["B"]).save_pretrained(dest, overwrite=True)
    assert version_of(dest) == "B" and beside(dest) == [".pack.lock", "pack"]

    renames, real_rename = [], os.rename

    def rename(src, dst):
        renames.append(src)
        if len(renames) == 2:
            raise OSError(28, "no space left on device")
        real_rename(src, dst)

    monkeypatch.setattr(files.os, "rename", rename)
    with pytest.raises(OSError, match="no space left"):
        KVMapper.from_pretrained(versions["A"]).save_pretrained(dest, overwrite=True)
    monkeypatch.undo()
    assert version_of(dest) == "B" and beside(dest) == [".pack.lock", "pack"]


KEEP_SAVING = """
import sys, itertools
from sgl_kvmap.core.mapper import KVMapper
a, b, dest = sys.argv[1:]
mappers = [KVMapper.from_pretrained(a), KVMapper.from_pretrained(b)]
print("ready", flush=True)
for mapper in itertools.cycle(mappers):
    mapper.save_pretrained(dest, overwrite=True)
"""


def test_saves_killed_at_random_moments_never_leave_a_broken_pack(versions, tmp_path):
    dest = KVMapper.from_pretrained(versions["A"]).save_pretrained(tmp_path / "out" / "pack")
    rng = random.Random(0)
    for _ in range(6):
        writer = subprocess.Popen(
            [sys.executable, "-c", KEEP_SAVING, str(versions["A"]), str(versions["B"]), str(dest)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert writer.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.3))
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        assert version_of(dest) in ("A", "B")
    KVMapper.from_pretrained(versions["B"]).save_pretrained(dest, overwrite=True)
    assert version_of(dest) == "B" and beside(dest) == [".pack.lock", "pack"]


WRITER = """
import sys, time, itertools
from pathlib import Path
from sgl_kvmap.core.mapper import KVMapper
a, b, dest, go, seconds = sys.argv[1:]
mappers = [KVMapper.from_pretrained(a), KVMapper.from_pretrained(b)]
print("ready", flush=True)
while not Path(go).exists():
    time.sleep(0.01)
end, saves = time.monotonic() + float(seconds), 0
for mapper in itertools.cycle(mappers):
    if time.monotonic() > end:
        break
    mapper.save_pretrained(dest, overwrite=True)
    saves += 1
print(saves)
"""

READER = """
import sys, time, collections
from pathlib import Path
from sgl_kvmap.core.mapper import KVMapper
from sgl_kvmap.core.errors import PackError
a, b, dest, go, seconds = sys.argv[1:]
ridge = {m.info["metrics"]["version"]: m.ridge for m in map(KVMapper.from_pretrained, (a, b))}
print("ready", flush=True)
while not Path(go).exists():
    time.sleep(0.01)
end, seen = time.monotonic() + float(seconds), collections.Counter()
while time.monotonic() < end:
    try:
        m = KVMapper.from_pretrained(dest)
        name = m.info["metrics"]["version"]
        seen[name if m.ridge == ridge[name] else "mixed"] += 1
    except PackError as err:
        seen["error: " + str(err)] += 1
print(dict(seen))
"""


def test_concurrent_writers_and_readers(versions, tmp_path):
    """Two real processes save A and B over one pack as fast as they can while two others
    load it: every save succeeds, every load finds a whole pack, one valid pack remains."""
    dest = KVMapper.from_pretrained(versions["A"]).save_pretrained(tmp_path / "out" / "pack")
    go, seconds = tmp_path / "go", "4"
    args = [str(versions["A"]), str(versions["B"]), str(dest), str(go), seconds]
    procs = [
        subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True)
        for script in (WRITER, WRITER, READER, READER)
    ]
    for proc in procs:
        assert proc.stdout.readline().strip() == "ready"
    go.touch()
    outputs = [proc.communicate(timeout=120)[0].strip() for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0, 0, 0], outputs
    saves = [int(out) for out in outputs[:2]]
    loads = [eval(out) for out in outputs[2:]]  # noqa: S307 (a dict printed by READER)
    print("saves per writer", saves, "loads per reader", loads)
    assert min(saves) > 0
    for seen in loads:
        assert set(seen) <= {"A", "B"}, seen
        assert sum(seen.values()) > 0
    version_of(dest)
    assert beside(dest) == [".pack.lock", "pack"]


def test_pack_files_get_ordinary_permissions(tiny_mapper, tmp_path):
    previous = os.umask(0o022)
    try:
        folder = tiny_mapper.save_pretrained(tmp_path / "out" / "pack")
    finally:
        os.umask(previous)
    assert folder.stat().st_mode & 0o777 == 0o755
    assert {p.stat().st_mode & 0o777 for p in folder.iterdir()} == {0o644}


def test_read_folder_reads_one_version_of_a_swapped_folder(tmp_path):
    """A reader that opened the old version when a writer swapped the new one in reads again
    from the new version instead of mixing files or reporting the missing one."""
    folder = tmp_path / "f"
    with files.replacing_folder(folder) as staging:
        (staging / "a").write_text("old a")
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with files.replacing_folder(folder) as staging:
            (staging / "a").write_text("new a")
            (staging / "b").write_text("new b")
        # the old version, still open, no longer has the name: it is not the folder now
        assert not files._same_folder(fd, folder)
    finally:
        os.close(fd)
    assert files.read_folder(folder, ("a", "b")) == {"a": b"new a", "b": b"new b"}


def test_destinations_that_are_not_packs_are_never_replaced(tiny_mapper, tmp_path):
    """``fit --out .`` once deleted the current folder's files: a folder that is not a pack is
    refused, with or without ``overwrite``, and left exactly as it was."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("a file")
    (tmp_path / "link").symlink_to(work)
    for dest, message in [
        (work, "is not a mapper pack"),
        (tmp_path / "file", "is not a mapper pack"),
        (tmp_path / "link", "symbolic link"),
    ]:
        for overwrite in (False, True):
            with pytest.raises(PackError, match=message):
                tiny_mapper.save_pretrained(dest, overwrite=overwrite)
    assert sorted(p.name for p in work.iterdir()) == ["notes.txt"]
    assert (tmp_path / "file").read_text() == "a file"


def test_an_existing_pack_is_replaced_only_with_overwrite(tiny_mapper, tmp_path):
    pack = tiny_mapper.save_pretrained(tmp_path / "out" / "pack")
    with pytest.raises(PackError, match="already holds a mapper pack; pass overwrite"):
        tiny_mapper.save_pretrained(pack)
    assert tiny_mapper.save_pretrained(pack, overwrite=True) == pack
    (pack / "mine.txt").write_text("keep me")
    with pytest.raises(PackError, match=r"other files \(mine.txt\)"):
        tiny_mapper.save_pretrained(pack, overwrite=True)
    assert (pack / "mine.txt").read_text() == "keep me"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert KVMapper.from_pretrained(tiny_mapper.save_pretrained(empty)).ridge == tiny_mapper.ridge


def test_a_staged_file_replaces_the_old_one_whole_or_not_at_all(tmp_path):
    path = tmp_path / "summary.md"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with files.staged_file(path) as staging:
            staging.write_text("half of the new")
            raise RuntimeError("killed mid-write")
    assert path.read_text() == "old"
    with files.staged_file(path) as staging:
        staging.write_text("new")
        assert path.read_text() == "old"  # nothing visible before the block ends
    assert path.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.md"]
