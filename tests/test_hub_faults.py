"""The registry against a Hub that misbehaves (issue 34, "Reliability, round two"): broken or
lying repositories, servers that fail, stall or answer nonsense, caches that cannot be written,
and names that are not names. Each fault ends in one line that says what is wrong (or the
candidate is skipped with one logged line), and a failed push leaves the remote as it was.

The Hubs are real servers on 127.0.0.1: the test Hub (tests/hub_servers.py), and the proxies and
silent ports of tests/hub_faulty.py in front of it; commands run as a user runs them (the click
CLI, in process or as a child process) or through the registry's public functions."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner
from huggingface_hub import constants, hf_hub_download

from sgl_kvmap.cli import main
from sgl_kvmap.core.errors import PackError, PairMismatchError
from sgl_kvmap.core.mapper import KVMapper
from sgl_kvmap.core.pack import CARD_FILE, CONFIG_FILE, TENSORS_FILE, read_config
from sgl_kvmap.core.spec import spec_from_pretrained
from sgl_kvmap.registry.card import render_card
from sgl_kvmap.registry.naming import pack_tags, repo_name
from sgl_kvmap.registry.packs import fetch_pack, hub_packs, push_pack
from sgl_kvmap.registry.resolve import check_pins, resolve_pack

from .conftest import save_loaded, tiny_model
from .hub_faulty import FaultyHub, Rule, silent_endpoint
from .test_resolve import SMALL_RECIPE

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def online(hub, monkeypatch, tmp_path):
    """The test Hub as the endpoint, a fresh Hugging Face cache (also the CLI's default)."""
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.setenv("HF_TOKEN", hub.token)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    return tmp_path / "hf-cache"


@pytest.fixture(scope="module")
def lone_pair(tmp_path_factory) -> tuple[str, str]:
    """Two model folders of a geometry no other test publishes (2x2x16 -> 3x1x32)."""
    root = tmp_path_factory.mktemp("lone")
    source = tiny_model("qwen2", seed=41, layers=2, kv_heads=2, head_dim=16)
    target = tiny_model("qwen2", seed=42, layers=3, kv_heads=1, head_dim=32)
    return save_loaded(source, root / "source"), save_loaded(target, root / "target")


@pytest.fixture(scope="module")
def lone_pack(lone_pair, tmp_path_factory) -> Path:
    """A small pack fitted here for ``lone_pair``."""
    assets = tmp_path_factory.mktemp("lone-built")
    return resolve_pack(
        *lone_pair, build=True, local_files_only=True, assets_dir=assets, recipe=SMALL_RECIPE
    )


@pytest.fixture(scope="module")
def pack(tiny_mapper, tmp_path_factory) -> Path:
    return tiny_mapper.save_pretrained(tmp_path_factory.mktemp("packs") / "pack")


def copy_pack(pack: Path, folder: Path, skip: tuple[str, ...] = ()) -> Path:
    folder.mkdir(parents=True)
    for name in (CONFIG_FILE, TENSORS_FILE, CARD_FILE):
        if name not in skip:
            shutil.copyfile(pack / name, folder / name)
    return folder


def upload_raw(hub, folder: Path, repo_id: str) -> str:
    """Publish a folder as is (no verification, no card of ours)."""
    api = hub.api()
    api.create_repo(repo_id, exist_ok=True)
    return api.upload_folder(repo_id=repo_id, folder_path=folder).oid


def cli(*args: str, **env: str):
    """``sgl-kvmap args`` in process; returns click's Result (stdout and stderr apart)."""
    return CliRunner().invoke(main, list(args), env=env or None)


def one_error_line(result, exit_code: int = 1) -> str:
    """The single ``error:`` line a failed command printed (no traceback)."""
    assert result.exit_code == exit_code, (result.output, result.exception)
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    lines = [line for line in result.stderr.splitlines() if line.strip() and not progress(line)]
    assert len(lines) == 1 and lines[0].lower().startswith("error"), result.stderr
    return lines[0]


def progress(line: str) -> bool:
    """Whether ``line`` is huggingface_hub's progress bar (on stderr beside the error)."""
    return "it/s]" in line or "%|" in line


def run_cli(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    """``sgl-kvmap args`` in a child process with ``env`` added."""
    return subprocess.run(
        [sys.executable, "-m", "sgl_kvmap.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=timeout,
    )


def child_error_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 1, (done.stdout, done.stderr[-3000:])
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: "), done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return lines[-1]


def main_sha(hub, repo_id: str, revision: str = "main") -> str:
    return hub.api().model_info(repo_id, revision=revision).sha


# -- 1. a repo with the pair's tags but no valid kvmap.json ------------------------------------


def test_resolve_skips_a_tagged_repo_without_a_valid_manifest(
    hub, online, lone_pair, lone_pack, tmp_path, caplog
):
    """Two repos whose cards carry the pair's fingerprint tags come first in the tag search: one
    without kvmap.json, one whose kvmap.json is not JSON. resolve skips each in one logged line
    and takes the valid pack published after them."""
    broken = copy_pack(lone_pack, tmp_path / "no-manifest", skip=(CONFIG_FILE,))
    unreadable = copy_pack(lone_pack, tmp_path / "not-json")
    (unreadable / CONFIG_FILE).write_text("{ this is not json")
    upload_raw(hub, broken, hub.new_repo_id("aaa-no-manifest"))
    upload_raw(hub, unreadable, hub.new_repo_id("aab-not-json"))
    common = {"namespace": "nobody", "cache_dir": online, "assets_dir": tmp_path / "assets"}
    with pytest.raises(PackError, match="no mapper pack"):
        resolve_pack(*lone_pair, **common)  # only broken repos: a miss, not their error
    skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipping")]
    assert any("aaa-no-manifest" in line for line in skipped), skipped
    assert any("aab-not-json" in line for line in skipped), skipped
    built = resolve_pack(*lone_pair, build=True, recipe=SMALL_RECIPE, **common)
    assert KVMapper.from_pretrained(built).target.fingerprint == (
        spec_from_pretrained(lone_pair[1]).fingerprint
    )
    good = hub.new_repo_id("zzz-good")
    commit = push_pack(lone_pack, good, token=hub.token)
    fresh = {**common, "assets_dir": tmp_path / "fresh-assets"}
    found = resolve_pack(*lone_pair, **fresh)
    assert found.name == commit and good.replace("/", "--") in str(found)


# -- 2. malformed model cards -------------------------------------------------------------------

BAD_CARDS = {
    "list-block": "kvmap: [source, target, source_fingerprint, target_fingerprint]\n",
    "text-block": "kvmap: just text\n",
    "typed-block": (
        "kvmap:\n  source: {nested: 1}\n  target: 3\n  source_fingerprint: [1, 2]\n"
        "  target_fingerprint: null\n"
    ),
}


def bad_card(block: str, tags: list[str]) -> str:
    tag_lines = "".join(f"- {tag}\n" for tag in tags)
    return f"---\nlibrary_name: sgl-kvmap\ntags:\n{tag_lines}{block}---\n# not a good card\n"


def test_malformed_cards_are_skipped_by_list_remote_and_resolve(
    hub, online, lone_pair, lone_pack, tmp_path, caplog
):
    config = read_config(lone_pack)
    tags = pack_tags("qwen2", config["source_fingerprint"], config["target_fingerprint"])
    bad_ids = []
    for name, block in BAD_CARDS.items():
        folder = copy_pack(lone_pack, tmp_path / name)
        (folder / CARD_FILE).write_text(bad_card(block, tags))
        bad_ids.append(hub.new_repo_id(f"aaa-card-{name}"))
        upload_raw(hub, folder, bad_ids[-1])
    good = hub.new_repo_id("zzz-card-good")
    commit = push_pack(lone_pack, good, token=hub.token)
    listed = cli("list", "--remote")
    assert listed.exit_code == 0, (listed.output, listed.exception)
    assert good in listed.stdout and not any(bad in listed.stdout for bad in bad_ids)
    found = cli("resolve", *lone_pair, "--namespace", "nobody")
    assert found.exit_code == 0, (found.output, found.exception)
    assert Path(found.stdout.strip()).name == commit
    for bad in bad_ids:
        assert any(bad in r.getMessage() and "card" in r.getMessage() for r in caplog.records)


# -- 3. --allow-mismatch never accepts another KV geometry -------------------------------------


def test_allow_mismatch_never_accepts_another_kv_geometry(hub, online, model_folders, tmp_path):
    """A pack for source -> target (4 layers x 1 KV head x 32) published under the name of the
    pair source -> other (2 layers x 1 x 32): its shapes cannot fill other's cache, so even
    --allow-mismatch refuses it; a pack of the right shapes for other models is accepted."""
    pair = model_folders["source"], model_folders["target"]
    wrong = model_folders["source"], model_folders["other"]
    pack = resolve_pack(
        *pair, build=True, local_files_only=True, assets_dir=tmp_path / "b", recipe=SMALL_RECIPE
    )
    specs = [spec_from_pretrained(m) for m in wrong]
    name = repo_name(
        specs[0].model_id, specs[1].model_id, specs[0].fingerprint, specs[1].fingerprint, "qwen2"
    )
    push_pack(pack, f"{hub.user}/{name}", token=hub.token)
    with pytest.raises(PairMismatchError, match="layers"):
        check_pins(pack, tuple(specs), allow_mismatch=True)
    refused = cli("resolve", *wrong, "--allow-mismatch", "--namespace", hub.user)
    assert "no mapper pack" in one_error_line(refused)
    # same shapes, other models (rope_theta differs): what --allow-mismatch is for
    right = (spec_from_pretrained(pair[0]), spec_from_pretrained(pair[1]))
    other_config = {**right[1].config, "rope_theta": 1.0}
    check_pins(pack, (right[0], replace(right[1], config=other_config)), allow_mismatch=True)


# -- 4. a failed push leaves the remote as it was -----------------------------------------------


def test_a_taken_tag_refuses_the_push_before_anything_moves(
    hub, online, pack, tiny_mapper, tmp_path
):
    repo_id = hub.new_repo_id("taken-tag")
    first = push_pack(pack, repo_id, tag="v1", token=hub.token)
    other = replace(tiny_mapper, ridge=tiny_mapper.ridge * 5).save_pretrained(tmp_path / "v2")
    refused = cli("push", str(other), repo_id, "--tag", "v1")
    assert "v1" in one_error_line(refused)
    assert main_sha(hub, repo_id) == first and main_sha(hub, repo_id, "v1") == first
    commits = hub.api().list_repo_commits(repo_id)
    assert len(commits) == 2  # the repo's first commit and the first push: nothing else


@pytest.mark.parametrize("branch", [None, "dev"])
def test_a_tag_the_hub_refuses_leaves_the_branch_as_it_was(
    hub, online, pack, tiny_mapper, tmp_path, monkeypatch, branch
):
    """The Hub refuses the tag only when it is asked (409, as for a tag made a moment before):
    the commit already made is undone, so the branch holds the old pack (or is gone, when the
    push created it) and no tag exists."""
    repo_id = hub.new_repo_id("refused-tag")
    first = push_pack(pack, repo_id, token=hub.token)
    other = replace(tiny_mapper, ridge=tiny_mapper.ridge * 7).save_pretrained(tmp_path / "v2")
    with FaultyHub(hub.endpoint) as faulty:
        faulty.rules.append(Rule("POST", r"/api/models/.+/tag/.+", status=409))
        monkeypatch.setenv("HF_ENDPOINT", faulty.url)
        with pytest.raises(PackError, match="tag") as err:
            push_pack(other, repo_id, revision=branch, tag="v2", token=hub.token)
        assert faulty.rules[0].hits == 1
    assert "\n" not in str(err.value)
    api = hub.api()
    refs = api.list_repo_refs(repo_id)
    assert [t.name for t in refs.tags] == []
    assert sorted(b.name for b in refs.branches) == ["main"]
    main_now = api.model_info(repo_id).sha
    got = hf_hub_download(
        repo_id, CONFIG_FILE, revision=main_now, endpoint=hub.endpoint, cache_dir=tmp_path / "c"
    )
    assert Path(got).read_bytes() == (pack / CONFIG_FILE).read_bytes()
    if branch is not None:
        assert main_now == first


# -- 5. the card pushed is the pack's ----------------------------------------------------------


def test_the_pushed_card_is_generated_from_the_pack(hub, online, pack, tmp_path):
    lying = copy_pack(pack, tmp_path / "lying")
    card = (lying / CARD_FILE).read_text()
    config = read_config(pack)
    (lying / CARD_FILE).write_text(
        card.replace(config["source_fingerprint"], "0" * 64) + "\n| retention | 0.9999 |\n"
    )
    cardless = copy_pack(pack, tmp_path / "cardless", skip=(CARD_FILE,))
    for folder in (lying, cardless):
        repo_id = hub.new_repo_id("card")
        commit = push_pack(folder, repo_id, token=hub.token)
        got = hf_hub_download(
            repo_id, CARD_FILE, revision=commit, endpoint=hub.endpoint, cache_dir=online
        )
        assert Path(got).read_text() == render_card(config)


# -- 6. a "commit" that is a branch name -------------------------------------------------------


def with_sha(value: str):
    def rewrite(answer):
        if isinstance(answer, list):
            return [{**item, "sha": value} for item in answer]
        return {**answer, "sha": value}

    return rewrite


def test_a_branch_name_given_as_the_commit_is_refused(
    hub, online, pack, tmp_path, monkeypatch, caplog
):
    repo_id = hub.new_repo_id("sha-main")
    push_pack(pack, repo_id, token=hub.token)
    with FaultyHub(hub.endpoint) as faulty:
        faulty.rules.append(Rule("GET", r"/api/models(/.*)?", rewrite=with_sha("main")))
        monkeypatch.setenv("HF_ENDPOINT", faulty.url)
        with pytest.raises(PackError, match="not a commit") as err:
            fetch_pack(repo_id, cache_dir=tmp_path / "cache")
        assert "\n" not in str(err.value)
        assert [e for e in hub_packs("kv-cache", token=hub.token) if e.repo_id == repo_id] == []
    assert any("not a commit" in r.getMessage() for r in caplog.records)
    assert not list((tmp_path / "cache").glob("models--*/snapshots/main"))


# -- 7. a Hub that never answers ---------------------------------------------------------------


def test_a_hub_that_never_answers_times_out_in_one_line(pack, tmp_path, monkeypatch):
    """A port that accepts and never answers hung pull for minutes; now each command gives up
    after KVMAP_HUB_TIMEOUT seconds and says so (pull as a child process, which reads the
    variable at start; list --remote and push in this one)."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    with silent_endpoint() as url:
        env = {"HF_ENDPOINT": url, "KVMAP_HUB_TIMEOUT": "1", "HF_TOKEN": "x"}
        start = time.monotonic()
        line = child_error_line(run_cli("pull", "some/pack", HF_HOME=str(tmp_path), **env))
        assert "did not answer within 1 s" in line and "KVMAP_HUB_TIMEOUT" in line, line
        for args in (["list", "--remote"], ["push", str(pack), "a/b"]):
            line = one_error_line(cli(*args, **env))
            assert "did not answer within 1 s" in line and "KVMAP_HUB_TIMEOUT" in line, line
        assert time.monotonic() - start < 60


def test_a_bad_timeout_setting_is_one_line(monkeypatch):
    result = cli("pull", "some/pack", KVMAP_HUB_TIMEOUT="soon")
    assert "KVMAP_HUB_TIMEOUT" in one_error_line(result)


# -- 8. a server error is a server error -------------------------------------------------------


def test_a_server_error_is_reported_as_one(hub, online, monkeypatch, caplog, lone_pair, tmp_path):
    with FaultyHub(hub.endpoint) as faulty:
        faulty.rules.append(Rule(".*", r"/.*", status=500))
        monkeypatch.setenv("HF_ENDPOINT", faulty.url)
        for args in (["pull", "some/pack"], ["list", "--remote"]):
            line = one_error_line(cli(*args))
            assert "HTTP 500" in line and "server error" in line, line
            assert "offline" not in line and "HF_HUB_OFFLINE" not in line, line
        with pytest.raises(PackError, match="no mapper pack"):
            resolve_pack(*lone_pair, cache_dir=online, assets_dir=tmp_path / "assets")
    assert any("HTTP 500" in r.getMessage() for r in caplog.records)


# -- 9. caches that cannot be written -----------------------------------------------------------


def mount(*args: str) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@pytest.fixture
def read_only(tmp_path):
    """``read_only(folder)``: the folder's read-only view (a read-only bind mount), undone at the
    end. Skips where mounting is not allowed (root in a container is needed)."""
    mounted = []

    def view(folder: Path) -> Path:
        target = tmp_path / f"ro-{len(mounted)}"
        target.mkdir()
        if not mount("--bind", str(folder), str(target)):
            pytest.skip("mounting is not allowed here")
        mounted.append(target)
        assert mount("-o", "remount,ro,bind", str(target))
        return target

    yield view
    for target in mounted:
        subprocess.run(["umount", str(target)], check=True)


@pytest.fixture
def tiny_disk(tmp_path):
    """A 64 KiB file system (tmpfs), for a cache that fills up; skips where mounting is not
    allowed."""
    target = tmp_path / "tiny-disk"
    target.mkdir()
    if not mount("-t", "tmpfs", "-o", "size=64k", "tmpfs", str(target)):
        pytest.skip("mounting is not allowed here")
    yield target
    subprocess.run(["umount", str(target)], check=True)


def test_a_read_only_cache_serves_what_it_holds_and_names_itself(
    hub, online, lone_pair, lone_pack, tmp_path, read_only
):
    """pull, list and resolve read what a read-only cache holds; what it lacks is one line
    naming the cache as not writable (before: a network error advising offline mode)."""
    home = tmp_path / "home"
    repo_id = hub.new_repo_id("read-only")
    push_pack(lone_pack, repo_id, token=hub.token)
    env = {"HF_ENDPOINT": hub.endpoint, "HF_TOKEN": hub.token}
    done = run_cli("pull", repo_id, HF_HOME=str(home), **env)
    assert done.returncode == 0, done.stderr[-3000:]
    view = read_only(home)
    env["HF_HOME"] = str(view)
    pulled = run_cli("pull", repo_id, **env)
    assert pulled.returncode == 0, pulled.stderr[-3000:]
    listed = run_cli("list", **env)
    assert listed.returncode == 0 and repo_id in listed.stdout, listed.stderr[-3000:]
    found = run_cli("resolve", *lone_pair, "--namespace", "nobody", **env)
    assert found.returncode == 0, found.stderr[-3000:]
    assert f"models--{repo_id.replace('/', '--')}" in found.stdout
    missing = hub.new_repo_id("read-only-missing")
    push_pack(lone_pack, missing, token=hub.token)
    line = child_error_line(run_cli("pull", missing, **env))
    assert "not writable" in line and str(view) in line and "HF_HUB_OFFLINE" not in line, line


def test_a_full_disk_is_named_as_such(hub, online, pack, tiny_disk):
    repo_id = hub.new_repo_id("full")
    push_pack(pack, repo_id, token=hub.token)
    env = {"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tiny_disk)}
    line = child_error_line(run_cli("pull", repo_id, **env))
    assert "no space left" in line.lower() and str(tiny_disk) in line, line
    assert "HF_HUB_OFFLINE" not in line, line


# -- 10. a damaged pack in the cache -----------------------------------------------------------


def damage(folder: Path) -> None:
    """Flip the last byte of the cached tensors (through the snapshot's link, as a disk would)."""
    path = (folder / TENSORS_FILE).resolve()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_pull_replaces_a_damaged_cached_pack(hub, online, pack, caplog):
    repo_id = hub.new_repo_id("damaged")
    push_pack(pack, repo_id, token=hub.token)
    first = cli("pull", repo_id)
    assert first.exit_code == 0, first.output
    folder = Path(first.stdout.strip())
    damage(folder)
    with pytest.raises(PackError, match="checksum"):
        KVMapper.from_pretrained(folder)
    again = cli("pull", repo_id)
    assert again.exit_code == 0, (again.output, again.exception)
    assert Path(again.stdout.strip()) == folder
    assert any("downloading it again" in r.getMessage() for r in caplog.records)
    KVMapper.from_pretrained(folder)
    forced = cli("pull", repo_id, "--force")
    assert forced.exit_code == 0, forced.output
    KVMapper.from_pretrained(folder)


def test_a_damaged_cached_pack_offline_says_how_to_repair_it(hub, online, pack, monkeypatch):
    repo_id = hub.new_repo_id("damaged-offline")
    push_pack(pack, repo_id, token=hub.token)
    folder = Path(cli("pull", repo_id).stdout.strip())
    damage(folder)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    line = one_error_line(cli("pull", repo_id))
    assert "checksum" in line and f"sgl-kvmap pull {repo_id} --force" in line, line


# -- 11. names that are not names --------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["pull", "bad repo!!/x"],
        ["pull", "a/b--c"],
        ["verify", "org/na..me"],
        ["push", "{pack}", "bad repo!!/x"],
        ["push", "{pack}", "a/b--c"],
        ["resolve", "{source}", "{target}", "--namespace", "bad ns!"],
        ["resolve", "{source}", "{target}", "--namespace", "a/b"],
    ],
)
def test_invalid_repo_ids_and_namespaces_are_one_line(online, pack, model_folders, args):
    values = {"pack": str(pack), "source": model_folders["source"]}
    values["target"] = model_folders["target"]
    result = cli(*(arg.format(**values) for arg in args))
    assert result.exit_code in (1, 2), (result.output, result.exception)
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.output
    assert lines and ("not a valid" in lines[-1] or "Invalid value" in lines[-1]), result.stderr


# -- 12. HF_HOME is a file ---------------------------------------------------------------------


def test_hf_home_pointing_at_a_file_is_one_line(hub, model_folders, tmp_path):
    home = tmp_path / "a-file"
    home.write_text("not a folder\n")
    env = {"HF_HOME": str(home), "HF_ENDPOINT": hub.endpoint}
    pair = model_folders["source"], model_folders["target"]
    for args in (["list"], ["pull", "some/pack"], ["resolve", *pair, "--offline"]):
        line = child_error_line(run_cli(*args, **env))
        assert "HF_HOME" in line and str(home) in line and "not a folder" in line, line


# -- helpers of the tests above ----------------------------------------------------------------


def test_the_faulty_hub_forwards_what_no_rule_matches(hub, tmp_path):
    """The proxy itself: unmatched requests reach the test Hub unchanged."""
    repo_id = hub.new_repo_id("proxied")
    api = hub.api()
    api.create_repo(repo_id)
    with FaultyHub(hub.endpoint) as faulty:
        from huggingface_hub import HfApi

        proxied = HfApi(endpoint=faulty.url, token=hub.token)
        assert proxied.model_info(repo_id).sha == api.model_info(repo_id).sha
        faulty.rules.append(Rule("GET", r"/api/models/.+", rewrite=with_sha("f" * 40)))
        assert proxied.model_info(repo_id).sha == "f" * 40
    assert json.dumps(with_sha("x")([{"a": 1}])) == '[{"a": 1, "sha": "x"}]'
