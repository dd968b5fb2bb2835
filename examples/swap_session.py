"""One session that moves between two SGLang servers sgl-kvmap connects: its first turn is served
by the first server, its next turn by the second, which translates the history the first stored
instead of prefilling it. Prints what each server reports for its turn.

    python examples/swap_session.py http://127.0.0.1:30000 http://127.0.0.1:30001

Plain HTTP against SGLang's native ``/generate`` endpoint (standard library only):
``meta_info.cached_tokens_details`` is SGLang's own split of the prompt's cached tokens (device,
host, storage) and ``meta_info.kvmap`` is sgl-kvmap's report of the request (translated and
primed tokens, status).
"""

from __future__ import annotations

import inspect
import json
import sys
import time
import urllib.request
from http import server

STORE_WAIT_S = 5.0  # the first server writes the session's pages behind its answer


def generate(url: str, text: str, max_new_tokens: int = 16) -> dict:
    """A greedy ``/generate`` call; the server's response (``text``, ``meta_info``)."""
    body = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}}
    request = urllib.request.Request(
        f"{url}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.load(response)


def report(turn: str, url: str, response: dict) -> None:
    meta = response["meta_info"]
    cached = meta.get("cached_tokens_details") or {}
    tiers = {tier: cached.get(tier, 0) for tier in ("device", "host", "storage")}
    print(f"{turn} on {url}: {meta['prompt_tokens']} prompt tokens, cached {tiers}")
    print(f"  sgl-kvmap: {meta.get('kvmap')}")


def main(first: str, second: str) -> None:
    # a session's history: a long document (here: the source of Python's http.server), each
    # turn ending with a line break so the next turn's tokens extend this turn's
    history = inspect.getsource(server)[:6000].rsplit("\n", 1)[0] + "\n"
    question = "Summarise what the code above does.\n"
    answer = generate(first, history + question)
    report("turn 1", first, answer)
    time.sleep(STORE_WAIT_S)
    follow_up = history + question + answer["text"] + "\nWhich class handles a GET request?\n"
    report("turn 2 (swapped)", second, generate(second, follow_up))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(f"usage: python {sys.argv[0]} FIRST_SERVER_URL SECOND_SERVER_URL")
    main(*sys.argv[1:])
