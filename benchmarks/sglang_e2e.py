"""End to end on a GPU: a session moves between two live SGLang servers, with and without sgl-kvmap.

    python benchmarks/sglang_e2e.py SMALL LARGE --pack PACK_SMALL_TO_LARGE [--pack ...] [--dry-run]

For each mode (``off``: HiCache with the same shared store but no packs; ``on``: sgl-kvmap
translating), it launches both servers (commands from ``sgl-kvmap sglang-args``), sends a long
shared-prefix conversation to SMALL, then the next turn to LARGE, and records LARGE's time to
first token (streamed), the prompt tokens it reports as cached, and its greedy answer. Writes
benchmarks/results/sglang_e2e.json: TTFT and prefill tokens computed per mode, and the
fraction of answer tokens on which the two modes agree. Needs a GPU and SGLang 0.5.23 with
its GPU dependencies; `--dry-run` prints the launch commands only.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import click

from sgl_kvmap.fitting.texts import default_eval_files
from sgl_kvmap.sglang.launch import EngineSpec, engine_commands, shell_line

RESULTS = Path(__file__).parent / "results"


@click.command()
@click.argument("small")
@click.argument("large")
@click.option("--pack", "packs", multiple=True, type=click.Path(exists=True, file_okay=False))
@click.option("--prefix-tokens", default=4096, show_default=True)
@click.option("--answer-tokens", default=32, show_default=True)
@click.option("--store-path", default="/dev/shm/sgl-kvmap-e2e", show_default=True)
@click.option("--dry-run", is_flag=True)
def main(small, large, packs, prefix_tokens, answer_tokens, store_path, dry_run) -> None:
    engines = [EngineSpec(small, port=30000), EngineSpec(large, port=30001)]
    results = {}
    for mode, mode_packs in (("off", []), ("on", list(packs))):
        commands = engine_commands(engines, mode_packs, store_path=f"{store_path}-{mode}")
        if dry_run:
            print("\n".join(shell_line(c) for c in commands))
            continue
        servers = [
            _launch(c, f"/tmp/sglang-{mode}-{e.port}.log") for c, e in zip(commands, engines)
        ]
        try:
            for engine in engines:
                _wait_healthy(engine.port)
            results[mode] = _session(engines, prefix_tokens, answer_tokens)
        finally:
            for server in servers:
                server.terminate()
                server.wait(timeout=60)
    if dry_run:
        return
    off, on = results["off"]["answer"], results["on"]["answer"]
    agree = sum(a == b for a, b in zip(off, on)) / max(len(off), 1)
    summary = {mode: {k: v for k, v in r.items() if k != "answer"} for mode, r in results.items()}
    summary["answer_token_agreement"] = agree
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sglang_e2e.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


def _launch(argv: list[str], log_path: str) -> subprocess.Popen:
    argv = [sys.executable, *argv[1:]]
    return subprocess.Popen(argv, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)


def _wait_healthy(port: int, timeout: float = 300) -> None:
    import requests

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).ok:
                return
        except requests.ConnectionError:
            pass
        time.sleep(2)
    raise TimeoutError(f"server on port {port} did not come up; see /tmp/sglang-*-{port}.log")


def _session(engines, prefix_tokens: int, answer_tokens: int) -> dict:
    """Turn 1 on the small engine, turn 2 (same history + a question) on the large one."""
    history = _history(prefix_tokens)
    _generate(engines[0].port, history, 1)
    time.sleep(2)  # let write-through reach the store
    question = history + "\n\n# Summarise what the code above does, in one sentence:\n"
    started = time.perf_counter()
    first, answer, meta = _generate(engines[1].port, question, answer_tokens, stream=True)
    return {
        "ttft_s": first - started,
        "prompt_tokens": meta.get("prompt_tokens"),
        "cached_tokens": meta.get("cached_tokens"),
        "prefill_tokens_computed": meta.get("prompt_tokens", 0) - meta.get("cached_tokens", 0),
        "answer": answer,
    }


def _history(tokens: int) -> str:
    text = ""
    for path in default_eval_files():
        text += path.read_text(errors="replace")
        if len(text) > 4 * tokens:
            break
    return text[: 4 * tokens]


def _generate(port: int, text: str, max_tokens: int, stream: bool = False):
    """(time of the first streamed chunk, output token ids, meta_info) from /generate."""
    import requests

    body = {
        "text": text,
        "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0},
        "stream": stream,
    }
    response = requests.post(f"http://127.0.0.1:{port}/generate", json=body, stream=stream)
    response.raise_for_status()
    if not stream:
        return None, None, response.json().get("meta_info", {})
    first, last = None, {}
    for line in response.iter_lines():
        if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
            continue
        first = first or time.perf_counter()
        last = json.loads(line[5:])
    return first, last.get("output_ids", []), last.get("meta_info", {})


if __name__ == "__main__":
    main()
