"""The project's environment variables (KVMAP_*) and SGLang's SGL_* rule.

SGLang rewrites every ``SGL_*`` variable to ``SGLANG_*`` at import with a warning, so the old
``SGL_KVMAP_*`` names collided with its prefix rule. The SGLang test imports SGLang's real
``sglang.srt.environ`` in a fresh interpreter with warnings turned into errors.
"""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from sgl_kvmap.core.environment import setting
from sgl_kvmap.fitting.default_pair import cache_root

ROOT = Path(__file__).resolve().parents[1]


def test_new_name_wins_and_reads_without_warning(monkeypatch, tmp_path):
    monkeypatch.setenv("KVMAP_CACHE", str(tmp_path / "new"))
    monkeypatch.setenv("SGL_KVMAP_CACHE", str(tmp_path / "old"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache_root() == tmp_path / "new"


def test_legacy_name_still_read_with_a_warning(monkeypatch, tmp_path):
    monkeypatch.delenv("KVMAP_CACHE", raising=False)
    monkeypatch.setenv("SGL_KVMAP_CACHE", str(tmp_path / "old"))
    with pytest.warns(DeprecationWarning, match="KVMAP_CACHE"):
        assert cache_root() == tmp_path / "old"


def test_default_when_neither_is_set(monkeypatch):
    monkeypatch.delenv("KVMAP_HUB_NAMESPACE", raising=False)
    monkeypatch.delenv("SGL_KVMAP_HUB_NAMESPACE", raising=False)
    assert setting("HUB_NAMESPACE", "fallback") == "fallback"


def test_no_source_file_names_an_sgl_variable():
    offenders = [
        str(path.relative_to(ROOT))
        for folder in ("sgl_kvmap", "tests", "benchmarks", "scripts")
        for path in (ROOT / folder).rglob("*")
        if path.suffix in {".py", ".sh"}
        and path.name not in {"environment.py", "test_environment.py"}
        and "SGL_KVMAP" in path.read_text(errors="replace")
    ]
    assert offenders == []


def test_sglang_import_is_silent_with_the_project_variables(tmp_path):
    pytest.importorskip("sglang")
    env = {**os.environ, "KVMAP_CACHE": str(tmp_path), "KVMAP_HUB_NAMESPACE": "someone"}
    env = {key: value for key, value in env.items() if not key.startswith("SGL_")}
    done = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", "import sglang.srt.environ"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
