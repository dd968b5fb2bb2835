"""The local test Hub (tests/hub_servers.py), driven by huggingface_hub's own client only: what
is pushed through the write server comes back byte for byte from olah, at a branch, a tag and a
commit; listings read card tags; branches are independent; errors map to the Hub's exceptions."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from huggingface_hub import (
    CommitOperationAdd,
    CommitOperationDelete,
    HfApi,
    hf_hub_download,
    snapshot_download,
)
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from safetensors.numpy import save_file

CARD = "---\ntags: [{tag}]\nlibrary_name: {library}\n---\n# A mapper pack\n"


def make_pack(
    folder: Path, tag: str = "sgl-kvmap", library: str = "sgl-kvmap", version: int = 1
) -> Path:
    """A folder shaped like a mapper pack: kvmap.json, mapper.safetensors, README.md."""
    folder.mkdir(parents=True)
    (folder / "kvmap.json").write_text(json.dumps({"version": version}, indent=2) + "\n")
    weights = np.random.default_rng(version).standard_normal((64, 32)).astype(np.float32)
    save_file({"layer.0.k": weights}, str(folder / "mapper.safetensors"))
    (folder / "README.md").write_text(CARD.format(tag=tag, library=library))
    return folder


def contents(folder: str | Path, skip: tuple[str, ...] = (".gitattributes",)) -> dict[str, bytes]:
    root = Path(folder)
    files = (p for p in root.rglob("*") if p.is_file() and p.name not in skip)
    return {str(p.relative_to(root)): p.read_bytes() for p in files}


@pytest.fixture(scope="module")
def pushed(hub, tmp_path_factory):
    """A pack pushed in one commit to a new repository, tagged ``v1``: (repo id, folder, sha)."""
    api = hub.api()
    repo_id = hub.new_repo_id("pack")
    folder = make_pack(tmp_path_factory.mktemp("pushed") / "pack")
    assert api.create_repo(repo_id).repo_id == repo_id
    commit = api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message="add pack")
    api.create_tag(repo_id, tag="v1", revision=commit.oid)
    return repo_id, folder, commit.oid


def test_branch_tag_and_commit_download_the_pushed_bytes(hub, pushed, tmp_path):
    repo_id, folder, sha = pushed
    api = hub.api()
    commits = api.list_repo_commits(repo_id)
    assert [c.commit_id for c in commits][0] == sha and len(commits) == 2  # initial + ours
    snapshots = {
        revision: snapshot_download(
            repo_id, revision=revision, endpoint=hub.endpoint, cache_dir=tmp_path / revision
        )
        for revision in ("main", "v1", sha)
    }
    for path in snapshots.values():
        assert Path(path).name == sha
        assert contents(path) == contents(folder)
    for revision in ("main", "v1", sha, None):
        assert api.model_info(repo_id, revision=revision).sha == sha
    refs = api.list_repo_refs(repo_id)
    assert [(t.name, t.target_commit) for t in refs.tags] == [("v1", sha)]


def test_allow_patterns_and_single_files(hub, pushed, tmp_path):
    repo_id, folder, sha = pushed
    got = snapshot_download(
        repo_id, allow_patterns=["*.json"], endpoint=hub.endpoint, cache_dir=tmp_path
    )
    assert contents(got) == {"kvmap.json": (folder / "kvmap.json").read_bytes()}
    weights = hf_hub_download(
        repo_id, "mapper.safetensors", revision="v1", endpoint=hub.endpoint, cache_dir=tmp_path
    )
    assert Path(weights).read_bytes() == (folder / "mapper.safetensors").read_bytes()
    assert f"/snapshots/{sha}/" in weights


def test_list_models_filters_on_card_tags(hub, pushed, tmp_path):
    repo_id, _, sha = pushed
    api = hub.api()
    other = hub.new_repo_id("other")
    api.create_repo(other)
    api.upload_folder(
        repo_id=other, folder_path=make_pack(tmp_path / "o", "unrelated", "transformers")
    )
    found = {m.id: m for m in api.list_models(filter="sgl-kvmap", cardData=True)}
    assert repo_id in found and other not in found
    assert found[repo_id].sha == sha and found[repo_id].card_data.tags == ["sgl-kvmap"]
    assert [m.id for m in api.list_models(search=other.split("/")[1])] == [other]
    assert [m.id for m in api.list_models(filter=["sgl-kvmap", "unrelated"])] == []
    assert api.model_info(repo_id).tags == ["sgl-kvmap"]


def test_a_commit_on_a_branch_leaves_main_alone(hub, pushed, tmp_path):
    repo_id, folder, sha = pushed
    api = hub.api()
    api.create_branch(repo_id, branch="v2")
    changed = make_pack(tmp_path / "v2", version=2)
    v2 = api.upload_folder(repo_id=repo_id, folder_path=changed, revision="v2").oid
    assert v2 != sha
    # olah reads the mirror live: the new branch head is served at once, by olah itself too
    olah = HfApi(endpoint=hub.olah_url)
    assert olah.model_info(repo_id, revision="v2").sha == v2
    assert olah.model_info(repo_id, revision="main").sha == sha
    for revision, want in (("v2", changed), ("main", folder)):
        got = hf_hub_download(
            repo_id, "kvmap.json", revision=revision, endpoint=hub.endpoint, cache_dir=tmp_path
        )
        assert Path(got).read_bytes() == (want / "kvmap.json").read_bytes()
    assert api.list_repo_commits(repo_id, revision="v2")[1].commit_id == sha


def test_local_files_only_resolves_a_cached_snapshot(hub, pushed, tmp_path):
    repo_id, folder, sha = pushed
    online = snapshot_download(repo_id, revision="v1", endpoint=hub.endpoint, cache_dir=tmp_path)
    offline = snapshot_download(
        repo_id, revision="v1", cache_dir=tmp_path, endpoint=hub.endpoint, local_files_only=True
    )
    assert offline == online and contents(offline) == contents(folder)
    with pytest.raises(LocalEntryNotFoundError):
        snapshot_download(repo_id, revision="main", cache_dir=tmp_path, local_files_only=True)


def test_errors_are_the_hubs(hub, pushed, tmp_path):
    repo_id, folder, sha = pushed
    api = hub.api()
    with pytest.raises(RepositoryNotFoundError):
        api.model_info(hub.new_repo_id("missing"))
    with pytest.raises(RevisionNotFoundError):
        api.model_info(repo_id, revision="no-such-branch")
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(repo_id, "absent.json", endpoint=hub.endpoint, cache_dir=tmp_path)
    assert api.whoami()["name"] == hub.user
    with pytest.raises(HfHubHTTPError) as denied:
        hub.api(token="wrong").create_repo(hub.new_repo_id("denied"))
    assert denied.value.response.status_code == 401
    with pytest.raises(HfHubHTTPError) as exists:
        api.create_repo(repo_id)
    assert exists.value.response.status_code == 409
    stale = api.list_repo_commits(repo_id)[-1].commit_id  # the initial commit
    add = CommitOperationAdd("notes.txt", b"late")
    with pytest.raises(HfHubHTTPError) as moved:
        api.create_commit(repo_id, [add], commit_message="late", parent_commit=stale)
    assert moved.value.response.status_code == 412
    assert api.model_info(repo_id).sha == sha


def test_unchanged_files_make_no_commit(hub, pushed):
    repo_id, folder, sha = pushed
    assert hub.api().upload_folder(repo_id=repo_id, folder_path=folder).oid == sha


def test_deletions(hub, tmp_path):
    api = hub.api()
    repo_id = hub.new_repo_id("deletions")
    api.create_repo(repo_id)
    folder = make_pack(tmp_path / "pack")
    api.upload_folder(repo_id=repo_id, folder_path=folder)
    (folder / "mapper.safetensors").unlink()
    api.upload_folder(repo_id=repo_id, folder_path=folder, delete_patterns=["*.safetensors"])
    assert sorted(api.list_repo_files(repo_id)) == [".gitattributes", "README.md", "kvmap.json"]
    api.create_commit(repo_id, [CommitOperationDelete("kvmap.json")], commit_message="rm")
    assert not api.file_exists(repo_id, "kvmap.json") and api.file_exists(repo_id, "README.md")
    with pytest.raises(EntryNotFoundError):
        api.create_commit(repo_id, [CommitOperationDelete("kvmap.json")], commit_message="again")
