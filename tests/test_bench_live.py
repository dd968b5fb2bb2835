"""The live replay (sgl_kvmap/bench/live.py) and its client (sgl_kvmap/sglang/client.py)
against stand-in SGLang servers.

Each stand-in is a stdlib ``http.server`` on 127.0.0.1, in a thread, that answers ``/generate``
as SGLang 0.5.23's native endpoint does: with ``"stream": true``, ``data: {json}\\n\\n`` events
then ``data: [DONE]`` (``entrypoints/http_server.py:951-975``), each event
``{"text", "output_ids" (cumulative, the default), "meta_info"}``
(``managers/tokenizer_manager.py:2626-2660``), the meta_info keys of
``tokenizer_manager.py:2506-2576`` (``id``, ``finish_reason`` as ``{"type": "length", "length":
n}``, ``prompt_tokens``, ``weight_version``, ``num_retractions``, ``reasoning_tokens``,
``completion_tokens``, ``cached_tokens``, ``cached_tokens_details`` ``{"device", "host",
"storage", "storage_backend"}`` as ``output_streamer.py:102-132`` builds it, absent when
nothing was cached), and an error as a streamed ``{"error": {...}}`` event with HTTP 200.
With ``return_logprob``, ``meta_info.input_token_logprobs`` is ``[logprob, token_id, null]``
for every input token from ``logprob_start_len``, the first with a null logprob
(``scheduler_components/logprob_result_processor.py:37-50``, ``tokenizer_manager.py:3098-3108``).

Substituted: the model (answers and logprobs are fixed functions of the token ids), the cache
(the stand-in matches a prompt against the prompts it served and, as "storage", those every
stand-in served, in whole pages, never the last prompt token) and the timing (a set delay
before the first event and between events).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sgl_kvmap.bench.live import replay
from sgl_kvmap.bench.records import agreement
from sgl_kvmap.core.errors import KVMapError
from sgl_kvmap.sglang.client import LiveClient, LiveServerError

PAGE = 4


@dataclass(frozen=True)
class Turn:  # the fields of sgl_kvmap.bench.workload.Turn the client reads
    request: int
    session: int
    turn: int
    arrival_s: float
    tokens: tuple[int, ...]
    new_tokens: int
    output_tokens: int
    text: str | None = None


def answer_of(prompt, n, wrong_from=None):
    """The stand-in model's greedy answer; from ``wrong_from`` on every token is off by one."""
    base = [(sum(prompt) + 3 * k) % 97 for k in range(n)]
    return [t + 1 if wrong_from is not None and k >= wrong_from else t for k, t in enumerate(base)]


def logprob_of(token, position, offset=0.0):
    return -((token + position) % 5 + 1) / 4 - offset


def lcp(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@dataclass
class Behaviour:
    """What one stand-in does (changed by a test between replays)."""

    first_delay: float = 0.0
    chunk_delay: float = 0.0
    wrong_from: int | None = None  # a degraded cache: answers differ from this token on
    nll_offset: float = 0.0  # and every logprob is lower by this
    status: int = 200  # anything else: answer with this status
    stream_error: str | None = None  # stream this error event instead of an answer
    omit_prompt_tokens: bool = False  # meta_info without prompt_tokens
    received: list = field(default_factory=list)  # input_ids of every /generate
    history: list = field(default_factory=list)  # prompts this server served


STORE: list = []  # prompts every stand-in served: the shared "storage" tier


def cached(prompt, behaviour):
    limit = len(prompt) - 1
    own = max((lcp(prompt, p) for p in behaviour.history), default=0)
    shared = max((lcp(prompt, p) for p in STORE), default=0)
    device = min(own, limit) // PAGE * PAGE
    storage = max(min(shared, limit) // PAGE * PAGE - device, 0)
    return device, storage


def make_handler(behaviour: Behaviour):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            behaviour.received.append(body["input_ids"])
            if behaviour.status != 200:
                return self._send(behaviour.status, b'{"error": "Internal Server Error"}')
            if body.get("return_logprob"):
                return self._send(200, json.dumps(self._logprobs(body)).encode())
            self._stream(body)

        def _logprobs(self, body):
            ids, start = body["input_ids"], body["logprob_start_len"]
            entries = [[logprob_of(t, p, behaviour.nll_offset), t, None] for p, t in enumerate(ids)]
            entries = entries[start:]
            entries[0][0] = None
            meta = self._meta(len(ids), 1, 0, 0) | {"input_token_logprobs": entries}
            return {"text": "x", "output_ids": [7], "meta_info": meta}

        def _stream(self, body):
            prompt, n = body["input_ids"], body["sampling_params"]["max_new_tokens"]
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            if behaviour.stream_error:
                error = {"message": behaviour.stream_error, "code": 400, "retryable": False}
                return self._events([{"error": {"type": "invalid_request_error", **error}}])
            device, storage = cached(prompt, behaviour)
            answer = answer_of(prompt, n, behaviour.wrong_from)
            behaviour.history.append(prompt)
            STORE.append(prompt)
            time.sleep(behaviour.first_delay)
            for k in range(1, n + 1):
                finished = k == n
                meta = self._meta(len(prompt), k, device, storage, finished)
                self._events([{"text": "x" * k, "output_ids": answer[:k], "meta_info": meta}])
                if not finished:
                    time.sleep(behaviour.chunk_delay)
            self.wfile.write(b"data: [DONE]\n\n")

        def _events(self, payloads):
            for payload in payloads:
                self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
                self.wfile.flush()

        def _meta(self, prompt, k, device, storage, finished=True):
            meta = {
                "id": "0f3c",
                "finish_reason": {"type": "length", "length": k} if finished else None,
                "prompt_tokens": prompt,
                "weight_version": "default",
                "num_retractions": 0,
                "reasoning_tokens": 0,
                "completion_tokens": k,
                "cached_tokens": device + storage,
            }
            if device or storage:
                meta["cached_tokens_details"] = {
                    "device": device,
                    "host": 0,
                    "storage": storage,
                    "storage_backend": "KVMapStorage",
                }
            if finished:
                meta["e2e_latency"] = 0.01
            if behaviour.omit_prompt_tokens:
                del meta["prompt_tokens"]
            return meta

        def _send(self, status, data):
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


@pytest.fixture
def servers():
    """Two stand-ins, "small" and "large": (their behaviours, their URLs)."""
    STORE.clear()
    behaviours, urls, running = {}, {}, []
    for model in ("small", "large"):
        behaviours[model] = Behaviour()
        server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(behaviours[model]))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        urls[model] = f"http://127.0.0.1:{server.server_address[1]}"
        running.append(server)
    yield behaviours, urls
    for server in running:
        server.shutdown()
        server.server_close()


def trace():
    """Session 0 moves small -> large -> large; session 1 stays on small."""
    turns = [
        Turn(0, 0, 0, 0.0, tuple(range(10)), 10, 4),
        Turn(1, 0, 1, 1.0, tuple(range(18)), 8, 4),
        Turn(2, 0, 2, 2.0, tuple(range(26)), 8, 4),
        Turn(3, 1, 0, 3.0, tuple(range(100, 106)), 6, 4),
    ]
    return turns, ["small", "large", "large", "small"], [False, True, False, False]


def run(urls, mode, references=None, quality_tokens=4):
    turns, models, swapped = trace()
    with LiveClient(urls, timeout=10) as client:
        return replay(
            turns,
            models,
            swapped,
            [0, 16, 16, 0],
            policy="alternate",
            mode=mode,
            client=client,
            references=references,
            quality_tokens=quality_tokens,
        )


def test_tiers_from_sglang_details_and_routing(servers):
    behaviours, urls = servers
    reprefill = run(urls, "reprefill")
    # each request went to the server its routing chose, as token ids
    assert behaviours["small"].received[0] == list(range(10))
    assert behaviours["small"].received[1] == list(range(100, 106))
    assert [len(ids) for ids in behaviours["large"].received[:2]] == [18, 18 + 4]  # + NLL call
    assert behaviours["large"].received[2] == list(range(26))
    by_request = {r.request: r for r in reprefill.records}
    assert [r.model for r in reprefill.records] == ["small", "large", "large", "small"]
    # swapped request: 8 tokens from the shared store are native storage in re-prefill mode
    assert by_request[1].reused == {"device": 0, "host": 0, "storage": 8, "translated": 0}
    assert by_request[2].reused == {"device": 16, "host": 0, "storage": 0, "translated": 0}
    for record in reprefill.records:
        assert sum(record.reused.values()) + record.computed == record.prompt_tokens
        assert record.quality is None and record.fallbacks == {}
    assert by_request[1].computed == 10 and by_request[0].computed == 10

    STORE.clear()
    for b in behaviours.values():
        b.history.clear()
    translated = run(urls, "translated", reprefill.answers)
    swapped = translated.records[1]
    assert swapped.reused == {"device": 0, "host": 0, "storage": 0, "translated": 8}
    assert translated.records[2].reused["translated"] == 0  # not swapped: native only
    assert json.loads(json.dumps(swapped.to_json()))["reused"]["translated"] == 8


def test_ttft_is_the_first_streamed_token(servers):
    behaviours, urls = servers
    behaviours["small"].first_delay, behaviours["small"].chunk_delay = 0.2, 0.3
    with LiveClient(urls, timeout=10) as client:
        started = time.perf_counter()
        generation = client.generate("small", list(range(10)), 4)
        total = time.perf_counter() - started
    assert 0.2 <= generation.ttft_s < 0.2 + 0.6  # three more events follow, 0.3 s apart
    assert total >= 0.2 + 3 * 0.3
    assert list(generation.output_ids) == answer_of(range(10), 4)
    assert generation.cached == {"device": 0, "host": 0, "storage": 0}


def test_quality_from_logprobs_and_agreement(servers):
    behaviours, urls = servers
    reprefill = run(urls, "reprefill")
    reference = reprefill.answers[1]
    prompt = tuple(range(18))
    assert list(reference.answer) == answer_of(prompt, 4)
    expected_reference_nll = -sum(logprob_of(t, 18 + k) for k, t in enumerate(reference.answer)) / 4
    assert reference.nll == pytest.approx(expected_reference_nll)
    assert reprefill.answers[0].nll is None  # not swapped: no teacher forcing

    STORE.clear()
    for b in behaviours.values():
        b.history.clear()
    behaviours["large"].wrong_from, behaviours["large"].nll_offset = 1, 0.5
    tail = run(urls, "tail", reprefill.answers)
    quality = tail.records[1].quality
    assert quality.tokens == 4
    assert quality.agreement == pytest.approx(1 / 4)
    assert quality.nll == pytest.approx(expected_reference_nll + 0.5)
    assert quality.reference_nll == pytest.approx(expected_reference_nll)
    # the teacher-forced request (before request 2): prompt + re-prefill's answer
    assert behaviours["large"].received[-2] == [*prompt, *reference.answer]
    assert all(r.quality is None for r in tail.records if not r.swapped)


def test_agreement_is_the_common_prefix_and_counts_missing_tokens_as_different():
    assert agreement([1, 2, 3], [1, 2, 3, 4], 4) == 0.75
    assert agreement([1, 9, 3, 4, 5], [1, 2, 3, 4], 2) == 0.5
    assert agreement([1, 9, 3, 4], [1, 2, 3, 4], 4) == 0.25  # nothing after the departure counts
    assert agreement([], [], 8) == 1.0


def test_translating_mode_needs_references(servers):
    _, urls = servers
    with pytest.raises(KVMapError, match="re-prefill replay's answers"):
        run(urls, "translated")
    with pytest.raises(KVMapError, match="replay mode 'reprefill' first"):
        run(urls, "translated", references={})


def test_server_down_is_reported(servers):
    _, urls = servers
    probe = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    dead = f"http://127.0.0.1:{probe.server_address[1]}"
    probe.server_close()  # nothing listens there now
    with pytest.raises(LiveServerError, match=rf"small server at {dead} did not answer"):
        run({**urls, "small": dead}, "reprefill")


def test_http_500_is_reported(servers):
    behaviours, urls = servers
    behaviours["large"].status = 500
    with pytest.raises(LiveServerError, match=r"large server .* HTTP 500: .*Internal Server"):
        run(urls, "reprefill")


def test_streamed_error_is_reported(servers):
    behaviours, urls = servers
    behaviours["small"].stream_error = "The input (10 tokens) is longer than the context"
    with pytest.raises(LiveServerError, match="streamed an error: The input"):
        run(urls, "reprefill")


def test_a_reply_without_its_prompt_length_is_reported(servers):
    """The prompt's length comes from the server (a text prompt's is the tokenizer's): a reply
    without ``meta_info.prompt_tokens`` is an error, never the request's own count."""
    behaviours, urls = servers
    behaviours["small"].omit_prompt_tokens = True
    with pytest.raises(LiveServerError, match="small server .* sent no meta_info.prompt_tokens"):
        run(urls, "reprefill")


def test_each_mode_launches_the_servers_it_names(served_pair, tmp_path):
    """``bench --live``'s command lines per mode (``live_run.mode_lines``, what ``sglang-args``
    prints for the pair), parsed by SGLang 0.5.23's own ServerArgs parser: reprefill gives no
    engine a pack; translated and tail give both, with tail_pages 0 and the default tail."""
    import shlex

    from sgl_kvmap.bench.live_run import LiveSetup, mode_lines, mode_options
    from sgl_kvmap.sglang.launch import PAGE_SIZE, LaunchOptions, PrefetchDeadline
    from sgl_kvmap.sglang.settings import StorageSettings

    from .test_cli import sglang_parses

    names = dict(zip(("small", "large"), served_pair["names"]))
    roles = ("small", "large")
    packs = {(roles[s], roles[t]): pack for (s, t), pack in served_pair["packs"].items()}
    options = LaunchOptions(device="cpu", max_total_tokens=4096)
    setup = LiveSetup(names, packs, options, 31000, PrefetchDeadline(base=2.0), tmp_path)
    for mode, tail in (
        ("reprefill", None),
        ("translated", 0),
        ("tail", StorageSettings.tail_pages),
    ):
        lines = mode_lines(setup, mode, mode_options(setup, mode, str(tmp_path / mode)))
        parsed = [
            sglang_parses(shlex.split(line)[6:]) for line in lines
        ]  # after the env, python -m
        assert [a.port for a in parsed] == [31000, 31001]
        assert [a.served_model_name for a in parsed] == ["small", "large"]
        assert all(a.page_size == PAGE_SIZE and a.device == "cpu" for a in parsed)
        for args in parsed:
            extra = json.loads(args.hicache_storage_backend_extra_config)
            settings = StorageSettings.from_extra_config(extra)
            assert extra["file_storage_path"] == str(tmp_path / mode)
            assert settings.stats_path == str(tmp_path / mode / "kvmap-stats")
            assert settings.translate == (tail is not None)
            if tail is not None:
                assert settings.tail_pages == tail and extra["prefetch_timeout_base"] == 2.0
                assert args.hicache_storage_prefetch_policy == "timeout"


def test_settle_waits_until_the_servers_store_writes_stop(tmp_path):
    """``LiveClient.settle``: the writer's counters of written pages change for a while after a
    request; the next request goes out once they have not changed for SETTLE_S."""
    from sgl_kvmap.sglang import client as live

    stats = tmp_path / "small_0_1.json"
    stats.write_text(json.dumps({"counters": {"stored_pages": 1}}))

    def writes():
        for n in range(2, 6):
            time.sleep(0.2)
            stats.write_text(json.dumps({"counters": {"stored_pages": n}}))

    writer = threading.Thread(target=writes)
    with LiveClient({"small": "http://127.0.0.1:9"}, stats={"small": stats}) as client:
        started = time.monotonic()
        writer.start()
        client.settle("small")
        waited = time.monotonic() - started
        writer.join()
        assert client.counters("small")["stored_pages"] == 5
    assert 0.8 + live.SETTLE_S - 0.1 <= waited < live.SETTLE_MAX_S


def test_storage_hits_split_by_the_servers_own_counters():
    """What SGLang took from storage beyond the pages KVMapStorage loaded as the server's own
    (its counter of native pages, 64 tokens each) is translated."""
    from sgl_kvmap.bench.live import counted_tiers

    cached = {"device": 64, "host": 0, "storage": 320}
    assert counted_tiers(cached, {"native_pages": 2}, 64) == {
        "device": 64,
        "host": 0,
        "storage": 128,
        "translated": 192,
    }
    assert counted_tiers(cached, {}, 64)["translated"] == 320


def test_prompts_that_share_no_page_are_not_warmed():
    """``live_run.warm`` with the slice's shared opening: none (sessions that open apart,
    ``--openings distinct``) sends no request (SGLang refuses empty input_ids); an opening is
    served on both servers, computed whole. The client is a recorder standing in for
    ``LiveClient`` (only its generate and settle calls are read)."""
    from sgl_kvmap.bench.live_run import warm

    class Recorder:
        def __init__(self):
            self.calls = []

        def generate(self, role, tokens, answer, native=False):
            self.calls.append((role, tuple(tokens), native))

        def settle(self, role):
            pass

    client = Recorder()
    warm(client, ())
    assert client.calls == []
    warm(client, (5, 6, 7))
    assert client.calls == [("small", (5, 6, 7), True), ("large", (5, 6, 7), True)]


def test_malformed_replies_are_errors_that_name_them_not_tracebacks():
    """Before: a streamed event that was not JSON, a JSON list, or per-tier counts that were
    not whole numbers raised from inside the client (a traceback in ``warm`` and the bench);
    each is now a LiveServerError saying what came back."""
    from sgl_kvmap.sglang.client import cached_by_tier, sse_payloads

    with pytest.raises(LiveServerError, match="the server streamed an event that is not JSON"):
        list(sse_payloads(["data: {oops"], "the server"))
    with pytest.raises(LiveServerError, match="not an object: \\[1, 2\\]"):
        list(sse_payloads(["data: [1, 2]"], "the server"))
    with pytest.raises(LiveServerError, match="not counts: {'device': '16'}"):
        cached_by_tier({"cached_tokens_details": {"device": "16", "storage": 32}})
    with pytest.raises(LiveServerError, match="is not an object"):
        cached_by_tier({"cached_tokens_details": [16]})
    assert cached_by_tier({"cached_tokens_details": {"device": 16, "storage": None}}) == {
        "device": 16,
        "host": 0,
        "storage": 0,
    }
