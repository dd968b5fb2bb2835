"""Offline text: calibration corpora never overlap the evaluation's."""

from pathlib import Path


def test_stdlib_docs_are_the_reference_pages_written_once(tmp_path):
    from pydoc_data.topics import topics

    from sgl_kvmap.fitting.texts import default_eval_files, stdlib_docs_files

    files = stdlib_docs_files(tmp_path)
    assert len(files) == len(topics) > 50
    assert {f.stem: f.read_text(encoding="utf-8") for f in files} == topics
    stamp = files[0].stat().st_mtime_ns
    assert stdlib_docs_files(tmp_path) == files and files[0].stat().st_mtime_ns == stamp
    assert not list(tmp_path.glob("*.partial"))
    assert not set(files) & set(default_eval_files())  # calibration text, never evaluation


def test_code_corpus_is_the_stdlib_and_dependency_sources_never_evaluation_packages():
    import torch as torch_package

    from sgl_kvmap.fitting.texts import (
        EVAL_PACKAGES,
        code_corpus_files,
        default_eval_files,
        package_files,
        stdlib_files,
    )

    files = code_corpus_files()
    torch_root = Path(torch_package.__file__).parent
    assert set(stdlib_files()) < set(files)
    assert any(torch_root in f.parents for f in files)  # a dependency's own sources
    assert all(f.suffix == ".py" for f in files) and len(set(files)) == len(files)
    assert not set(files) & set(default_eval_files())
    assert set(package_files(EVAL_PACKAGES)) <= set(default_eval_files())
    assert package_files(["no_such_package_here"]) == []
