"""A local Mooncake store: ``mooncake_master`` with its HTTP metadata server on free ports of
127.0.0.1, started as a child process (a fresh, empty store for each replay of ``sgl-kvmap bench
--store mooncake``, and the tests' deployments). The binary and the client's libraries are those
scripts/setup_mooncake.sh installs; ``unavailable`` says why they cannot run here.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from ..core.errors import KVMapError
from .mooncake import INSTALL, LIBRARIES, LIBS_ENV, libraries_folder

START_SECONDS = 30  # a master that does not listen by then is refused


def unavailable() -> str | None:
    """Why a Mooncake master and client cannot run here (None: they can)."""
    if shutil.which("mooncake_master") is None:
        return f"mooncake_master is not installed ({INSTALL})"
    missing = [n for n in LIBRARIES if not (libraries_folder() / n).exists()]
    if missing and not _loads_without_folder():
        return f"Mooncake's libraries {missing} are not in {libraries_folder()} ({INSTALL})"
    return None


def _loads_without_folder() -> bool:
    probe = [sys.executable, "-c", "import mooncake.store"]
    return subprocess.run(probe, capture_output=True).returncode == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def library_env() -> dict:
    """This process's environment with Mooncake's libraries on the loader's path (for the
    master, and for processes that run a client)."""
    folder = str(libraries_folder())
    paths = [folder, os.environ.get("LD_LIBRARY_PATH", "")]
    return {**os.environ, LIBS_ENV: folder, "LD_LIBRARY_PATH": ":".join(p for p in paths if p)}


class Master:
    """``mooncake_master`` on 127.0.0.1 (RPC ``port``, HTTP metadata ``metadata_port``), started
    at once; options: extra flags (e.g. ``--default_kv_lease_ttl=100``). Its log goes to ``log``.
    A context manager: leaving it kills the master."""

    def __init__(self, log: Path, *options: str):
        self.port, self.metadata_port, self.log = free_port(), free_port(), Path(log)
        self.options, self.process = options, None
        self.start()

    def __enter__(self) -> Master:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    def extra(self, segment: int) -> dict:
        """SGLang's Mooncake keys of the extra config for an engine of this master, mounting
        ``segment`` bytes of the store."""
        return {
            "master_server_address": self.address,
            "metadata_server": self.metadata,
            "global_segment_size": segment,
            "protocol": "tcp",
            "local_hostname": "127.0.0.1",
        }

    def start(self) -> None:
        command = [
            "mooncake_master",
            f"--rpc_port={self.port}",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.metadata_port}",
            *self.options,
        ]
        with open(self.log, "a") as log:
            try:
                self.process = subprocess.Popen(
                    command, env=library_env(), stdout=log, stderr=subprocess.STDOUT
                )
            except OSError as error:
                raise KVMapError(f"cannot start mooncake_master ({INSTALL}): {error}") from None
        try:
            _wait_for_port(self.port, self.process, self.log)
            _wait_for_port(self.metadata_port, self.process, self.log)
        except KVMapError:
            self.kill()
            raise

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
        if self.process is not None:
            self.process.wait()

    def restart(self) -> None:
        self.kill()
        self.start()


def _wait_for_port(port: int, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise KVMapError(f"mooncake_master exited: {_last_line(log)} (its log: {log})")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise KVMapError(f"mooncake_master did not listen on {port} in {START_SECONDS} s (log: {log})")


def _last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no output"
