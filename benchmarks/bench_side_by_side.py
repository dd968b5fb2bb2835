"""Two `sgl-kvmap bench` runs of one trace side by side, replay by replay (e.g. the file store and
Mooncake at the same settings): tokens reused per tier and computed, how many requests reused the
same tokens from every tier in both runs, fallbacks by reason, and median time to first token
over all requests and over those that read the store (storage or translated tokens).

python benchmarks/bench_side_by_side.py RUN_DIR RUN_DIR
"""

import json
import statistics
import sys
from collections import Counter
from pathlib import Path

TIERS = ("device", "host", "storage", "translated")


def replays(run: Path) -> dict:
    """The run's records by (policy, mode), in request order."""
    out = {}
    for line in (run / "records.jsonl").read_text().splitlines():
        record = json.loads(line)
        out.setdefault((record["policy"], record["mode"]), []).append(record)
    return out


def median_ms(records: list[dict]) -> str:
    times = [r["ttft_s"] for r in records]
    return f"{1000 * statistics.median(times):.0f}" if times else "-"


def cells(records: list[dict]) -> list[str]:
    tiers = [f"{sum(r['reused'][t] for r in records):,}" for t in TIERS]
    computed = f"{sum(r['computed'] for r in records):,}"
    fallbacks = Counter()
    for record in records:
        fallbacks.update(record["fallbacks"])
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(fallbacks.items())) or "none"
    stored = [r for r in records if r["reused"]["storage"] + r["reused"]["translated"]]
    return [*tiers, computed, reasons, median_ms(records), f"{median_ms(stored)} ({len(stored)})"]


def main(a: Path, b: Path) -> None:
    runs = {a: replays(a), b: replays(b)}
    print(
        "| replay | run | device | host | storage | translated | computed | fallbacks | "
        "TTFT median (ms) | TTFT median, read the store (ms, requests) | same tokens per tier |"
    )
    print("| --- " * 11 + "|")
    for key in runs[a]:
        left, right = runs[a][key], runs[b].get(key, [])
        same = sum(x["reused"] == y["reused"] for x, y in zip(left, right))
        for run, records in ((a, left), (b, right)):
            row = [" ".join(key), run.name, *cells(records), f"{same} of {len(left)}"]
            print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
