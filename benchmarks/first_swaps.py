"""How many swaps of a `sgl-kvmap bench` run translated anything, first swaps apart.

A session's first swap into a model is the one whose first page that model never served for
the session (without a shared opening: the case priming is for). This prints, per translating
mode and swap direction, over every policy of the run: the first swaps into each model and how
many translated something, every swap and how many translated, the tokens translated and the
first-page tokens primed.

python benchmarks/first_swaps.py RESULTS_DIR
"""

import json
import sys
from collections import defaultdict
from pathlib import Path

DIRECTIONS = {"large": "up (small -> large)", "small": "down (large -> small)"}


def main(results: Path) -> None:
    records = [json.loads(line) for line in (results / "records.jsonl").read_text().splitlines()]
    seen, rows = set(), defaultdict(lambda: defaultdict(int))
    for r in records:
        if not r["swapped"] or r["mode"] == "reprefill":
            continue
        row = rows[r["mode"], r["model"]]
        translated = r["reused"]["translated"] > 0
        first = (r["policy"], r["mode"], r["session"], r["model"]) not in seen
        seen.add((r["policy"], r["mode"], r["session"], r["model"]))
        row["first"] += first
        row["first translated"] += first and translated
        row["swaps"] += 1
        row["translated"] += translated
        row["tokens"] += r["reused"]["translated"]
        row["primed"] += r.get("primed", 0)
    print(
        "| mode | swap | first swaps translated | swaps translated | tokens translated | primed |"
    )
    print("| --- " * 6 + "|")
    for (mode, model), row in sorted(rows.items()):
        first = f"{row['first translated']} of {row['first']}"
        every = f"{row['translated']} of {row['swaps']}"
        cells = [mode, DIRECTIONS[model], first, every, f"{row['tokens']:,}", f"{row['primed']:,}"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
