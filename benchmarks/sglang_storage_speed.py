"""Cost of a prefix hand-over through SGLang's HiCache control flow on CPU, at one thread.

    python benchmarks/sglang_storage_speed.py PACK [--tokens 2048 --tokens 8192] [--page 64]
        [--threads 1] [--prefill-up-to 2048] [--out benchmarks/results/sglang_storage_speed.json]

The 0.5B engine serves a prompt and stores its pages (untimed). Then, with ``--threads`` torch
threads (SGLang's GPU server processes run one), a fresh 1.5B engine takes the same prompt
plus one token: timed from the scheduler's prefetch decision to the prefix loaded into its
device pool (the controller's hit query, the page transfer with KVMapStorage's record checks,
file reads and translation into the host pool, insert_host, the load-back). Beside it: the
same work without the file reads and SGLang's bookkeeping (``hand_over_seconds``, what
``sglang-args`` times), the prefetch deadline ``sgl-kvmap sglang-args`` sets on this machine,
and the 1.5B's own prefill of the prompt (up to ``--prefill-up-to`` tokens; it grows fast).
Engines are sgl_kvmap/sglang/engine.py.
"""

from __future__ import annotations

import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sgl_kvmap import KVMapper, load_model  # noqa: E402
from sgl_kvmap.fitting.default_pair import LARGE, SMALL, ensure_model  # noqa: E402
from sgl_kvmap.fitting.texts import prompt_of_length  # noqa: E402
from sgl_kvmap.kernels import fast_matmul_dtype  # noqa: E402
from sgl_kvmap.models.capture import run  # noqa: E402
from sgl_kvmap.sglang import PeerSettings, StorageSettings  # noqa: E402
from sgl_kvmap.sglang.launch import measured_deadline, sglang_extra_config  # noqa: E402
from sgl_kvmap.sglang.translation import hand_over_seconds  # noqa: E402

RESULTS = Path(__file__).parent / "results"
# the hand-over is timed whole: SGLang waits for it (wait_complete) and prefetches any length
UNTIMED = {"prefetch_policy": "wait_complete"}


@click.command()
@click.argument("pack", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--tokens", "lengths", multiple=True, type=int, default=(2048, 8192), show_default=True
)
@click.option("--page", default=64, show_default=True)
@click.option("--threads", default=1, show_default=True, help="torch threads while timed.")
@click.option("--prefill-up-to", default=2048, show_default=True)
@click.option(
    "--out", type=click.Path(dir_okay=False), default=str(RESULTS / "sglang_storage_speed.json")
)
def main(pack, lengths, page, threads, prefill_up_to, out) -> None:
    from sgl_kvmap.sglang.engine import Engine

    names = str(ensure_model(SMALL)), str(ensure_model(LARGE))
    small, large = load_model(names[0]), load_model(names[1])
    mapper = KVMapper.from_pretrained(pack)
    setup_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    deadline, _ = measured_deadline([pack], page_size=page)
    products = fast_matmul_dtype("cpu")
    torch.set_num_threads(setup_threads)
    rows = []
    for n in lengths:
        if n % page:
            raise click.BadParameter(f"{n} is not whole pages of {page}", param_hint="--tokens")
        prompt = prompt_of_length(large.tokenizer, n + 1).tolist()
        store = tempfile.mkdtemp(prefix="storage-speed-")
        peer = PeerSettings(names[0], str(pack))
        on = StorageSettings(
            translate=True, interface_v1=True, peers=(peer,), tail_pages=0, quality_floor=None
        )
        off = StorageSettings(interface_v1=True)
        engine = {"page_size": page, "slots": 2 * n + 2 * page, **UNTIMED}
        source = Engine(small, names[0], sglang_extra_config(off, store), **engine)
        target = Engine(large, names[1], sglang_extra_config(on, store), **engine)
        try:
            source.serve(prompt[:n])
            torch.set_num_threads(threads)
            started = time.perf_counter()
            req, _ = target.begin(prompt)
            hand_over = time.perf_counter() - started
            assert req.prefix_len == n, req.prefix_len
            assert target.storage.counters["translated_pages_delivered"] == n // page
            without_io = hand_over_seconds(mapper, n, page, threads)
            prefill = None
            if n <= prefill_up_to:
                started = time.perf_counter()
                run(large.model, torch.tensor(prompt[:n]))
                prefill = time.perf_counter() - started
        finally:
            torch.set_num_threads(setup_threads)
            source.close()
            target.close()
        rows.append(
            {
                "tokens": n,
                "hand_over_seconds": hand_over,
                "hand_over_without_io_seconds": without_io,
                "prefetch_deadline_seconds": deadline.seconds(n),
                "within_deadline": hand_over < deadline.seconds(n),
                "target_prefill_seconds": prefill,
                "prefill_over_hand_over": None if prefill is None else prefill / hand_over,
            }
        )
        print(json.dumps(rows[-1]))
    result = {
        "pack": str(pack),
        "pack_k": mapper.source_layers_per_target,
        "pack_rank": mapper.rank,
        "page_size": page,
        "threads": threads,
        "products_dtype": str(products).replace("torch.", ""),
        "cpu": platform.processor() or platform.machine(),
        "deadline": {"base": deadline.base, "per_ki_token": deadline.per_ki_token},
        "rows": rows,
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
