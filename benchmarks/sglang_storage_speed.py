"""Cost of a prefix hand-over through KVMapStorage on CPU, against the target's re-prefill.

    python benchmarks/sglang_storage_speed.py PACK [--tokens 2048] [--page 64]

Real SGLang 0.5.23 objects (as in tests/sglang_engines.py): the 0.5B engine stores a prompt's
pages in a file store; the 1.5B engine then reads them through KVMapStorage (batch_exists +
batch_get_v1: file reads, the translation into its host pool). Timed beside the 1.5B's own
prefill of the same tokens and a native read of the same number of its own pages. Writes
benchmarks/results/sglang_storage_speed.json. Needs scripts/setup_cpu.sh (sglang installed).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sgl_kvmap.capture import capture_kv, load_model  # noqa: E402
from sgl_kvmap.default_pair import LARGE, SMALL, ensure_model  # noqa: E402
from sgl_kvmap.sglang import PeerSettings, StorageSettings  # noqa: E402
from sgl_kvmap.texts import prompt_of_length  # noqa: E402

RESULTS = Path(__file__).parent / "results"


@click.command()
@click.argument("pack", type=click.Path(exists=True, file_okay=False))
@click.option("--tokens", default=2048, show_default=True)
@click.option("--page", default=64, show_default=True)
def main(pack, tokens, page) -> None:
    from tests import sglang_engines
    from tests.sglang_engines import Engine, info, page_keys

    sglang_engines.PAGE, sglang_engines.SLOTS = page, 2 * tokens
    names = str(ensure_model(SMALL)), str(ensure_model(LARGE))
    small, large = load_model(names[0]), load_model(names[1])
    store = {"file_storage_path": tempfile.mkdtemp()}
    peer = PeerSettings(model_name=names[0], pack=str(pack))
    on = StorageSettings(translate=True, interface_v1=True, peers=(peer,)).to_extra_config(**store)
    prompt = prompt_of_length(large.tokenizer, tokens).tolist()
    source = Engine.build(small, names[0], StorageSettings().to_extra_config(**store))
    source.back_up(prompt, source.prefill(prompt))
    target = Engine.build(large, names[1], on)
    target.back_up(prompt[:page], target.prefill(prompt[:page]))
    keys = page_keys(prompt)

    started = time.perf_counter()
    hits = target.storage.batch_exists(keys, info(None))
    ok = target.storage.batch_get_v1(keys, target.host.alloc(len(keys) * page), info([]))
    translate_seconds = time.perf_counter() - started
    assert hits == len(keys) and all(ok), (hits, ok)

    started = time.perf_counter()
    capture_kv(large.model, torch.tensor(prompt))
    prefill_seconds = time.perf_counter() - started

    started = time.perf_counter()
    native = target.storage.batch_get_v1(keys[:1], target.host.alloc(page), info([]))
    native_page_seconds = time.perf_counter() - started
    assert native == [True]

    result = {
        "tokens": tokens,
        "page_size": page,
        "pages_translated": target.storage.counters["translated_pages"],
        "hand_over_seconds": translate_seconds,
        "target_prefill_seconds": prefill_seconds,
        "speedup": prefill_seconds / translate_seconds,
        "native_read_seconds_per_page": native_page_seconds,
        "mapper_k": json.loads((Path(pack) / "kvmap.json").read_text())["metrics"].get("k"),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sglang_storage_speed.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
