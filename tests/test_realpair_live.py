"""KVMapStorage in real ``sglang.launch_server`` processes serving the real Qwen2.5-Coder pair.

The 0.5B and the 1.5B each run from the line ``sgl-kvmap sglang-args --device cpu`` prints for
them (with a pack 0.5B -> 1.5B fitted here on a small budget, the store in a temporary folder,
``--audit-translations``), started one after the other, driven only through ``POST
/generate``. The printed lines carry the CPU engine's environment (tests/test_sglang_live.py;
its ``ENVIRONMENT`` only puts this interpreter first on ``PATH``). The pack is fitted before any
server starts and the fitting models are released, so the test process and both servers never
hold the pair twice.
"""

from __future__ import annotations

import gc
import time
from dataclasses import replace

import pytest

from sgl_kvmap import CalibrationConfig, load_model
from sgl_kvmap.fitting.calibrate import fit_mapper
from sgl_kvmap.fitting.default_pair import LARGE, SMALL, ensure_model
from sgl_kvmap.fitting.texts import default_eval_files, eval_windows
from sgl_kvmap.sglang.settings import StorageSettings

from .test_sglang_live import (
    ENVIRONMENT,
    PAGE,
    assert_translated,
    leading,
    page_hashes,
    sgl_kvmap_program,
)

pytestmark = pytest.mark.realpair
pytest.importorskip("sglang", reason="the live-server tests need SGLang 0.5.23 (setup_cpu.sh)")

BUDGET = CalibrationConfig(tokens=4096, window=512, top_k=2)
NAMES = ("qwen-coder-0.5b", "qwen-coder-1.5b")
PROMPT, FOLLOW_UP, ANSWER = 700, 60, 8
START_TIMEOUT_S = 600.0


@pytest.fixture(scope="module")
def folders():
    return str(ensure_model(SMALL)), str(ensure_model(LARGE))


@pytest.fixture(scope="module")
def pack(folders, tmp_path_factory):
    """A 0.5B -> 1.5B pack on a small budget (4 sink tokens, as packs carry them)."""
    small, large = (load_model(folder) for folder in folders)
    ((mapper, _),) = fit_mapper(small, large, config=BUDGET)
    folder = replace(mapper, sink_tokens=4).save_pretrained(tmp_path_factory.mktemp("pack") / "p")
    del small, large, mapper
    gc.collect()
    return str(folder)


def stored_pages(store, served_name: str, tokens: list[int]) -> int:
    """Leading full pages of ``tokens`` whose page file ``served_name`` has stored."""
    files = [(store / f"{h}_{served_name}_0_1.bin").exists() for h in page_hashes(tokens)]
    return leading(files)


def test_the_1_5b_server_continues_from_the_0_5b_servers_pages_translated(folders, pack, tmp_path):
    """Servers launched with sglang-args' defaults. The 1.5B server first serves the prompt's
    first page (as ``sgl-kvmap warm`` serves a shared opening: by default an engine computes a
    prefix's first page itself). A 700-token prompt of held-out text served by the 0.5B server,
    then the history plus 60 tokens sent to the 1.5B server: SGLang reports that first page as
    a device hit and the 0.5B's stored pages after it, less the tail pages (sglang-args'
    ``--tail-pages``), as storage hits, and the pages the 1.5B received (read back through the
    store) are the pack's translation of the 0.5B's stored pages at their recorded positions."""
    from transformers import AutoTokenizer

    from sgl_kvmap.sglang.client import LiveClient
    from sgl_kvmap.sglang.servers import (
        free_port_base,
        sglang_args_lines,
        start_server,
        stop_servers,
    )

    store = tmp_path / "store"
    args = ["--device", "cpu", "--pack", pack, "--store-path", str(store)]
    args += ["--max-total-tokens", "8192", "--audit-translations", "--port", str(free_port_base(2))]
    args += ["--quality-floor", "none"]  # what is checked is the translation, not its quality
    args += ["--prefetch-policy", "wait_complete"]  # and not when: a loaded CPU missed deadlines
    for folder, name in zip(folders, NAMES):
        args += ["--engine", f"{folder}={name}"]
    lines = sglang_args_lines(args, program=sgl_kvmap_program(), env=ENVIRONMENT)
    tokenizer = AutoTokenizer.from_pretrained(folders[1])
    window = eval_windows(tokenizer, default_eval_files(), PROMPT + FOLLOW_UP, 1)[0].tolist()
    servers = []
    try:
        for name in NAMES:
            servers.append(start_server(lines[name], tmp_path / f"{name}.log", ENVIRONMENT,
                                        START_TIMEOUT_S))  # fmt: skip
        urls = dict(zip(NAMES, (server.url for server in servers)))
        with LiveClient(urls, timeout=600) as client:
            client.generate(NAMES[1], window[: PAGE + 1], 1)
            first = client.generate(NAMES[0], window[:PROMPT], ANSWER)
            history = [*window[:PROMPT], *first.output_ids]
            pages = (len(history) - 1) // PAGE
            deadline = time.monotonic() + 120
            while stored_pages(store, NAMES[0], history) < pages:
                assert time.monotonic() < deadline, "the 0.5B did not store its pages"
                time.sleep(0.5)
            second = [*history, *window[PROMPT:]]
            swapped = client.generate(NAMES[1], second, ANSWER)
    finally:
        stop_servers(servers, grace=30)
    translated = pages - 1 - StorageSettings.tail_pages  # the first and tail pages: its own
    assert swapped.cached == {"device": PAGE, "host": 0, "storage": translated * PAGE}
    assert len(swapped.output_ids) > 0
    keys = page_hashes(second)[1 : 1 + translated]
    assert_translated(store, NAMES[0], NAMES[1], keys, pack)
