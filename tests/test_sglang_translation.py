"""One run of pages translated as a KVMapStorage worker does (sgl_kvmap/sglang/translation.py)."""

from __future__ import annotations

import torch

from sgl_kvmap.core.cache import KVCache
from sgl_kvmap.kernels import fast_matmul_dtype
from sgl_kvmap.sglang.pages import PageFormat
from sgl_kvmap.sglang.translation import staging, translate_run

from .conftest import fit_tiny_mapper


def test_a_run_translates_at_its_positions_and_reuses_the_workers_buffers(tiny_pair):
    """Pages out equal the pack's map of the run at its true positions; a second run on the
    same thread stages in the same buffer, and the first run's pages are not overwritten."""
    mapper = fit_tiny_mapper(*tiny_pair)
    source, target = mapper.source, mapper.target
    page = PageFormat("page_first", 8, target.num_layers, target.num_kv_heads, target.head_dim,
                      torch.bfloat16)  # fmt: skip
    run = torch.randn(2, 16, source.num_layers, source.num_kv_heads, source.head_dim)
    first, exact = translate_run(mapper, run, 24, page)
    assert exact == 0  # layer 0 mapped: no first-layer tables given
    kept = [p.clone() for p in first]
    buffer = staging("result", (1,), torch.bfloat16).data_ptr()
    translate_run(mapper, torch.randn_like(run), 0, page)
    assert staging("result", (1,), torch.bfloat16).data_ptr() == buffer
    assert all(torch.equal(a, b) for a, b in zip(first, kept))
    cache = KVCache(list(run[0].unbind(1)), list(run[1].unbind(1)), torch.arange(24, 40))
    want = mapper.map(cache, fast_matmul_dtype("cpu"))
    got = torch.cat([page.to_tokens(p) for p in first], dim=1)
    for layer in range(target.num_layers):
        torch.testing.assert_close(got[0, :, layer], want.keys[layer].bfloat16(), rtol=0, atol=0)
        torch.testing.assert_close(got[1, :, layer], want.values[layer].bfloat16(), rtol=0, atol=0)


def test_the_hand_over_is_timed_with_as_many_swaps_at_once_as_an_engine_runs(
    tiny_pair, monkeypatch
):
    """``hand_over_seconds(concurrent=3)``: every timed round translates three swaps at once,
    each on a thread of its own, as KVMapStorage's workers do."""
    import threading

    import sgl_kvmap.sglang.translation as translation

    mapper = fit_tiny_mapper(*tiny_pair)
    calls, original = [], translation.translate_run
    monkeypatch.setattr(
        translation,
        "translate_run",
        lambda *a, **k: calls.append(threading.get_ident()) or original(*a, **k),
    )
    assert translation.hand_over_seconds(mapper, 64, page_size=8, concurrent=3) > 0
    assert len(calls) == 3 * 3  # the warm-up and two timed rounds
    assert len(set(calls)) == 3


def test_workers_translating_at_once_from_a_fresh_process(tiny_pair, tmp_path):
    """The first translations of a process, four at once on worker threads (an engine's first
    swaps): the rotary tables they build, and transformers' lazy imports behind them, are
    built once, under a lock (racing them failed with an ImportError)."""
    import subprocess
    import sys

    pack = fit_tiny_mapper(*tiny_pair).save_pretrained(tmp_path / "pack")
    code = (
        "from sgl_kvmap.core.mapper import KVMapper\n"
        "from sgl_kvmap.sglang.translation import hand_over_seconds\n"
        f"mapper = KVMapper.from_pretrained({str(pack)!r})\n"
        "print(hand_over_seconds(mapper, 64, page_size=8, concurrent=4))\n"
    )
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert float(ran.stdout.split()[-1]) > 0
