"""How long KVMapStorage's Mooncake keyspace takes to read one page, beside a file read of the same
bytes: a local ``mooncake_master`` (sgl_kvmap.sglang.mooncake_master), one client in this process
mounting the segment, PAGES pages of one 64-token bf16 page of Qwen2.5-Coder-0.5B (24 layers x 2
KV heads x 64: 786,432 bytes) stored, then each read REPEATS times into one buffer.

python benchmarks/mooncake_page_speed.py
"""

import os
import tempfile
import time
from pathlib import Path

import torch

from sgl_kvmap.sglang.mooncake_master import Master, library_env

PAGE_BYTES = 2 * 64 * 24 * 2 * 64 * 2
PAGES, REPEATS = 20, 3


def per_page_ms(read, keys) -> float:
    started = time.perf_counter()
    for _ in range(REPEATS):
        for key in keys:
            read(key)
    return 1000 * (time.perf_counter() - started) / (REPEATS * len(keys))


def main() -> None:
    os.environ.update(library_env())
    from sgl_kvmap.sglang.mooncake import Keyspace, load_client

    page = torch.randn(PAGE_BYTES // 2).to(torch.bfloat16)
    out = torch.empty_like(page)
    keys = [f"page{i}" for i in range(PAGES)]
    with tempfile.TemporaryDirectory() as folder, Master(Path(folder) / "master.log") as master:
        client = load_client()()
        setup = ("127.0.0.1", master.metadata, 256 << 20, 16 << 20, "tcp", "", master.address)
        assert client.setup(*setup) == 0
        keyspace = Keyspace(client, "model", 0)
        assert keyspace.batch_set(keys, [page] * PAGES)
        mooncake = per_page_ms(lambda key: keyspace.get(key, out), keys)
        exists = per_page_ms(lambda key: keyspace.batch_exists([key]), keys)
        for key in keys:
            (Path(folder) / key).write_bytes(page.view(torch.uint8).numpy().tobytes())
        flat = out.view(torch.uint8).numpy()

        def read_file(key):
            flat[:] = torch.frombuffer(
                bytearray((Path(folder) / key).read_bytes()), dtype=torch.uint8
            )

        files = per_page_ms(read_file, keys)
        client.close()
    print(f"page of {PAGE_BYTES:,} bytes: Mooncake get {mooncake:.2f} ms, exists {exists:.3f} ms")
    print(f"file read {files:.2f} ms")


if __name__ == "__main__":
    main()
