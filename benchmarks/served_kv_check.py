"""The default bench's alternate replay in the translated mode, each up swap that translated
checked against the library (in-process engines, the registry's packs).

    python benchmarks/served_kv_check.py [timeout|wait] [native|translate]

Per request: its served score on the true continuation; the sending 0.5B engine's held KV for
the translated tokens against a fresh float32 forward of the 0.5B (max abs difference, keys and
values); the 1.5B's served KV for them against the pack's map of that held KV (bf16 products,
as the engine runs it) and of the fresh KV; and the library's score when the 1.5B computes the
rest of the prompt itself over its own opening plus the map of the held (or fresh) KV
(``translated_span.composed_cache``), and over the receiving engine's own pool for the
tokens before the translated ones with the map of the held KV after them; and how far that
pool's KV for those first tokens is from the 1.5B's own forward (a warm opening the engine
translated instead of computing shows here: docs/LOG.md, 2026-12-07). ``wait``: SGLang's
wait_complete policy instead of the timeout policy with the deadline measured on the
reference machine. ``translate``: the engines may translate a prefix's first page (the
default before 2026-12-07), so the 1.5B engine translates the warm opening the 0.5B stored.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from translated_span import composed_cache, scores_after

from sgl_kvmap import KVMapper, load_model
from sgl_kvmap.bench.replay import Deployment, replay
from sgl_kvmap.bench.run import BenchConfig, pair_and_packs, plan
from sgl_kvmap.bench.workload import load_workload, shared_opening
from sgl_kvmap.core.cache import KVCache
from sgl_kvmap.kernels import fast_matmul_dtype
from sgl_kvmap.models.capture import run
from sgl_kvmap.sglang.launch import PrefetchDeadline

policy = sys.argv[1] if len(sys.argv) > 1 else "timeout"
sinks = sys.argv[2] if len(sys.argv) > 2 else "native"
names, packs = pair_and_packs()
models = {role: load_model(path) for role, path in names.items()}
deployment = Deployment(models, names, packs)
config = BenchConfig(policies=("alternate",), modes=("translated",))
turns = load_workload(config.workload, models["large"].tokenizer)
((replay_plan, _),) = plan(turns, config)
deadline = (
    PrefetchDeadline("wait_complete")
    if policy == "wait"
    else PrefetchDeadline(base=1.0, per_ki_token=1.007)
)
opening = shared_opening(turns, config.workload.page_size)
mapper = KVMapper.from_pretrained(packs["small", "large"])
common = dict(
    quality_tokens=8,
    deadline=deadline,
    overrides={"quality_floor": None, "sinks": sinks},
    opening=opening,
)
replay(deployment, replay_plan, "reprefill", **common)


def check(engines, i, slots, record):
    n = record.reused["translated"]
    if not n or record.model != "large":
        return
    start = record.prompt_tokens - record.computed - n
    sender = "small"
    tokens = list(turns[i].tokens[: start + n])
    stored = engines[sender].cached_slots(tokens)
    held = engines[sender].pool_kv(stored[start:]) if len(stored) >= start + n else None
    fresh = run(models["small"].model, torch.tensor(tokens)).cache.slice(start, start + n)
    got = engines["large"].pool_kv(slots[start : start + n])
    served = record.quality.continuation
    line = f"req {i} start {start} n {n} acc {served.accuracy:.3f} nll {served.nll:.3f}"
    if held is not None:
        src_err = max(
            (h.float() - f.to(h.dtype).float()).abs().max().item()
            for h, f in zip(held.keys, fresh.keys)
        )
        sent = KVCache(held.keys, held.values, torch.arange(start, start + n))
        want = mapper.map(sent, fast_matmul_dtype("cpu"))
        map_err = max(
            (g.float() - w.float()).abs().max().item()
            for g, w in zip(got.keys + got.values, want.keys + want.values)
        )
        line += (
            f" | held vs fresh source K max {src_err:.3g} | served vs map(held) max {map_err:.3g}"
        )
    else:
        line += f" | sender holds {len(stored)} of {start + n}"
    want_fresh = mapper.map(KVCache(fresh.keys, fresh.values, torch.arange(start, start + n)))
    ferr = max(
        (g.float() - w.to(g.dtype).float()).abs().max().item()
        for g, w in zip(got.keys, want_fresh.keys)
    )
    line += f" | served vs map(fresh) K max {ferr:.3g}"
    if held is not None:
        verr = max(
            (h.float() - f.to(h.dtype).float()).abs().max().item()
            for h, f in zip(held.values, fresh.values)
        )
        line += f" | held vs fresh V max {verr:.3g}"

        own = run(models["large"].model, torch.tensor(tokens[:start])).cache
        pooled = engines["large"].pool_kv(slots[:start])
        pooled = KVCache(
            [k.float() for k in pooled.keys], [v.float() for v in pooled.values], own.positions
        )
        cont = torch.tensor(turns[i].continuation)
        rest = torch.tensor(turns[i].tokens[start + n :])
        for label, kv in (("held", held), ("fresh", fresh)):
            src = KVCache(
                [k.float() for k in kv.keys],
                [v.float() for v in kv.values],
                torch.arange(start, start + n),
            )
            acc, nll = scores_after(
                models["large"].model, composed_cache(own, mapper.map(src)), rest, cont
            )
            line += f" | library over {label}: {acc:.3f} {nll:.3f}"
            if label == "held":
                composed = composed_cache(pooled, mapper.map(src))
                acc, nll = scores_after(models["large"].model, composed, rest, cont)
                line += f" | the engine's first tokens + map(held): {acc:.3f} {nll:.3f}"
        opening = max((p - o).abs().max().item() for p, o in zip(pooled.keys, own.keys))
        line += f" | the engine's first tokens vs its own forward, K max {opening:.3g}"
    print(line, flush=True)


replay(deployment, replay_plan, "translated", inspect=check, **common)
