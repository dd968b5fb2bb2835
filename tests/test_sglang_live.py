"""KVMapStorage inside real ``sglang.launch_server`` processes (SGLang 0.5.23, its CPU engine).

Two engines serve the tiny pair of ``served_pair`` (model "a": 3 layers x 2 KV heads x 16, model
"b": 4 layers x 1 KV head x 32, one character tokenizer, packs a -> b and b -> a), each started
from the command line that ``sgl-kvmap sglang-args --device cpu --engine A=tiny-a --engine
B=tiny-b --pack ... --store-path TMP --max-total-tokens 8192`` prints (run as a user runs it,
its output run with ``bash -c``, so the printed command is what is tested), and driven only
through HTTP: ``POST /generate`` with ``input_ids``, greedy, by ``sgl_kvmap.sglang.client``'s
client, which reads SGLang's own ``meta_info.cached_tokens_details`` (device, host, storage).
The page size, the prefetch threshold (a request prefetches only when at least that many
tokens beyond what it has cached are found in storage) and the tail are sglang-args' defaults;
the stop policy is ``wait_complete``
(``sglang-args --prefetch-policy wait_complete``): these tests check what is translated, and a
loaded 2-core machine missed the deadline sglang-args measured on the first translations.

The printed ``--device cpu`` lines carry SGLang's CPU engine environment themselves
(``launch.CPU_ENVIRONMENT``: sgl-kvmap's CPU stand-ins of ``sgl_kernel`` and of two HiCache lines
on ``PYTHONPATH``, ``sgl_kvmap/sglang/cpu_engine``, and a 1 GiB host-memory reserve instead of
SGLang's 10 GiB); a GPU deployment's lines carry none of it. The one variable these tests add:
``PATH`` starts with this interpreter's folder, so the printed ``python`` is the Python running
these tests (where sglang and sgl-kvmap are installed).

The tests also read the store folder (the page files HiCache's ``file`` store names
``{page hash}_{served name, / as -}_{tp rank}_{tp size}.bin``): to wait until a server's
write-through has stored a turn's pages before the next turn, and to check which model's pages
are there. One test deletes a peer's files there, as a store evicting them would.

Servers are started seven times in all, at most two at once (each is three processes of about
1 GB): the translating pair, a restart of B, a B with no pack into it and a B on an empty store,
then (after those stopped: the tests run in this file's order) the pair at sglang-args'
defaults.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="the live-server tests need SGLang 0.5.23 (setup_cpu.sh)")

from sgl_kvmap.sglang.client import LiveClient  # noqa: E402
from sgl_kvmap.sglang.launch import PAGE_SIZE, PREFETCH_THRESHOLD  # noqa: E402
from sgl_kvmap.sglang.records import derived_key  # noqa: E402
from sgl_kvmap.sglang.servers import (  # noqa: E402
    LiveServer,
    free_port_base,
    sglang_args_lines,
    start_server,
    stop_servers,
)

from .conftest import hicache_storage_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PAGE = PAGE_SIZE  # sglang-args' default --page-size
THRESHOLD = max(PREFETCH_THRESHOLD, PAGE)  # its --prefetch-threshold, as SGLang raises it
MAX_TOTAL_TOKENS = 8192
ANSWER = 8  # greedy tokens per request
NAMES = {"a": "tiny-a", "b": "tiny-b"}  # served names
START_TIMEOUT_S = 420.0
STORE_TIMEOUT_S = 60.0
ENVIRONMENT = {"PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}


class Deployment:
    """The printed command lines of one ``sglang-args`` call and the servers running them.
    ``store``: the file store's folder (its counters' folder with ``store_args``, sglang-args'
    options of another store); ``env``: the variables added to each printed line; ``sinks``,
    ``first_layer``, ``derived`` and ``prefetch_policy``: sglang-args' ``--sinks``,
    ``--first-layer``, ``--derived`` and ``--prefetch-policy`` (None: its default)."""

    def __init__(
        self,
        folder: Path,
        pair: dict,
        packs: list[tuple[int, int]],
        port: int,
        store,
        store_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        sinks: str | None = None,
        first_layer: str | None = None,
        derived: str | None = None,
        prefetch_policy: str | None = "wait_complete",
    ):
        self.folder, self.store = folder, Path(store)
        self.store.mkdir(parents=True, exist_ok=True)
        self.env = env or ENVIRONMENT
        engines = [f"{path}={NAMES[m]}" for path, m in zip(pair["names"], "ab")]
        args = ["--device", "cpu", "--engine", engines[0], "--engine", engines[1]]
        for pack in packs:
            args += ["--pack", pair["packs"][pack]]
        args += ["--store-path", str(self.store), *store_args]
        args += ["--max-total-tokens", str(MAX_TOTAL_TOKENS)]
        args += ["--audit-translations", "--quality-floor", "none"]  # tiny packs: no eval
        # what is translated, not when, unless a test asks for sglang-args' default (None)
        args += ["--prefetch-policy", prefetch_policy] if prefetch_policy else []
        args += ["--sinks", sinks] if sinks else []
        args += ["--first-layer", first_layer] if first_layer else []
        args += ["--derived", derived] if derived else []
        self.lines = sglang_args_lines(
            [*args, "--port", str(port)], program=sgl_kvmap_program(), env=self.env
        )
        self.servers: dict[str, LiveServer] = {}
        self.starts = 0

    def line(self, model: str) -> str:
        return self.lines[NAMES[model]]

    def extra_config(self, model: str) -> dict:
        words = shlex.split(self.line(model))
        return json.loads(words[words.index("--hicache-storage-backend-extra-config") + 1])

    def server(self, model: str) -> LiveServer:
        if model not in self.servers:
            log = self.folder / f"{model}-{self.starts}.log"
            started = time.monotonic()
            self.servers[model] = start_server(self.line(model), log, self.env, START_TIMEOUT_S)
            STARTUPS.append((f"{NAMES[model]} ({log.name})", time.monotonic() - started))
            self.starts += 1
        return self.servers[model]

    def stop(self, *models: str) -> None:
        stop_servers([self.servers.pop(m) for m in models if m in self.servers], grace=30)

    def client(self, *models: str) -> LiveClient:
        return LiveClient({m: self.server(m).url for m in models}, timeout=300)

    def stored(self, model: str, tokens: list[int]) -> list[bool]:
        """For each full page of ``tokens``: whether ``model``'s page is in the store."""
        return page_files(self.store, model, tokens)

    def reader(self, served_name: str):
        """The store as the engine serving ``served_name`` (rank 0 of 1) reads it: an object
        with ``get(key, buffer)``, the value or None."""
        return store_reader(self.store, served_name)


STARTUPS: list[tuple[str, float]] = []  # (server, seconds to healthy), printed at the end


def translating_pair(served_pair, tmp_path_factory, name: str, **options) -> Deployment:
    """A ``Deployment`` of both engines with both packs over a store of its own, in a fresh
    folder ``name``; ``options``: ``Deployment``'s."""
    folder = tmp_path_factory.mktemp(name)
    return Deployment(
        folder, served_pair, [(0, 1), (1, 0)], free_port_base(2), folder / "store", **options
    )


def sgl_kvmap_program() -> str:
    """The ``sgl-kvmap`` console script of this interpreter's installation."""
    script = Path(sys.executable).parent / "sgl-kvmap"
    return str(script) if script.exists() else "sgl-kvmap"


@pytest.fixture(scope="module")
def live(served_pair, tmp_path_factory):
    """The translating pair: both packs, one store; servers started on first use. Engines
    that may translate a prefix's first page (``--sinks translate``): a swap into a fresh
    engine translates from page 0, and the scenarios below check that page's translation too.
    The default, an engine computing its first page itself, is checked on servers of its own
    (``test_a_warmed_opening_stays_the_engines_own_...``)."""
    deployment = translating_pair(served_pair, tmp_path_factory, "live", sinks="translate")
    yield deployment
    deployment.stop(*list(deployment.servers))
    for name, seconds in STARTUPS:
        print(f"server {name} healthy after {seconds:.1f} s")


def prompt(seed: int, length: int) -> list[int]:
    """Random character ids (3..99: no pad, BOS or EOS id)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 100) for _ in range(length)]


def page_files(store: Path, model: str, tokens: list[int], derived: bool = False) -> list[bool]:
    """For each full page of ``tokens``: whether ``model``'s page file is in the store (with
    ``derived``: its file of the page computed over translated KV, ``records.derived_key``)."""
    from sglang.srt.mem_cache.utils import get_hash_str

    full = len(tokens) // PAGE * PAGE
    suffix = f"_{NAMES[model]}_0_1.bin"
    hashes = get_hash_str(tokens[:full], None, PAGE)
    return [(store / f"{derived_key(h) if derived else h}{suffix}").exists() for h in hashes]


def leading(flags: list[bool]) -> int:
    return next((i for i, flag in enumerate(flags) if not flag), len(flags))


def wait_stored(live: Deployment, model: str, tokens: list[int], pages: int) -> None:
    """Until ``model``'s write-through has stored the first ``pages`` pages of ``tokens``."""
    wait_for(lambda: leading(live.stored(model, tokens)), pages, f"{model} stored", "pages")


def wait_for(count, want: int, what: str, unit: str) -> None:
    """Until ``count()`` reaches ``want`` (and a moment more, for what is written beside the
    pages it counts), at most ``STORE_TIMEOUT_S``."""
    deadline = time.monotonic() + STORE_TIMEOUT_S
    while count() < want:
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} {count()} of {want} {unit} in {STORE_TIMEOUT_S} s")
        time.sleep(0.2)
    time.sleep(0.5)


def first_turn(client: LiveClient, live: Deployment, model: str, tokens: list[int]):
    """Serve ``tokens`` on ``model`` and wait until its KV pages are stored: those of every
    token but the last answer token (the one whose KV is never computed), in full pages."""
    generation = client.generate(model, tokens, ANSWER)
    history = [*tokens, *generation.output_ids]
    wait_stored(live, model, history, (len(history) - 1) // PAGE)
    return history


def translated(live: Deployment, sender: str, history: list[int], prompt_tokens: list[int]):
    """Tokens SGLang should report from storage for ``prompt_tokens`` on the receiver: the
    sender's leading stored pages of the prompt, minus the tail KVMapStorage leaves to the
    receiver (``tail_pages``), as long as that clears the prefetch threshold."""
    receiver = "b" if sender == "a" else "a"
    stored = leading(live.stored(sender, prompt_tokens))
    prefetchable = min(stored, (len(prompt_tokens) - 1) // PAGE)
    pages = prefetchable - live.extra_config(receiver)["tail_pages"]
    return pages * PAGE if pages * PAGE >= THRESHOLD else 0


@pytest.fixture(scope="module")
def swapped_session(live):
    """A session whose first turn A served (400 prompt tokens + its answer), then whose second
    turn (the history + 60 new tokens) went to B: (history after A, B's prompt, B's
    generation, the storage tokens expected)."""
    with live.client("a", "b") as client:
        history = first_turn(client, live, "a", prompt(1, 400))
        second = [*history, *prompt(2, 60)]
        expected = translated(live, "a", history, second)
        return history, second, client.generate("b", second, ANSWER), expected


def test_a_session_served_by_a_is_translated_for_b(live, swapped_session):
    """B reports A's stored pages as storage hits, less the tail pages it computes itself: all
    of A's full pages of 407 tokens of KV (25 at 16-token pages) but the last ``tail_pages``
    (22 pages, 352 tokens at 3); and B answers."""
    history, second, generation, expected = swapped_session
    assert live.extra_config("b")["translate"] and live.extra_config("b")["peers"]
    pages = leading(page_files(live.store, "a", history))
    assert pages == (len(history) - 1) // PAGE
    assert expected == (pages - live.extra_config("b")["tail_pages"]) * PAGE > 0
    assert generation.cached == {"device": 0, "host": 0, "storage": expected}
    assert generation.prompt_tokens == len(second) and len(generation.output_ids) > 0


def store_reader(store: Path, served_name: str):
    """SGLang's own ``file`` store, read as the engine serving ``served_name`` (rank 0 of 1)
    reads its pages: HiCacheFile over the same folder, eviction off."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    extra = {"file_storage_path": str(store), "max_size": 0, "min_free_space": 0}
    config = hicache_storage_config(served_name, extra)
    return HiCacheFile(config)


def test_bs_kv_for_the_translated_pages_is_the_translation_of_as(
    live, swapped_session, served_pair
):
    """Read back through the store: the pages B received translated (its audit copies,
    ``sglang-args --audit-translations``) equal the pack's translation of A's stored pages at
    the positions A's records give (``assert_translated``)."""
    history, second, generation, expected = swapped_session
    keys = page_hashes(second)[: expected // PAGE]
    assert_translated(live, NAMES["a"], NAMES["b"], keys, served_pair["packs"][0, 1])


def assert_translated(
    store, sender: str, receiver: str, keys: list[str], pack, own_first_layer=None, stored_as=None
) -> None:
    """(``store``: the file store's folder, or a ``Deployment``, read through its ``reader``.)
    The receiver's audit copies of pages ``keys`` (its store, key + ``.translated``) equal
    ``pack``'s translation of the sender's stored pages (under their keys, or the store keys
    ``stored_as``) at the positions its records give,
    computed here as a worker computes it (the products in bfloat16 or float32, whichever the
    server's CPU multiplies faster: both are tried). The receiver's pages use the sender's KV
    dtype (both servers keep their KV in one dtype here). ``own_first_layer``: (the
    receiver's model, the sequence's token ids) for a receiver serving its own layer 0
    (``--first-layer exact``): layer 0 is then that model's own K/V of those tokens (to the
    pages' dtype), the other layers the translation."""
    import torch

    from sgl_kvmap.core.mapper import KVMapper
    from sgl_kvmap.kernels import PagedKV, translate_pages
    from sgl_kvmap.sglang.pages import PageFormat

    records, source = stored_pages(store, sender, stored_as or keys)
    received = reader_of(store, receiver)
    page = records[0].page
    assert [r.index for r in records] == list(range(records[0].index, records[0].index + len(keys)))
    mapper = KVMapper.from_pretrained(pack)
    spec = mapper.target
    shape = (2, source.shape[1], spec.num_layers, spec.num_kv_heads, spec.head_dim)
    own = PageFormat("page_first", page.page_size, *shape[2:], page.dtype)
    got = [own.to_tokens(received.get(k + ".translated", own.empty_page())) for k in keys]
    got = torch.cat(got, dim=1)
    wants = []
    for matmul_dtype in (torch.bfloat16, torch.float32):
        want = torch.empty(shape, dtype=page.dtype)
        slots = torch.arange(source.shape[1])
        pools = PagedKV.token_major(source), PagedKV.token_major(want)
        positions = slots + records[0].first_token
        translate_pages(
            mapper, pools[0], slots, pools[1], slots, positions, matmul_dtype=matmul_dtype
        )
        wants.append(want)
    if own_first_layer is not None:
        from sgl_kvmap.models.capture import first_layer_kv

        model, tokens = own_first_layer
        own = first_layer_kv(model, torch.tensor(tokens[: int(positions[-1]) + 1]))
        for kind in (0, 1):
            exact = own[kind][positions].to(got.dtype)
            torch.testing.assert_close(got[kind, :, 0], exact, rtol=0.01, atol=0.01)
            mapped = wants[0][kind, :, 0].float()  # would fail the check above: not it
            assert not torch.allclose(mapped, exact.float(), rtol=0.01, atol=0.01)
        got, wants = got[:, :, 1:], [want[:, :, 1:] for want in wants]
    assert any(torch.equal(got, want) for want in wants)
    assert wants[0].abs().sum() > 0


def test_bs_answer_over_the_translated_pages_is_the_librarys_handoff(
    live, swapped_session, served_pair
):
    """Repair inside SGLang is the tail it recomputes: B's log-probabilities of its answer,
    served over what its radix tree holds after the swap (A's pages translated, then the tail
    page and the new tokens B computed over them), equal the library's ``transfer.handoff`` of
    the same prompt from A's stored pages with the same pack and the same tail; and they differ
    from B's own re-prefill far more, so the comparison can fail. The hand-off is the one the
    storage path can serve (it sees page keys, not token ids): no sink tokens recomputed, layer
    0 mapped (``sinks: translate``), B's tiny model in float32 in the library."""
    import dataclasses

    import torch

    from sgl_kvmap.core.mapper import KVMapper
    from sgl_kvmap.models.capture import run
    from sgl_kvmap.models.transfer import handoff

    history, second, generation, expected = swapped_session
    answer = list(generation.output_ids)
    with live.client("b") as client:
        served = torch.tensor(client.answer_logprobs("b", second, answer), dtype=torch.float64)
    keys = page_hashes(second)[: expected // PAGE]
    source = stored_cache(live.store, NAMES["a"], keys)
    mapper = KVMapper.from_pretrained(served_pair["packs"][0, 1])
    mapper = dataclasses.replace(mapper, sink_tokens=0)
    target = served_pair["models"][1].model
    tokens = torch.tensor(second)
    tail = len(second) - 1 - expected
    library = handoff(mapper, source, tokens, target, tail=tail, exact_first_layer=False)
    reprefill = run(target, tokens, logits_to_keep=1)
    library, reprefill = (logprobs_after(target, out, answer) for out in (library, reprefill))
    served_error = (served - library).abs().max().item()
    translation_effect = (reprefill - library).abs().max().item()
    print(
        f"answer logprobs: served vs library {served_error:.2e}, re-prefill vs library "
        f"{translation_effect:.2e} ({len(answer)} tokens)"
    )
    assert served_error < 2e-3
    assert translation_effect > 10 * max(served_error, 1e-4)


def reader_of(store, served_name: str):
    """``store``'s reader for ``served_name``: a file store's folder, or a ``Deployment``."""
    if hasattr(store, "reader"):
        return store.reader(served_name)
    return store_reader(store, served_name)


def stored_pages(store, served_name: str, keys: list[str]):
    """The records of pages ``keys`` as ``served_name``'s engine stored them in ``store`` (a
    file store's folder, or a ``Deployment``), and the pages' KV, token-major:
    [2, len(keys) x page size, layers, heads, head_dim]."""
    import torch

    from sgl_kvmap.sglang.records import PageRecord, empty_record, record_key

    reader = reader_of(store, served_name)
    records = [PageRecord.from_tensor(reader.get(record_key(k), empty_record())) for k in keys]
    page = records[0].page
    return records, torch.cat([page.to_tokens(reader.get(k, page.empty_page())) for k in keys], 1)


def stored_cache(store: Path, served_name: str, keys: list[str]):
    """The KV of pages ``keys`` (a sequence's leading pages) as ``served_name``'s engine stored
    them, as a float32 ``KVCache`` at the positions their records give."""
    import torch

    from sgl_kvmap.core.cache import KVCache

    records, tokens = stored_pages(store, served_name, keys)
    assert [r.index for r in records] == list(range(len(keys)))
    tokens = tokens.float()  # [2, T, layers, heads, head_dim]
    layers = range(tokens.shape[2])
    return KVCache(
        [tokens[0, :, layer] for layer in layers],
        [tokens[1, :, layer] for layer in layers],
        torch.arange(tokens.shape[1]),
    )


def logprobs_after(model, prompt_out, answer: list[int]):
    """The log-probability of each ``answer`` token after a prompt whose forward is
    ``prompt_out`` (its cache and last logits), teacher-forced: [len(answer)] float64."""
    import torch

    from sgl_kvmap.models.capture import run

    logits = [prompt_out.logits[-1:]]
    if len(answer) > 1:
        rest = run(
            model, torch.tensor(answer[:-1]), past=prompt_out.cache, logits_to_keep=len(answer) - 1
        )
        logits.append(rest.logits)
    logprobs = torch.cat(logits).double().log_softmax(-1)
    return logprobs[torch.arange(len(answer)), torch.tensor(answer)]


def test_concurrent_sessions_on_both_servers(live):
    """Sessions sent at once from threads, their first turns alternating between A and B, each
    second turn on the other server, as many swaps into each server as it translates at once
    (``concurrent_translations``; a swap beyond them is prefilled): every request is answered
    (HTTP 200, a streamed answer), and every swapped request reports translated pages from
    storage (page-aligned, at most what its sender stored less the tail: a prefetch that
    SGLang's deadline cuts under this load may bring fewer)."""
    per_server = min(live.extra_config(m)["concurrent_translations"] for m in "ab")

    def session(i: int):
        first, second = ("a", "b") if i % 2 == 0 else ("b", "a")
        with live.client("a", "b") as client:
            history = first_turn(client, live, first, prompt(100 + i, 330 + 16 * i))
            tokens = [*history, *prompt(200 + i, 40)]
            expected = translated(live, first, history, tokens)
            return expected, client.generate(second, tokens, ANSWER)

    live.server("a"), live.server("b")
    with ThreadPoolExecutor(2 * per_server) as pool:
        outcomes = list(pool.map(session, range(2 * per_server)))
    assert len(outcomes) >= 4
    for i, (expected, generation) in enumerate(outcomes):
        assert expected >= 4 * PAGE, f"session {i}: its sender stored too little to prefetch"
        storage = generation.cached["storage"]
        assert 0 < storage <= expected and storage % PAGE == 0, (i, generation.cached, expected)
        assert len(generation.output_ids) > 0


def wait_derived(live: Deployment, model: str, tokens: list[int], pages: range) -> None:
    """Until ``model``'s write-through has stored pages ``pages`` of ``tokens`` apart, as
    pages it computed over translated KV (``records.derived_key``)."""

    def stored() -> int:
        return sum(page_files(live.store, model, tokens, derived=True)[pages.start : pages.stop])

    wait_for(stored, len(pages), f"{model} stored", "derived pages")


def test_a_restarted_b_never_serves_translated_pages_as_its_own(live, swapped_session):
    """After B translated the session, the store holds no page of B's model for any page of
    B's prompt (every one follows a translated page); B restarted with the same printed
    command, and A's copies of those pages gone from the store (as a store evicting them would
    do), the same prompt gets no storage hit at all and is computed by B, which then stores
    its pages (its own KV now)."""
    history, second, generation, _ = swapped_session
    assert generation.cached["storage"] > 0  # B did translate (the first test's check)
    assert not any(page_files(live.store, "b", [*second, *generation.output_ids]))
    live.stop("b")
    for page_hash in page_hashes(second):
        for path in live.store.glob(f"{page_hash}*"):
            if NAMES["a"] in path.name:
                path.unlink()
    with live.client("b") as client:
        again = client.generate("b", second, ANSWER)
    assert again.cached == {"device": 0, "host": 0, "storage": 0}
    assert len(again.output_ids) > 0
    computed = [*second, *again.output_ids]  # now B's own KV: stored as B's pages
    wait_stored(live, "b", computed, (len(computed) - 1) // PAGE)


def page_hashes(tokens: list[int]) -> list[str]:
    from sglang.srt.mem_cache.utils import get_hash_str

    return get_hash_str(tokens[: len(tokens) // PAGE * PAGE], None, PAGE)


def test_a_swap_with_no_pack_into_b_is_prefilled(live, served_pair, tmp_path):
    """B started from ``sglang-args`` with only the pack b -> a (no pack into B), on the store
    where A stored the session's first turn: no storage hit, and B's answer is the answer of B
    started from ``sglang-args`` on an empty store (plain prefill). The two B's start together,
    once the translating pair has stopped."""
    with live.client("a") as client:
        history = first_turn(client, live, "a", prompt(3, 400))
    second = [*history, *prompt(4, 60)]
    assert translated(live, "a", history, second) > 0  # what a pack into B would translate
    live.stop("a", "b")
    no_pack = Deployment(tmp_path / "no-pack", served_pair, [(1, 0)], free_port_base(2), live.store)
    alone = Deployment(tmp_path / "alone", served_pair, [], free_port_base(2), tmp_path / "empty")
    assert not no_pack.extra_config("b")["translate"] and not any((tmp_path / "empty").iterdir())
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda deployment: deployment.server("b"), (no_pack, alone)))
        with no_pack.client("b") as fallback_client, alone.client("b") as reference_client:
            fallback = fallback_client.generate("b", second, ANSWER)
            reference = reference_client.generate("b", second, ANSWER)
    finally:
        no_pack.stop("b")
        alone.stop("b")
    assert fallback.cached == reference.cached == {"device": 0, "host": 0, "storage": 0}
    assert fallback.output_ids == reference.output_ids and len(reference.output_ids) > 0


@pytest.fixture(scope="module")
def defaults(served_pair, tmp_path_factory):
    """Servers launched with sglang-args' defaults (an engine computes a prefix's first page
    itself, priming it before a swap that needs it; SGLang's ``timeout`` prefetch policy with
    the deadline sglang-args measures), ``--first-layer exact`` and ``--derived share``; started
    on first use."""
    deployment = translating_pair(
        served_pair, tmp_path_factory, "defaults", first_layer="exact", derived="share",
        prefetch_policy=None,
    )  # fmt: skip
    yield deployment
    deployment.stop("a", "b")


def test_a_swap_whose_first_page_b_never_saw_translates_after_bs_own_first_page(
    defaults, served_pair
):
    """The first swap of fresh servers, under SGLang's ``timeout`` policy and the deadline
    sglang-args measured, between sessions that share no opening: a session A served, swapped to
    B, which never served its first page. B's TokenizerManager (sgl-kvmap's SGLang plugin) has
    B compute that page first; the swap then reports it as a device hit and A's pages after it,
    less the tail, as storage hits, and sgl-kvmap's report in its ``meta_info`` says so. B's
    stored copy of the first page is its own forward's KV, no audit copy of it exists (it was
    never translated), and the pages B received translated are the pack's translation of A's
    pages (with B's own layer 0)."""
    import torch

    from sgl_kvmap.models.capture import run

    live = defaults
    tail = live.extra_config("b")["tail_pages"]
    assert live.extra_config("b")["sinks"] == "prime"
    assert "--hicache-storage-prefetch-policy timeout" in live.line("b")
    assert not live.servers  # fresh servers: this swap is B's first
    with live.client("a", "b") as client:
        history = first_turn(client, live, "a", prompt(310, 300))
        second = [*history, *prompt(311, 60)]
        generation = client.generate("b", second, ANSWER)
    stored = min(leading(page_files(live.store, "a", second)), (len(second) - 1) // PAGE)
    pages = stored - 1 - tail
    assert pages * PAGE >= THRESHOLD
    assert generation.cached == {"device": PAGE, "host": 0, "storage": pages * PAGE}
    assert generation.kvmap["primed_seconds"] > 0
    assert generation.kvmap == {
        "translated_tokens": pages * PAGE,
        "primed_tokens": PAGE,
        "primed_seconds": generation.kvmap["primed_seconds"],
        "status": "translated",
    }
    first = page_hashes(second)[0]
    assert not (live.store / f"{first}.translated_{NAMES['b']}_0_1.bin").exists()
    wait_stored(live, "b", second, 1)
    own = stored_cache(live, NAMES["b"], [first])
    exact = run(served_pair["models"][1].model, torch.tensor(second[:PAGE])).cache
    for got, want in zip(own.keys + own.values, exact.keys + exact.values):
        torch.testing.assert_close(got, want, rtol=0.02, atol=0.02)
    keys = page_hashes(second)[1 : 1 + pages]
    own_first_layer = (served_pair["models"][1].model, second)
    assert_translated(
        live, NAMES["a"], NAMES["b"], keys, served_pair["packs"][0, 1], own_first_layer
    )


def test_a_warmed_opening_stays_the_engines_own_and_only_what_follows_is_translated(
    defaults, served_pair
):
    """Servers launched with sglang-args' defaults, ``--first-layer exact`` and ``--derived
    share``: ``sgl-kvmap
    warm`` (its command line, run as an operator runs it once the servers are healthy) serves
    a shared opening of six pages and a bit on A and then on B. B computes the opening itself
    although A stored it first (under ``--sinks translate`` it would translate A's first pages,
    less the tail): the copy of the opening B stores is its own, page for page. A session that
    begins with the opening, served by A and then swapped to B: B reports the opening's pages
    as device hits and only A's pages after them, less the tail, as storage hits (translated);
    the pages B received translated hold B's own layer 0 for their tokens (read back from A's
    stored layer 0) and the pack's translation of A's pages in every other layer. B stores the
    pages it computed after them apart (``.derived``), none as its own; the session's next turn,
    back on A, reports A's own pages as device hits and B's derived pages after them, less the
    tail, as storage hits, and A received them as the pack b -> a's translation of them, with
    A's own layer 0."""
    from click.testing import CliRunner

    from sgl_kvmap.cli import main

    live = defaults
    tail = live.extra_config("b")["tail_pages"]
    assert live.extra_config("b")["sinks"] == "prime"
    opening = prompt(300, (tail + 3) * PAGE + 10)
    opening_file = live.folder / "opening.json"
    opening_file.write_text(json.dumps(opening))
    held = len(opening) // PAGE * PAGE
    for model in "ab":  # B once A's copy of the opening is in the store
        url = live.server(model).url
        result = CliRunner().invoke(main, ["warm", url, "--opening-ids", str(opening_file)])
        assert result.exit_code == 0, result.output
        assert f"{url}: served the opening ({len(opening)} tokens); {held} of them" in (
            result.output
        )
        partial = f"its last {len(opening) - held} tokens ({held}..{len(opening) - 1}) end a "
        assert partial + f"partial {PAGE}-token page" in " ".join(result.output.split())
        wait_stored(live, model, opening, held // PAGE)
    for key in page_hashes(opening):
        assert not (live.store / f"{key}.translated_{NAMES['b']}_0_1.bin").exists()
    with live.client("a", "b") as client:
        history = first_turn(client, live, "a", [*opening, *prompt(301, 200)])
        second = [*history, *prompt(302, 120)]
        generation = client.generate("b", second, ANSWER)
        stored = min(leading(page_files(live.store, "a", second)), (len(second) - 1) // PAGE)
        back = [*second, *generation.output_ids]
        computed = (len(back) - 1) // PAGE  # B's pages of KV: after stored - tail, derived
        wait_derived(live, "b", back, range(stored - tail, computed))
        third = [*back, *prompt(303, 30)]  # 480 tokens with its answer: the models hold 512
        returned = client.generate("a", third, ANSWER)
    translated_pages = stored - len(opening) // PAGE - tail
    assert translated_pages * PAGE >= THRESHOLD
    assert generation.cached == {"device": held, "host": 0, "storage": translated_pages * PAGE}
    assert len(generation.output_ids) > 0
    first = len(opening) // PAGE
    keys = page_hashes(second)[first : first + translated_pages]
    own_first_layer = (served_pair["models"][1].model, second)
    pack = served_pair["packs"][0, 1]
    assert_translated(live, NAMES["a"], NAMES["b"], keys, pack, own_first_layer)
    assert not any(page_files(live.store, "b", back)[first:])
    device = returned.cached["device"] // PAGE
    pages = min(computed, (len(third) - 1) // PAGE) - device - tail
    assert device >= stored - tail and pages * PAGE >= THRESHOLD
    assert returned.cached == {"device": device * PAGE, "host": 0, "storage": pages * PAGE}
    keys = page_hashes(third)[device : device + pages]
    own_first_layer = (served_pair["models"][0].model, third)
    pack = served_pair["packs"][1, 0]
    stored_as = [derived_key(key) for key in keys]
    assert_translated(live, NAMES["b"], NAMES["a"], keys, pack, own_first_layer, stored_as)
