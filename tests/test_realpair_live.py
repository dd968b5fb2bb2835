"""The README's serving recipe, run as it is written, on the real Qwen2.5-Coder pair.

The recipe (the bash block after the README's ``serving-recipe`` marker) is run unchanged with
``bash -e`` in a folder laid out as the README's two commands leave a user's: the packs the demo
leaves in ``kvmap-demo/`` and the repository's ``examples/`` (linked), the converted pair in
sgl-kvmap's model cache (``~/.cache/sgl-kvmap/models``, where the recipe's ``--engine`` paths
point). It prints the engines' lines with ``sgl-kvmap sglang-args --device cpu`` at its defaults
(SGLang's ``timeout`` prefetch policy with the deadline it measures, the quality floor 0, first
pages primed), starts one server per printed line, waits for both to answer ``/health`` and runs
``examples/swap_session.py``: a session served by the 0.5B, then swapped to the 1.5B, which must
translate on its very first swap.

Substituted: the demo's packs are fitted here on a small budget (``BUDGET``), and each records,
as the figure the quality floor reads, what the demo's own pack records with the demo's budget
(``DEMO_FIGURES``, from ``sgl-kvmap eval --record`` of the demo's packs: docs/LOG.md
2026-12-07): the floor's reading of figures is tested in tests/test_sglang_storage.py, and the
demo itself takes about 30 minutes. The only variable added to the recipe's environment:
``PATH`` starts with this interpreter's folder (tests/test_sglang_live.py), so ``sgl-kvmap`` and
``python`` are this installation's. The pair is fitted before any server starts and released,
so the test process and both servers never hold it twice.
"""

from __future__ import annotations

import ast
import gc
import os
import signal
import socket
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest

from sgl_kvmap import CalibrationConfig, load_model
from sgl_kvmap.fitting.calibrate import fit_mapper
from sgl_kvmap.fitting.default_pair import LARGE, SMALL, ensure_model

from .test_sglang_live import ENVIRONMENT, PAGE, ROOT

pytestmark = pytest.mark.realpair
pytest.importorskip("sglang", reason="the live-server tests need SGLang 0.5.23 (setup_cpu.sh)")

BUDGET = CalibrationConfig(tokens=4096, window=512, top_k=2)
RECIPE_MARKER = "<!-- serving-recipe"
PORTS = (30000, 30001)  # the recipe's: sglang-args' default --port and the next
RECIPE_TIMEOUT_S = 1200.0
DEMO_FIGURES = {  # what the demo's packs record: each model's own accuracy (the 1.5B beats the
    # 0.5B: only the up pack has a gap to close) and the hand-off as served (16-token pages,
    # 3-page tail)
    "0.5B_to_1.5B": {
        "eval_source_accuracy": 0.684,
        "eval_reference_accuracy": 0.758,
        "eval_gap_closed_served": 0.053,
        "eval_retention_served": 0.907,
    },
    "1.5B_to_0.5B": {
        "eval_source_accuracy": 0.758,
        "eval_reference_accuracy": 0.684,
        "eval_retention_served": 0.909,
    },
}
SERVED = {"eval_served_page_size": PAGE, "eval_served_tail": 3 * PAGE}


def stop_group(process: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM to the recipe's process group (its shell and the servers it left running, with
    their scheduler and detokenizer processes), SIGKILL to what is left after ``grace`` s."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.killpg(process.pid, 0)
            except ProcessLookupError:
                return
            process.poll()
            time.sleep(0.5)


def recipe() -> str:
    """The README's serving recipe: the bash block after its ``serving-recipe`` marker."""
    readme = (ROOT / "README.md").read_text()
    after = readme[readme.index(RECIPE_MARKER) :]
    return after.split("```bash\n", 1)[1].split("```", 1)[0]


def reported(output: str, turn: str) -> tuple[dict, dict]:
    """What ``examples/swap_session.py`` printed for ``turn``: SGLang's cached tokens per tier
    and sgl-kvmap's report (``meta_info.kvmap``)."""
    lines = output.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(turn))
    cached = ast.literal_eval(lines[at].split("cached ", 1)[1])
    kvmap = ast.literal_eval(lines[at + 1].split("sgl-kvmap: ", 1)[1])
    return cached, kvmap


@pytest.fixture(scope="module")
def user_folder(tmp_path_factory):
    """A folder as a user's is after ``sgl-kvmap demo``: ``kvmap-demo/`` with a pack each way
    (module docstring) and ``examples/``."""
    folders = [ensure_model(model) for model in (SMALL, LARGE)]
    home_cache = Path("~/.cache/sgl-kvmap/models").expanduser()
    if any(folder.parent != home_cache for folder in folders):
        pytest.skip(f"$KVMAP_CACHE keeps the pair outside {home_cache}, where the recipe looks")
    folder = tmp_path_factory.mktemp("user")
    small, large = (load_model(str(path)) for path in folders)
    for (source, target), name in zip([(small, large), (large, small)], DEMO_FIGURES):
        ((mapper, _),) = fit_mapper(source, target, config=BUDGET)
        mapper = replace(mapper, sink_tokens=4)
        mapper.info.setdefault("metrics", {}).update({**DEMO_FIGURES[name], **SERVED})
        mapper.save_pretrained(folder / "kvmap-demo" / name)
    del small, large, mapper
    gc.collect()
    (folder / "examples").symlink_to(ROOT / "examples")
    return folder


def test_the_readme_recipe_starts_two_servers_and_the_first_swap_translates(user_folder):
    """The recipe as written (module docstring): ``engines.sh`` says the up pack is used and
    the down pack is not (its figure is below the retention floor); both servers start from
    their printed lines; the session's second turn, on the 1.5B, is its very first swap: SGLang
    reports its first page on the device (computed just before it, ``primed_tokens``) and the
    0.5B's pages after it from storage, all of them translated (``meta_info.kvmap``)."""
    for port in PORTS:
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0, f"port {port} is taken"
    env = {**os.environ, **ENVIRONMENT}
    process = subprocess.Popen(
        ["bash", "-e", "-c", recipe()],
        cwd=user_folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=RECIPE_TIMEOUT_S)
    finally:
        stop_group(process)
    log = (user_folder / "engines.log").read_text()[-4000:] if process.returncode else ""
    assert process.returncode == 0, f"{output}\n--- engines.log ---\n{log}"
    engines = (user_folder / "engines.sh").read_text()
    floor = [line for line in engines.splitlines() if line.startswith("# pack ")]
    up = next(line for line in floor if "qwen-coder-0.5b -> qwen-coder-1.5b" in line)
    down = next(line for line in floor if "qwen-coder-1.5b -> qwen-coder-0.5b" in line)
    assert "eval_gap_closed_served 0.053" in up and "used: above the quality floor 0" in up
    assert "eval_retention_served 0.909" in down and "NOT used" in down
    first, _ = reported(output, "turn 1")
    assert first == {"device": 0, "host": 0, "storage": 0}
    cached, kvmap = reported(output, "turn 2")
    assert kvmap["status"] == "translated", output
    assert kvmap["primed_tokens"] == PAGE and cached["device"] == PAGE
    assert cached["host"] == 0 and kvmap["translated_tokens"] == cached["storage"] > 20 * PAGE
