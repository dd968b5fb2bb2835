"""A real Mooncake deployment on 127.0.0.1 for tests: ``mooncake_master`` (with its HTTP metadata
server) on free ports, and engines as separate OS processes, each with its own Mooncake client, as
on separate hosts.

``Master`` starts, kills and restarts the master (the binary and the client's libraries that
scripts/setup_mooncake.sh installs; ``skip_reason`` says why they cannot run here).
``EngineProcess`` runs ``python -m tests.mooncake_servers`` (the ``main`` below): it loads a model
folder and builds sgl_kvmap.sglang.engine.Engine (SGLang's radix tree, cache controller, storage
threads and KVMapStorage, driven through the scheduler's calls) and serves one request per
command it reads on stdin; it answers each on stdout with the request's reuse by tier, the
storage counters and, on request, the KV its device pool holds for the prompt (a safetensors file).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from sgl_kvmap.sglang.mooncake import LIBRARIES, LIBS_ENV, libraries_folder

ROOT = Path(__file__).resolve().parents[1]
ANSWER = "KVMAP-ANSWER "
START_SECONDS = 30
SEGMENT = 64 << 20  # each engine's share of the store (bytes)


def skip_reason() -> str | None:
    """Why a Mooncake master and client cannot run here (None: they can)."""
    if shutil.which("mooncake_master") is None:
        return "mooncake_master is not installed (bash scripts/setup_mooncake.sh)"
    missing = [n for n in LIBRARIES if not (libraries_folder() / n).exists()]
    if missing and not _loads_without_folder():
        return f"Mooncake's libraries {missing} are not in {libraries_folder()} (setup_mooncake.sh)"
    return None


def _loads_without_folder() -> bool:
    probe = [sys.executable, "-c", "import mooncake.store"]
    return subprocess.run(probe, capture_output=True).returncode == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def library_env() -> dict:
    folder = str(libraries_folder())
    paths = [folder, os.environ.get("LD_LIBRARY_PATH", "")]
    return {**os.environ, LIBS_ENV: folder, "LD_LIBRARY_PATH": ":".join(p for p in paths if p)}


class Master:
    """``mooncake_master`` on 127.0.0.1 (RPC ``port``, HTTP metadata ``metadata_port``); options:
    extra flags (e.g. ``--default_kv_lease_ttl``). Its log goes to ``log``."""

    def __init__(self, log: Path, *options: str):
        self.port, self.metadata_port, self.log = free_port(), free_port(), log
        self.options, self.process = options, None
        self.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    def extra(self, segment: int = SEGMENT) -> dict:
        """SGLang's Mooncake keys of the extra config for an engine of this master."""
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
            self.process = subprocess.Popen(
                command, env=library_env(), stdout=log, stderr=subprocess.STDOUT
            )
        _wait_for_port(self.port, self.process, self.log)
        _wait_for_port(self.metadata_port, self.process, self.log)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def restart(self) -> None:
        self.kill()
        self.start()


def _wait_for_port(port: int, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"mooncake_master exited: {log.read_text()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"mooncake_master did not listen on {port} in {START_SECONDS} s")


class EngineProcess:
    """One engine in a process of its own (see the module docstring). ``spec``: model_path,
    name, extra (the storage extra config), engine (Engine keyword arguments)."""

    def __init__(self, spec: dict, log: Path):
        self.log = open(log, "w")
        command = [sys.executable, "-m", "tests.mooncake_servers", json.dumps(spec)]
        self.process = subprocess.Popen(
            command,
            cwd=ROOT,
            env=library_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self.started = self._answer(timeout=120)

    def serve(self, tokens: list[int], kv_file: Path | None = None, timeout=120) -> dict:
        """Serve ``tokens``; the answer: reused, tiers, counters, seconds (from its arrival to its
        admission: the prefetch done or cut) and the pool's KV of the prompt in ``kv_file``."""
        command = {"serve": tokens, "kv": str(kv_file) if kv_file else None}
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self._answer(timeout)

    def _answer(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line:
                raise RuntimeError(f"engine process ended: see {self.log.name}")
            if line.startswith(ANSWER):
                answer = json.loads(line[len(ANSWER) :])
                if "error" in answer:
                    raise RuntimeError(answer["error"])
                return answer
        raise TimeoutError(f"no answer in {timeout} s")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def main() -> None:
    """The engine process: build the engine, then serve one request per stdin line."""
    import dataclasses

    import torch
    from safetensors.torch import save_file

    from sgl_kvmap.models.capture import load_model
    from sgl_kvmap.sglang.engine import Engine

    torch.set_num_threads(1)
    spec = json.loads(sys.argv[1])
    try:
        engine = Engine(
            load_model(spec["model_path"]), spec["name"], spec["extra"], **spec["engine"]
        )
    except Exception as error:  # noqa: BLE001 - the parent reads the message
        return _reply({"error": f"{type(error).__name__}: {error}"})
    _reply({"counters": dict(engine.storage.counters)})
    for line in sys.stdin:
        command = json.loads(line)
        started = time.monotonic()
        arrival = engine.arrive(command["serve"])
        req, slots = engine.admit(arrival)  # the prefetch done or cut: the request may run
        seconds = time.monotonic() - started
        served = _complete(engine, arrival, req, slots)
        if command["kv"]:
            kv = engine.pool_kv(served.slots)
            tensors = {f"k{i}": k for i, k in enumerate(kv.keys)}
            tensors |= {f"v{i}": v for i, v in enumerate(kv.values)}
            save_file({n: t.contiguous() for n, t in tensors.items()}, command["kv"])
        _reply(
            {
                "reused": served.reused,
                "tiers": dataclasses.asdict(served.tiers),
                "counters": dict(engine.storage.counters),
                "seconds": seconds,
            }
        )
    engine.close()


def _complete(engine, arrival, req, slots):
    """The rest of ``Engine.complete`` after admission."""
    from sgl_kvmap.sglang.engine import Served

    past = engine.pool_kv(slots[: req.prefix_len]) if req.prefix_len else None
    logits = engine.compute(arrival.tokens, slots, req.prefix_len, past)
    engine.finish(req, logits)
    return Served(req.prefix_len, slots, logits, engine.last_tiers)


def _reply(answer: dict) -> None:
    print(ANSWER + json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
