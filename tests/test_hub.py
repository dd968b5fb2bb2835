"""registry.hub: model arguments as local folders (a folder, or a Hub id from the cache), and
one-line ModelSourceErrors for everything else. No test reaches the network."""

import pytest
from huggingface_hub import constants

from sgl_kvmap.core.errors import ModelSourceError
from sgl_kvmap.core.sources import local_folders
from sgl_kvmap.core.spec import spec_from_pretrained
from sgl_kvmap.models.capture import load_model
from sgl_kvmap.registry import model_folder

from .conftest import save_loaded

REPO = "sgl-kvmap-tests/tiny"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache, offline (nothing here may reach the network)."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hub"


def cache_snapshot(cache, loaded, weights: bool = True):
    """Put ``loaded`` (a LoadedModel) in ``cache`` as REPO at COMMIT, its ref main pointing
    there, as huggingface_hub lays a download out (without weights: as a spec-only fetch)."""
    repo = cache / f"models--{REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    save_loaded(loaded, snapshot)
    if not weights:
        for path in snapshot.glob("*.safetensors"):
            path.unlink()
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def test_a_local_folder_is_itself(tmp_path, hub_cache):
    """A folder holding a model (its config.json) is itself; one holding none is refused."""
    with pytest.raises(ModelSourceError, match="is a folder, but not a model's: it has no config"):
        model_folder(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert model_folder(tmp_path) == tmp_path


@pytest.mark.parametrize("model", ["./no/such/folder", "/no/such", "a b"])
def test_neither_a_folder_nor_a_repo_id_is_one_clear_error(model, hub_cache):
    with pytest.raises(ModelSourceError, match="not a folder .* and not a Hugging Face repo id"):
        model_folder(model)


def test_without_the_registry_only_folders_are_models(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert local_folders(str(tmp_path)) == tmp_path
    with pytest.raises(ModelSourceError, match="not a folder"):
        local_folders(REPO)


def test_offline_a_repo_id_outside_the_cache_says_so(hub_cache):
    with pytest.raises(ModelSourceError, match="not in the Hugging Face cache; HF_HUB_OFFLINE"):
        model_folder(REPO)


@pytest.fixture
def local_spec(tiny_pair, tmp_path):
    """The spec of ``tiny_pair[0]`` loaded from a local folder."""
    return load_model(save_loaded(tiny_pair[0], tmp_path / "local")).spec


def test_a_cached_repo_id_loads_offline_under_its_own_name(tiny_pair, hub_cache, local_spec):
    snapshot = cache_snapshot(hub_cache, tiny_pair[0])
    assert model_folder(REPO) == snapshot
    loaded = load_model(REPO)
    assert loaded.spec.model_id == REPO and loaded.spec.fingerprint == local_spec.fingerprint
    assert spec_from_pretrained(REPO) == loaded.spec


def test_a_cached_snapshot_without_weights_serves_specs_but_not_loads(
    tiny_pair, hub_cache, local_spec
):
    """A spec-only fetch (config and tokenizer) is enough for a spec, never taken for a model."""
    snapshot = cache_snapshot(hub_cache, tiny_pair[0], weights=False)
    assert model_folder(REPO, weights=False) == snapshot
    assert spec_from_pretrained(REPO).fingerprint == local_spec.fingerprint
    with pytest.raises(ModelSourceError, match="HF_HUB_OFFLINE"):
        model_folder(REPO)


def test_only_the_registry_imports_huggingface_hub():
    import ast
    from pathlib import Path

    package = Path(__file__).resolve().parents[1] / "sgl_kvmap"
    importers = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            if any(name.split(".")[0] == "huggingface_hub" for name in names):
                importers.add(path.relative_to(package).as_posix())
    assert importers and all(path.startswith("registry/") for path in importers), importers
