"""Live SGLang servers started from the command lines ``sgl-kvmap sglang-args`` prints (no sglang
import).

``sglang_args_lines`` runs ``sgl-kvmap sglang-args ...`` as a user does and returns the line it
printed for each engine; ``start_server`` runs one such line with ``bash -c`` in a session (a
process group) of its own, with the caller's extra environment variables, its output in a log
file, and waits until ``GET /health`` answers 200 (failing at once, with the end of the log,
if the process exits first); ``stop_server`` sends the group SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import os
import random
import shlex
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import KVMapError

HEALTH_TIMEOUT_S = 900.0  # a large model's server on a GPU can take minutes to load
STOP_GRACE_S = 90.0  # SIGTERM to SIGKILL


class ServerError(KVMapError):
    """A server could not be started, or ``sgl-kvmap sglang-args`` failed."""


@dataclass(frozen=True)
class LiveServer:
    """One running server: the shell line it runs, its port, its log, its process (the leader
    of its own process group)."""

    line: str
    port: int
    log_path: Path
    process: subprocess.Popen

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def sglang_args_lines(
    args: Sequence[str], program: str = "sgl-kvmap", env: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Run ``program sglang-args *args`` as a user does; the command line it printed for each
    engine, by the engine's served name."""
    argv = [program, "sglang-args", *args]
    result = subprocess.run(argv, capture_output=True, text=True, env=_environment(env))
    if result.returncode != 0:
        raise ServerError(
            f"{shlex.join(argv)} exited with {result.returncode}:\n{result.stderr.strip()}"
        )
    return engine_lines(result.stdout)


def engine_lines(output: str) -> dict[str, str]:
    """The command lines of ``sglang-args``' output by engine: each command line follows a
    ``# NAME`` comment line (earlier comment lines say what was measured)."""
    lines, name = {}, None
    for line in output.splitlines():
        if line.startswith("#"):
            name = line[1:].strip()
        elif line.strip():
            if name is None:
                raise ServerError(f"a command line without its '# NAME' line: {line[:80]}")
            lines[name], name = line, None
    return lines


def port_of(line: str) -> int:
    """The ``--port`` of a printed command line."""
    words = shlex.split(line)
    if "--port" not in words[:-1]:
        raise ServerError(f"no --port in {line[:120]}...")
    return int(words[words.index("--port") + 1])


def free_port_base(count: int = 1) -> int:
    """A port p with p .. p + count - 1 free on 127.0.0.1 now (``sglang-args --port p`` gives
    its engines p, p + 1, ...)."""
    for base in random.sample(range(20000, 40000, 16), 64):
        try:
            sockets = [socket.create_server(("127.0.0.1", base + i)) for i in range(count)]
        except OSError:
            continue
        for sock in sockets:
            sock.close()
        return base
    raise ServerError(f"no {count} consecutive free ports in 20000-40000")


def start_server(
    line: str,
    log_path: str | Path,
    env: Mapping[str, str] | None = None,
    timeout: float = HEALTH_TIMEOUT_S,
) -> LiveServer:
    """Run ``line`` with ``bash -c`` in its own session, ``env`` added to this process's
    environment, stdout and stderr to ``log_path``; return once it is healthy. A port something
    already listens on is refused first: its ``/health`` would pass for this server's."""
    port = port_of(line)
    if port_taken(port):
        raise ServerError(
            f"port {port} is already in use on 127.0.0.1 (another server?): stop it or choose "
            "other ports (--port)"
        )
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(
            ["bash", "-c", line],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=_environment(env),
        )
    server = LiveServer(line, port, log_path, process)
    try:
        wait_healthy(server, timeout)
    except BaseException:
        stop_server(server)
        raise
    return server


def wait_healthy(server: LiveServer, timeout: float = HEALTH_TIMEOUT_S, poll: float = 1.0) -> None:
    """Until ``GET /health`` answers 200; a server that exits first or is not healthy after
    ``timeout`` seconds raises ServerError with the end of its log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise ServerError(
                f"the server on port {server.port} exited with {server.process.returncode}; "
                f"the end of {server.log_path}:\n{log_tail(server.log_path)}"
            )
        if healthy(server.url):
            return
        time.sleep(poll)
    raise ServerError(
        f"no healthy server on port {server.port} after {timeout:.0f} s; the end of "
        f"{server.log_path}:\n{log_tail(server.log_path)}"
    )


def port_taken(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:``port`` now."""
    with socket.socket() as probe:
        probe.settimeout(2)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def healthy(url: str) -> bool:
    """Whether the server at base URL ``url`` answers ``GET /health`` with 200 now."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def stop_server(server: LiveServer, grace: float = STOP_GRACE_S) -> None:
    stop_servers([server], grace)


def stop_servers(servers: Sequence[LiveServer], grace: float = STOP_GRACE_S) -> None:
    """SIGTERM to every server's process group (the server and its scheduler and detokenizer
    processes) at once, then SIGKILL to the groups still there after ``grace`` seconds."""
    running = [s for s in servers if s.process.poll() is None]
    for server in running:
        _signal_group(server, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for server in running:
        try:
            server.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(server, signal.SIGKILL)
            server.process.wait()
    for server in servers:  # children the leader left behind
        _signal_group(server, signal.SIGKILL)


def _signal_group(server: LiveServer, signum: int) -> None:
    try:
        os.killpg(server.process.pid, signum)
    except ProcessLookupError:
        pass


@contextmanager
def running_servers(
    lines: Sequence[str], logs: Sequence[str | Path], env: Mapping[str, str] | None = None
) -> Iterator[list[LiveServer]]:
    """Start each line's server after the previous one is healthy (so each sees the memory the
    others took); stop them all on exit."""
    servers: list[LiveServer] = []
    try:
        for line, log_path in zip(lines, logs):
            servers.append(start_server(line, log_path, env))
        yield servers
    finally:
        stop_servers(servers)


def log_tail(path: str | Path, lines: int = 30) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError as error:
        return f"(no log: {error})"


def _environment(extra: Mapping[str, str] | None) -> dict[str, str]:
    return {**os.environ, **(extra or {})}
