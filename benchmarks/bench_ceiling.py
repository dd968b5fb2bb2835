"""How much prefill a translating mode of `sgl-kvmap bench` could save at best, per policy.

For the swapped requests of each policy's re-prefill replay: the tokens re-prefill computed,
and the tokens a swap would still compute if every token of the request's ideal reuse (the
longest page-aligned prefix some engine computed before) were reused, with and without the
``tail`` mode's recomputed pages (a tail only where something must be translated). Prints
one row per policy with each translating mode's measured saving beside the ceilings: a TTFT
ratio near 0.5 needs about half the prefill saved.

python benchmarks/bench_ceiling.py RESULTS_DIR [--tail-tokens 64]
"""

import argparse
import json
from collections import defaultdict
from pathlib import Path


def best_computed(record: dict, tail_tokens: int) -> int:
    """Tokens a swap computes at best: the prompt less its ideal reuse, plus the tail where
    part of that reuse must be translated (what re-prefill did not find cached), at most the
    translated part."""
    translated = record["ideal_reuse_tokens"] - sum(record["reused"].values())
    rest = record["prompt_tokens"] - record["ideal_reuse_tokens"]
    return rest + min(tail_tokens, max(translated, 0))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("results", type=Path)
    parser.add_argument("--tail-tokens", type=int, default=64)
    args = parser.parse_args()
    replays = defaultdict(dict)
    for line in (args.results / "records.jsonl").read_text().splitlines():
        record = json.loads(line)
        replays[record["policy"], record["mode"]][record["request"]] = record
    modes = sorted({mode for _, mode in replays if mode != "reprefill"})
    print(
        "| policy | swapped | re-prefill computed | ceiling, no tail | ceiling, tail | "
        + " | ".join(f"measured: {m}" for m in modes)
        + " |"
    )
    print("| --- " * (5 + len(modes)) + "|")
    for (policy, mode), reference in sorted(replays.items()):
        swapped = [r for r in reference.values() if r["swapped"]]
        if mode != "reprefill" or not swapped:
            continue
        computed = sum(r["computed"] for r in swapped)
        ceilings = [
            1 - sum(best_computed(r, t) for r in swapped) / computed for t in (0, args.tail_tokens)
        ]
        measured = [
            1 - sum(replays[policy, m][r["request"]]["computed"] for r in swapped) / computed
            for m in modes
        ]
        cells = [policy, str(len(swapped)), f"{computed:,}", *(f"{c:.1%}" for c in ceilings)]
        print("| " + " | ".join(cells + [f"{m:.1%}" for m in measured]) + " |")


if __name__ == "__main__":
    main()
