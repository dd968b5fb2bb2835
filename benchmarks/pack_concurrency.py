"""Concurrent pack writers and readers, as real processes: how many saves fail and how many
loads find something other than a whole pack.

    python benchmarks/pack_concurrency.py [--seconds 10] [--out PATH]

Two processes save two different packs (A, B) of one tiny pair over one folder as fast as they
can while two others load it, for --seconds. Uses the tests' tiny random models
(tests/conftest.py); run from the repository root. Prints each process's counts and writes
--out (default benchmarks/results/pack_concurrency.json). No asserts: benchmarks measure.
"""

import argparse
import ast
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--seconds", type=float, default=10.0)
parser.add_argument("--out", default="benchmarks/results/pack_concurrency.json")
opts = parser.parse_args()
root = Path(tempfile.mkdtemp(prefix="pack-concurrency-"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.conftest import fit_tiny_mapper, tiny_model  # noqa: E402 (after the path)

m = fit_tiny_mapper(
    tiny_model("qwen2", seed=1), tiny_model("qwen2", seed=2, layers=4, kv_heads=1, head_dim=32)
)
kw = {"overwrite": True}
a = dataclasses.replace(m, info={"metrics": {"version": "A"}})
b = dataclasses.replace(m, ridge=m.ridge * 2, info={"metrics": {"version": "B"}})
src = {n: x.save_pretrained(root / "src" / n) for n, x in [("A", a), ("B", b)]}
dest = a.save_pretrained(root / "out" / "pack")
W = f"""
import sys, time, itertools
from pathlib import Path
from sgl_kvmap.core.mapper import KVMapper
a, b, dest, go, seconds = sys.argv[1:]
ms = [KVMapper.from_pretrained(a), KVMapper.from_pretrained(b)]
print("ready", flush=True)
while not Path(go).exists(): time.sleep(0.01)
end, saves, fails = time.monotonic() + float(seconds), 0, 0
for m in itertools.cycle(ms):
    if time.monotonic() > end: break
    try:
        m.save_pretrained(dest, **{kw!r}); saves += 1
    except Exception as e:
        fails += 1
print({{"saves": saves, "failed saves": fails}})
"""
R = """
import sys, time, collections
from pathlib import Path
from sgl_kvmap.core.mapper import KVMapper
a, b, dest, go, seconds = sys.argv[1:]
print("ready", flush=True)
while not Path(go).exists(): time.sleep(0.01)
end, seen = time.monotonic() + float(seconds), collections.Counter()
while time.monotonic() < end:
    try:
        KVMapper.from_pretrained(dest); seen["whole"] += 1
    except Exception as e:
        seen[type(e).__name__ + ": " + str(e).split(":")[-1][:40]] += 1
print(dict(seen))
"""
go = root / "go"
args = [str(src["A"]), str(src["B"]), str(dest), str(go), str(opts.seconds)]
procs = [
    subprocess.Popen([sys.executable, "-c", s, *args], stdout=subprocess.PIPE, text=True)
    for s in (W, W, R, R)
]
for p in procs:
    assert p.stdout.readline().strip() == "ready"
go.touch()
results = [ast.literal_eval(p.communicate()[0].strip()) for p in procs]
report = {
    "seconds": opts.seconds,
    "writers": results[:2],
    "readers": results[2:],
    "left beside the pack": sorted(x.name for x in (root / "out").iterdir()),
}
print(json.dumps(report, indent=2))
Path(opts.out).write_text(json.dumps(report, indent=2) + "\n")
