"""A local Hugging Face Hub for tests: olah serving git mirrors, behind a write server.

The session fixture ``hub`` starts olah 0.5.4 (a Hugging Face mirror server, installed in its own
virtual environment ``.venv-olah`` by scripts/setup_cpu.sh, so its web-framework pins stay out of
the project's) in offline mode on a free 127.0.0.1 port, serving the bare git repositories under
a temporary ``mirrors-path``, and in front of it the write server of tests/hub_write_server.py,
which commits into the same repositories and forwards every read to olah. ``hub.endpoint`` is
the one URL for ``HfApi(endpoint=...)``, ``snapshot_download(endpoint=...)`` or ``HF_ENDPOINT``.

olah reads mirrors live: each request opens the repository anew (GitPython), so a commit is
visible to the next request; nothing it serves from a mirror goes through its cache.

    def test_push(hub):
        api = hub.api()
        repo_id = hub.new_repo_id("pack")
        api.create_repo(repo_id)
        api.upload_folder(repo_id=repo_id, folder_path=pack_dir)
        snapshot_download(repo_id, endpoint=hub.endpoint, cache_dir=tmp_path)

Tests skip only when olah is not installed (run scripts/setup_cpu.sh); a failing start is an error.
"""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from huggingface_hub import HfApi

from .hub_write_server import HubWriteServer

ROOT = Path(__file__).resolve().parents[1]
OLAH_PYTHON = Path(os.environ.get("KVMAP_OLAH_PYTHON", ROOT / ".venv-olah" / "bin" / "python"))
TOKEN = "test-token"
USER = "tester"
STARTUP_SECONDS = 60

OLAH_CONFIG = """\
[basic]
host = "127.0.0.1"
port = {port}
repos-path = "{cache}"
mirrors-path = ["{mirrors}"]
mirror-netloc = "127.0.0.1:{port}"
mirror-lfs-netloc = "127.0.0.1:{port}"
# never contacted: offline mode serves the mirrors and olah's (empty) cache only
hf-netloc = "127.0.0.1:9"
hf-lfs-netloc = "127.0.0.1:9"
metadata-cache-ttl = 0

[accessibility]
offline = true
"""


@dataclass
class TestHub:
    """What the ``hub`` fixture yields."""

    endpoint: str  # the write server: writes, and every read forwarded to olah
    olah_url: str  # olah itself (reads only)
    mirrors: Path  # {mirrors}/models/{namespace}/{name}: bare git repositories
    token: str = TOKEN  # the only token the write server accepts
    user: str = USER  # whoami's name, the namespace of repo ids given without one
    _ids: Iterator[int] = field(default_factory=itertools.count, repr=False)

    __test__ = False  # not a test class, despite its name

    def api(self, token: str | None = TOKEN) -> HfApi:
        return HfApi(endpoint=self.endpoint, token=token if token is not None else False)

    def new_repo_id(self, prefix: str = "repo") -> str:
        """A repository id no other test of the session uses."""
        return f"{self.user}/{prefix}-{next(self._ids)}"

    def git_dir(self, repo_id: str, repo_type: str = "models") -> Path:
        return self.mirrors / repo_type / repo_id


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def olah_installed() -> str | None:
    """Why olah cannot run, or None."""
    if not OLAH_PYTHON.exists():
        return f"{OLAH_PYTHON} does not exist (scripts/setup_cpu.sh creates it)"
    done = subprocess.run([OLAH_PYTHON, "-c", "import olah.server"], capture_output=True)
    if done.returncode:
        return f"{OLAH_PYTHON} cannot import olah: {done.stderr.decode()[-500:]}"
    return None


def wait_until_answering(url: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"olah exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(url, timeout=5).close()
            return
        except urllib.error.HTTPError:
            return  # any HTTP answer means it is serving
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(
        f"olah did not answer {url} in {STARTUP_SECONDS} s:\n{log.read_text()[-3000:]}"
    )


def start_olah(work: Path, mirrors: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    config = work / "olah.toml"
    config.write_text(OLAH_CONFIG.format(port=port, cache=work / "olah-cache", mirrors=mirrors))
    log = work / "olah.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [OLAH_PYTHON, "-m", "olah.server", "-c", config, "--log-path", work / "logs"],
            cwd=work,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_answering(f"{url}/api/models/probe/probe/refs", process, log)
    except BaseException:
        stop(process)
        raise
    return process, url


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="session")
def hub(tmp_path_factory) -> Iterator[TestHub]:
    """olah (offline, serving git mirrors) behind the write server; see the module docstring."""
    if reason := olah_installed():
        pytest.skip(f"olah could not be installed: {reason}")
    work = tmp_path_factory.mktemp("hub")
    mirrors = work / "mirrors"
    (mirrors / "models").mkdir(parents=True)
    process, olah_url = start_olah(work, mirrors)
    host, port = olah_url.removeprefix("http://").split(":")
    server = HubWriteServer(mirrors, (host, int(port)), TOKEN, USER).start()
    try:
        yield TestHub(endpoint=server.url, olah_url=olah_url, mirrors=mirrors)
    finally:
        server.shutdown()
        server.server_close()
        stop(process)
