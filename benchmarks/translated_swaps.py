"""Scores of the swapped requests of a `sgl-kvmap bench` run that actually translated, pooled.

The summary pools every swapped request of a replay, and a swap that translated nothing scores
as re-prefill (or below it, when it reuses pages an earlier swap translated). This prints, per
translating mode and swap direction, the requests whose prompt had translated tokens: their
mean accuracy on the true continuation, the same requests re-prefilled and staying on the
source model, retention (accuracy over re-prefill's) and gap closed ((accuracy - staying) /
(re-prefill - staying)), pooled over requests; and the same for the swaps that translated
nothing.

python benchmarks/translated_swaps.py RESULTS_DIR
"""

import json
import sys
from collections import defaultdict
from pathlib import Path

DIRECTIONS = {"large": "up (small -> large)", "small": "down (large -> small)"}


def pooled(records: list[dict]) -> list[str]:
    def mean(key):
        return sum(key(r["quality"]) for r in records) / len(records)

    served = mean(lambda q: q["continuation"]["accuracy"])
    reference = mean(lambda q: q["baselines"]["reference"]["accuracy"])
    staying = mean(lambda q: q["baselines"]["source"]["accuracy"])
    gap = (served - staying) / (reference - staying) if reference > staying else float("nan")
    tokens = sum(r["reused"]["translated"] for r in records)
    cells = [len(records), f"{tokens:,}", served, reference, staying, served / reference, gap]
    return [
        c if isinstance(c, str) else (str(c) if isinstance(c, int) else f"{c:.3f}") for c in cells
    ]


def main(results: Path) -> None:
    groups = defaultdict(list)
    for line in (results / "records.jsonl").read_text().splitlines():
        record = json.loads(line)
        quality = record.get("quality") or {}
        if not record["swapped"] or record["mode"] == "reprefill" or not quality.get("baselines"):
            continue
        translated = record["reused"]["translated"] > 0
        groups[record["mode"], record["model"], translated].append(record)
    print(
        "| mode | swap | translated | requests | tokens translated | accuracy | re-prefill | "
        "staying | retention | gap closed |"
    )
    print("| --- " * 10 + "|")
    for (mode, model, translated), records in sorted(groups.items()):
        cells = [mode, DIRECTIONS[model], "yes" if translated else "no", *pooled(records)]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
