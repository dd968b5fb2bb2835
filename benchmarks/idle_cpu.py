"""How much CPU an idle live SGLang server uses, by process and thread, with and without
sgl-kvmap and SGLang's ``--sleep-on-idle``.

Starts the 1.5B of the default pair, one server at a time, from the line ``sgl-kvmap sglang-args
--device cpu`` prints for it (KVMapStorage translating from the 0.5B with PACK_UP), then the same
line without ``--sleep-on-idle``, with SGLang's own ``file`` store instead of KVMapStorage, and
without HiCache; for each, after it is healthy and has settled, samples every thread of its
process group over ``--seconds`` and prints the share of one core each used (threads under
0.5% left out).

python benchmarks/idle_cpu.py PACK_UP PACK_DOWN [--seconds 30]
"""

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from sgl_kvmap.fitting.default_pair import LARGE, SMALL, ensure_model
from sgl_kvmap.sglang.servers import engine_lines, free_port_base, start_server, stop_servers

HICACHE_FLAGS = (  # flag -> how many values follow it
    ("--hicache-storage-backend-extra-config", 1),
    ("--hicache-storage-backend", 1),
    ("--hicache-mem-layout", 1),
    ("--hicache-write-policy", 1),
    ("--hicache-ratio", 1),
    ("--hicache-storage-prefetch-policy", 1),
    ("--hicache-io-backend", 1),
    ("--enable-hierarchical-cache", 0),
)


def variants(line: str) -> dict[str, str]:
    words = shlex.split(line)
    spinning = [w for w in words if w != "--sleep-on-idle"]
    own_store = _without(spinning, [("--hicache-storage-backend-extra-config", 1)])
    own_store[own_store.index("--hicache-storage-backend") + 1] = "file"
    return {
        "sgl-kvmap, --sleep-on-idle (printed)": line,
        "sgl-kvmap": shlex.join(spinning),
        "SGLang's file store": shlex.join(own_store),
        "no HiCache": shlex.join(_without(spinning, HICACHE_FLAGS)),
    }


def _without(words: list[str], flags) -> list[str]:
    words = list(words)
    for flag, values in flags:
        if flag in words:
            at = words.index(flag)
            del words[at : at + 1 + values]
    return words


def thread_seconds(group: int) -> dict[tuple[str, str], tuple[str, float]]:
    """CPU seconds of every thread of process group ``group``: (pid, tid) -> (name, seconds)."""
    tick, rows = os.sysconf("SC_CLK_TCK"), {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2]) != group:
                continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
                name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
                rows[pid, tid] = (name, (int(fields[11]) + int(fields[12])) / tick)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pack_up")
    parser.add_argument("pack_down")
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    small, large = ensure_model(SMALL), ensure_model(LARGE)
    printed = subprocess.run(
        ["sgl-kvmap", "sglang-args", "--device", "cpu", "--quality-floor", "none"]
        + ["--engine", f"{small}=small", "--engine", f"{large}=large"]
        + ["--pack", args.pack_up, "--pack", args.pack_down, "--max-total-tokens", "8192"]
        + ["--store-path", "/tmp/kvmap-idle-store", "--port", str(free_port_base(2))],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    env = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    for name, line in variants(engine_lines(printed)["large"]).items():
        server = start_server(line, Path("/tmp") / "kvmap-idle.log", env, 600)
        try:
            time.sleep(10)
            before = thread_seconds(server.process.pid)
            time.sleep(args.seconds)
            after = thread_seconds(server.process.pid)
        finally:
            stop_servers([server], grace=20)
        used = {k: (n, s - before.get(k, (n, s))[1]) for k, (n, s) in after.items()}
        total = sum(s for _, s in used.values()) / args.seconds
        print(f"{name}: {total:.3f} of a core")
        for (pid, _), (thread, seconds) in sorted(used.items(), key=lambda kv: -kv[1][1]):
            if seconds / args.seconds >= 0.005:
                print(f"    pid {pid} thread {thread}: {seconds / args.seconds:.3f}")


if __name__ == "__main__":
    main()
