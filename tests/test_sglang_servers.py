"""The live-server launcher (sgl_kvmap/sglang/servers.py) against stand-in servers.

A stand-in server is a shell line like the ones ``sgl-kvmap sglang-args`` prints, ending in
``--port N``: a small Python HTTP server that answers ``GET /health`` with 200 after a set
delay, writes the environment variable ``MARK`` to its output, and starts a child process in
its process group (as SGLang's scheduler and detokenizer are). The real servers are in
tests/test_sglang_live.py.
"""

from __future__ import annotations

import os
import shlex
import sys
import time

import pytest

from sgl_kvmap.sglang.servers import (
    ServerError,
    engine_lines,
    free_port_base,
    port_of,
    running_servers,
    sglang_args_lines,
    start_server,
    stop_server,
)

STAND_IN = """
import http.server, os, subprocess, sys, time
port, delay = int(sys.argv[sys.argv.index("--port") + 1]), float(sys.argv[1])
child = subprocess.Popen(["sleep", "300"])
print("child", child.pid, "mark", os.environ.get("MARK"), flush=True)
started = time.monotonic()

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ready = self.path == "/health" and time.monotonic() - started > delay
        self.send_response(200 if ready else 503)
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""

OUTPUT = """# hand-over by /packs/ab on this machine (cpu, 1 thread): 1,024 tokens 0.01 s
# prefetch deadline: 1 s + 0.25 s per 1K tokens (1.5 s at 2,048 tokens, 3.0 s at 8,192)
# small
SGLANG_USE_CPU_ENGINE=1 python -m sglang.launch_server --model-path /m/s --port 30000
# /models/large
python -m sglang.launch_server --model-path /models/large --port 30001
"""


@pytest.fixture
def stand_in(tmp_path):
    script = tmp_path / "server.py"
    script.write_text(STAND_IN)

    def line(delay: float = 0.5, port: int | None = None) -> str:
        port = port or free_port_base(1)
        return f"{shlex.quote(sys.executable)} {script} {delay} --model-path /m --port {port}"

    return line


def child_of(log_path) -> int:
    """The child process the stand-in started (its pid, from its log)."""
    for _ in range(50):
        words = log_path.read_text().split()
        if "child" in words:
            return int(words[words.index("child") + 1])
        time.sleep(0.1)
    raise AssertionError(f"no child in {log_path.read_text()!r}")


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as stat:  # a zombie has ended too
        return stat.read().split(")")[-1].split()[0] == "Z"


def test_the_printed_lines_are_read_by_engine_name():
    assert engine_lines(OUTPUT) == {
        "small": "SGLANG_USE_CPU_ENGINE=1 python -m sglang.launch_server --model-path /m/s "
        "--port 30000",
        "/models/large": "python -m sglang.launch_server --model-path /models/large --port 30001",
    }
    assert port_of(engine_lines(OUTPUT)["small"]) == 30000
    with pytest.raises(ServerError, match="without its '# NAME' line"):
        engine_lines("python -m sglang.launch_server --port 1\n")
    with pytest.raises(ServerError, match="no --port"):
        port_of("python -m sglang.launch_server")


def test_sglang_args_is_run_as_a_program(tmp_path):
    """The program's output is parsed; a failing program's stderr is in the error."""
    program = tmp_path / "sgl-kvmap"
    program.write_text(
        f"#!{sys.executable}\nimport sys\n"
        "if sys.argv[1:3] != ['sglang-args', '--engine']:\n"
        "    sys.exit(print('Error: No such option', file=sys.stderr) or 2)\n"
        f"print({OUTPUT!r}, end='')\n"
    )
    program.chmod(0o755)
    assert sglang_args_lines(["--engine", "x"], program=str(program)) == engine_lines(OUTPUT)
    with pytest.raises(ServerError, match="exited with 2:\nError: No such option"):
        sglang_args_lines(["--device", "cpu"], program=str(program))


def test_a_server_is_started_healthy_with_its_environment_and_stopped_whole(stand_in, tmp_path):
    """start_server returns once /health answers 200 (not before: the stand-in answers 503 for
    its first second); the caller's variables reach it; stop_server ends its process group,
    the child too."""
    log = tmp_path / "logs" / "server.log"
    started = time.monotonic()
    server = start_server(stand_in(delay=1.0), log, env={"MARK": "cpu-test"}, timeout=30)
    assert time.monotonic() - started >= 1.0
    child = child_of(log)
    assert "mark cpu-test" in log.read_text() and server.process.poll() is None
    stop_server(server, grace=10)
    assert server.process.poll() is not None and gone(child)


def test_a_server_that_exits_fails_at_once_with_its_log(tmp_path):
    started = time.monotonic()
    with pytest.raises(ServerError, match=r"(?s)port 1 exited with 3; the end of .*boom"):
        start_server("echo boom; exit 3 # --port 1", tmp_path / "exit.log", timeout=60)
    assert time.monotonic() - started < 30


def test_a_server_never_healthy_times_out_and_is_stopped(stand_in, tmp_path):
    log = tmp_path / "slow.log"
    with pytest.raises(ServerError, match="no healthy server on port .* after 2 s"):
        start_server(stand_in(delay=600), log, timeout=2)
    assert gone(child_of(log))


def test_running_servers_start_in_turn_and_all_stop(stand_in, tmp_path):
    logs, base = [tmp_path / "a.log", tmp_path / "b.log"], free_port_base(2)
    with running_servers([stand_in(port=base), stand_in(port=base + 1)], logs) as servers:
        assert all(s.process.poll() is None for s in servers)
        children = [child_of(log) for log in logs]
    assert all(s.process.poll() is not None for s in servers)
    assert all(gone(child) for child in children)


def test_a_port_another_server_answers_on_is_refused_not_benchmarked(stand_in, tmp_path):
    """Before: a server already answering /health on the port (a stranger's SGLang on 30000)
    passed for the one being started, and the caller drove it. Now the start is refused at
    once, the stranger is left alone and the line is never run."""
    port = free_port_base(1)
    stranger = start_server(stand_in(delay=0, port=port), tmp_path / "stranger.log", timeout=30)
    try:
        marker = tmp_path / "ran"
        with pytest.raises(ServerError, match=f"port {port} is already in use"):
            start_server(f"touch {marker} # --port {port}", tmp_path / "mine.log", timeout=30)
        assert not marker.exists() and stranger.process.poll() is None
    finally:
        stop_server(stranger, grace=10)
