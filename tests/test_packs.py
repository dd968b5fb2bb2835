"""Packs on a Hub: push -> pull round trips, lists, resolve through the Hub, and each refusal,
all through huggingface_hub's real client against the local test Hub (tests/hub_servers.py:
olah serving git mirrors, and a small write server for commits, tags and listings).

What stands in for the real Hub is that test Hub; nothing in huggingface_hub or sgl-kvmap is
patched. ``HF_ENDPOINT`` points at it (read at call time by the registry); the Hugging Face
cache is a temporary folder given as ``cache_dir`` (or ``HF_HOME`` for child processes)."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from sgl_kvmap.core.errors import PackError
from sgl_kvmap.core.mapper import KVMapper
from sgl_kvmap.core.pack import CONFIG_FILE, PACK_FILES, TENSORS_FILE
from sgl_kvmap.core.spec import spec_from_pretrained
from sgl_kvmap.registry.naming import repo_name
from sgl_kvmap.registry.packs import cached_packs, fetch_pack, hub_packs, push_pack
from sgl_kvmap.registry.resolve import resolve_pack

from .test_resolve import SMALL_RECIPE


@pytest.fixture
def online(hub, monkeypatch, tmp_path):
    """The test Hub as the endpoint, and a fresh Hugging Face cache folder."""
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    return tmp_path / "hf-cache"


@pytest.fixture(scope="module")
def pack(tiny_mapper, tmp_path_factory) -> Path:
    return tiny_mapper.save_pretrained(tmp_path_factory.mktemp("packs") / "pack")


def file_bytes(folder: Path) -> dict[str, bytes]:
    return {name: (Path(folder) / name).read_bytes() for name in PACK_FILES}


def test_push_then_pull_gives_the_same_commit_and_bytes(hub, online, pack, tiny_mapper):
    repo_id = hub.new_repo_id("pack")
    commit = push_pack(pack, repo_id, tag="v1", token=hub.token)
    for revision in (None, "main", "v1", commit):
        folder = fetch_pack(repo_id, revision=revision, cache_dir=online)
        assert folder.name == commit and file_bytes(folder) == file_bytes(pack)
    assert hub.api().model_info(repo_id, revision="v1").sha == commit
    loaded = KVMapper.from_pretrained(repo_id, revision="v1", cache_dir=online)
    assert loaded.selection == tiny_mapper.selection and loaded.ridge == tiny_mapper.ridge
    card = ModelCard((folder / "README.md").read_text())
    assert card.data.library_name == "sgl-kvmap"
    assert card.data.kvmap["target_fingerprint"] == tiny_mapper.target.fingerprint


def test_push_to_hub_from_the_mapper_and_find_it_by_tag(hub, online, tiny_mapper):
    repo_id = hub.new_repo_id("mixin")
    commit = tiny_mapper.push_to_hub(repo_id, token=hub.token)
    found = [e for e in hub_packs("kv-cache", token=hub.token) if e.repo_id == repo_id]
    assert len(found) == 1 and found[0].commit == commit
    assert found[0].source_fingerprint == tiny_mapper.source.fingerprint
    assert found[0].target_fingerprint == tiny_mapper.target.fingerprint
    fetch_pack(repo_id, cache_dir=online)
    assert [e.commit for e in cached_packs(online) if e.repo_id == repo_id] == [commit]


def test_a_branch_push_leaves_main_alone(hub, online, pack, tiny_mapper, tmp_path):
    repo_id = hub.new_repo_id("branch")
    first = push_pack(pack, repo_id, token=hub.token)
    other = replace(tiny_mapper, ridge=tiny_mapper.ridge * 3).save_pretrained(tmp_path / "v2")
    second = push_pack(other, repo_id, revision="v2", token=hub.token)
    assert second != first
    assert KVMapper.from_pretrained(repo_id, cache_dir=online).ridge == tiny_mapper.ridge
    on_v2 = KVMapper.from_pretrained(repo_id, revision="v2", cache_dir=online)
    assert on_v2.ridge == tiny_mapper.ridge * 3


def upload_raw(hub, folder: Path, repo_id: str) -> str:
    """Publish a folder as is, without the verification ``push_pack`` does first."""
    api = hub.api()
    api.create_repo(repo_id, exist_ok=True)
    return api.upload_folder(repo_id=repo_id, folder_path=folder).oid


def test_a_tampered_download_is_refused(hub, online, pack, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for name, data in file_bytes(pack).items():
        (bad / name).write_bytes(data)
    tensors = bytearray((bad / TENSORS_FILE).read_bytes())
    tensors[-1] ^= 0xFF
    (bad / TENSORS_FILE).write_bytes(bytes(tensors))
    repo_id = hub.new_repo_id("tampered")
    upload_raw(hub, bad, repo_id)
    with pytest.raises(PackError, match="checksum"):
        KVMapper.from_pretrained(repo_id, cache_dir=online)
    with pytest.raises(PackError, match="refusing|damaged|checksum"):
        push_pack(bad, hub.new_repo_id("never"), token=hub.token)


def test_a_future_format_is_refused_before_the_tensors_download(hub, online, pack, tmp_path):
    future = tmp_path / "future"
    future.mkdir()
    for name, data in file_bytes(pack).items():
        (future / name).write_bytes(data)
    config = json.loads((future / CONFIG_FILE).read_text())
    config["format_version"] = 99
    (future / CONFIG_FILE).write_text(json.dumps(config))
    repo_id = hub.new_repo_id("future")
    commit = upload_raw(hub, future, repo_id)
    with pytest.raises(PackError, match="format version 99"):
        fetch_pack(repo_id, cache_dir=online)
    snapshots = list(online.glob(f"models--*--{repo_id.split('/')[1]}/snapshots/{commit}/*"))
    assert [p.name for p in snapshots] == [CONFIG_FILE]  # the tensors never came


def test_offline_a_cached_pack_resolves_and_a_missing_one_says_how(hub, online, pack):
    repo_id = hub.new_repo_id("offline")
    commit = push_pack(pack, repo_id, token=hub.token)
    with pytest.raises(PackError, match=f"sgl-kvmap pull {repo_id}"):
        fetch_pack(repo_id, cache_dir=online, local_files_only=True)
    fetch_pack(repo_id, cache_dir=online)
    assert fetch_pack(repo_id, cache_dir=online, local_files_only=True).name == commit


def test_an_unknown_repo_or_revision_is_one_clear_error(hub, online, pack):
    with pytest.raises(PackError, match="no such pack on the Hub"):
        fetch_pack(hub.new_repo_id("absent"), cache_dir=online)
    repo_id = hub.new_repo_id("revs")
    push_pack(pack, repo_id, token=hub.token)
    with pytest.raises(PackError, match="no such pack on the Hub"):
        fetch_pack(repo_id, revision="no-such-branch", cache_dir=online)


def conventional_id(hub, source: str, target: str) -> str:
    s, t = spec_from_pretrained(source), spec_from_pretrained(target)
    return f"{hub.user}/{repo_name(s.model_id, t.model_id, s.fingerprint, t.fingerprint, 'qwen2')}"


def built(model_folders, source: str, target: str, assets: Path) -> Path:
    """A small pack fitted here for two of ``model_folders`` (specs read from the folders)."""
    pair = model_folders[source], model_folders[target]
    return resolve_pack(
        *pair, build=True, local_files_only=True, assets_dir=assets, recipe=SMALL_RECIPE
    )


def test_resolve_finds_the_conventional_repo_and_refuses_other_models(
    hub, online, model_folders, tmp_path
):
    pack = built(model_folders, "source", "target", tmp_path / "built")
    pair = model_folders["source"], model_folders["target"]
    commit = push_pack(pack, conventional_id(hub, *pair), token=hub.token)
    common = {"namespace": hub.user, "cache_dir": online, "assets_dir": tmp_path / "assets"}
    assert resolve_pack(*pair, **common).name == commit
    # the same pack published under another pair's name is not used for that pair
    wrong = model_folders["source"], model_folders["other"]
    wrong_commit = push_pack(pack, conventional_id(hub, *wrong), token=hub.token)
    with pytest.raises(PackError, match="no mapper pack"):
        resolve_pack(*wrong, **common)
    # nor with allow_mismatch: other's KV geometry is not the target's (issue 34)
    with pytest.raises(PackError, match="no mapper pack"):
        resolve_pack(*wrong, allow_mismatch=True, **common)
    assert fetch_pack(conventional_id(hub, *wrong), cache_dir=online).name == wrong_commit


def test_resolve_finds_a_pack_under_any_name_by_its_tags(hub, online, model_folders, tmp_path):
    pack = built(model_folders, "source", "other", tmp_path / "built")
    repo_id = hub.new_repo_id("any-name")
    commit = push_pack(pack, repo_id, token=hub.token)
    pair = model_folders["source"], model_folders["other"]
    found = resolve_pack(*pair, namespace="nobody", cache_dir=online, assets_dir=tmp_path / "a")
    assert found.name == commit and repo_id.replace("/", "--") in str(found)
    assert file_bytes(found) == file_bytes(pack)


def run_cli(hub, home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HOME": str(home), "HF_TOKEN": hub.token}
    return subprocess.run(
        [sys.executable, "-m", "sgl_kvmap.cli", *args], capture_output=True, text=True, env=env
    )


def test_the_command_line_round_trip(hub, pack, tmp_path):
    """push, pull, verify and list as a user runs them (child processes, ``HF_HOME`` in a
    temporary folder)."""
    repo_id = hub.new_repo_id("cli")
    pushed = run_cli(hub, tmp_path, "push", str(pack), repo_id, "--tag", "v1")
    assert pushed.returncode == 0, pushed.stderr
    commit = pushed.stdout.strip().rsplit("@", 1)[1]
    pulled = run_cli(hub, tmp_path, "pull", repo_id, "--revision", "v1")
    assert pulled.returncode == 0, pulled.stderr
    assert Path(pulled.stdout.strip()).name == commit
    assert file_bytes(Path(pulled.stdout.strip())) == file_bytes(pack)
    verified = run_cli(hub, tmp_path, "verify", repo_id, "--revision", commit)
    assert verified.returncode == 0 and "ok  integrity" in verified.stdout, verified.stderr
    listed = run_cli(hub, tmp_path, "list")
    assert repo_id in listed.stdout and commit[:12] in listed.stdout
    remote = run_cli(hub, tmp_path, "list", "--remote")
    assert repo_id in remote.stdout
    offline = run_cli(hub, tmp_path, "pull", hub.new_repo_id("missing"))
    assert offline.returncode == 1 and offline.stderr.startswith("error: ")
    assert len(offline.stderr.strip().splitlines()) == 1


def test_sglang_args_takes_a_hub_pack_at_one_commit(hub, online, model_folders, tmp_path):
    """The launch command names the pack's snapshot folder at the commit the tag resolved to,
    so what the engines load is what was verified."""
    pack = built(model_folders, "source", "target", tmp_path / "built")
    repo_id = hub.new_repo_id("served")
    commit = push_pack(pack, repo_id, tag="v1", token=hub.token)
    engines = ["--engine", model_folders["source"], "--engine", model_folders["target"]]
    done = run_cli(hub, tmp_path / "home", "sglang-args", *engines, "--pack", f"{repo_id}@v1")
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"snapshots/{commit}" in done.stdout


SPEC_OF = """
import sys
from sgl_kvmap.core.spec import spec_from_pretrained
spec = spec_from_pretrained(sys.argv[1])
print(spec.model_id, spec.revision)
"""


def test_a_hub_model_is_pinned_by_the_commit_it_resolved_to(hub, model_folders, tmp_path):
    """A model given by Hub id: its spec (what a pack records) names the id and the commit."""
    repo_id = hub.new_repo_id("model")
    api = hub.api()
    api.create_repo(repo_id)
    commit = api.upload_folder(repo_id=repo_id, folder_path=model_folders["source"]).oid
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", SPEC_OF, repo_id], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == [repo_id, commit]
