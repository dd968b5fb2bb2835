"""A real Mooncake deployment on 127.0.0.1 for tests: ``mooncake_master`` (with its HTTP metadata
server) on free ports, and engines as separate OS processes, each with its own Mooncake client, as
on separate hosts.

The master is sgl_kvmap.sglang.mooncake_master's ``Master`` (the one ``sgl-kvmap bench --store
mooncake`` starts). ``EngineProcess`` runs ``python -m tests.mooncake_servers`` (the ``main``
below): it loads a model folder and builds sgl_kvmap.sglang.engine.Engine (SGLang's radix tree,
cache controller, storage threads and KVMapStorage, driven through the scheduler's calls) and
serves one request per command it reads on stdin; it answers each on stdout with the request's
reuse by tier, the storage counters and, on request, the KV its device pool holds for the prompt
(a safetensors file). A spec's ``read_pause`` (seconds) has every translation job read its peer's
pages that long after the hit query that started it, as a slow transfer would, announced on
stdout (``EngineProcess.paused``).
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

from sgl_kvmap.sglang.mooncake_master import library_env

ROOT = Path(__file__).resolve().parents[1]
ANSWER = "KVMAP-ANSWER "
PAUSED = "KVMAP-PAUSED "
SEGMENT = 64 << 20  # each engine's share of the store (bytes)


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
        # its stdout lines, read on a thread of their own so that a wait for an answer ends at
        # its timeout even when the process never writes one (None: the process ended)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read_lines, daemon=True).start()
        self.started = self._answer(timeout=120)

    def _read_lines(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def serve(self, tokens: list[int], kv_file: Path | None = None, timeout=120) -> dict:
        """Serve ``tokens``; the answer: reused, tiers, counters, seconds (from its arrival to its
        admission: the prefetch done or cut) and the pool's KV of the prompt in ``kv_file``."""
        self.send(tokens, kv_file)
        return self._answer(timeout)

    def send(self, tokens: list[int], kv_file: Path | None = None) -> None:
        """Start serving ``tokens`` (``answer`` waits for its answer)."""
        command = {"serve": tokens, "kv": str(kv_file) if kv_file else None}
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def answer(self, timeout=120) -> dict:
        return self._answer(timeout)

    def paused(self, timeout=60) -> None:
        """Wait until a translation job of an engine with ``read_pause`` starts its pause (its
        hit query is done: the records read, the pages asked for)."""
        self._answer(timeout, PAUSED)

    def _answer(self, timeout: float, prefix: str = ANSWER) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                raise RuntimeError(f"engine process ended: see {self.log.name}")
            if line.startswith(prefix):
                answer = json.loads(line[len(prefix) :])
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
    if spec.get("read_pause"):
        _pause_page_reads(engine, spec["read_pause"])
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


def _pause_page_reads(engine, seconds: float) -> None:
    """Each translation job reads its peer's pages ``seconds`` after the hit query that started
    it (a slow transfer), saying so on stdout when its pause begins."""
    for peer in engine.storage.peers:
        read = peer.tokens

        def tokens(*args, read=read):
            print(PAUSED + "{}", flush=True)
            time.sleep(seconds)
            return read(*args)

        peer.tokens = tokens


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
