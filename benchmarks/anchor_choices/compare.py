# ruff: noqa: E501 - one printed line per choice, as the LOG's table reads it
"""Table rows: each choice's repaired accuracy, retention and gap closed with intervals, and
its paired difference from the draft.

python compare.py DIR  (reads DIR/{draft,source_prompt,target_tail,recent}.json, DIR/times.json)
"""

import json
import sys
from pathlib import Path

from sgl_kvmap.fitting.evaluate import paired_difference, window_scores

CHOICES = ("draft", "source_prompt", "target_tail", "recent")


def main(folder):
    folder = Path(folder)
    reports = {
        c: json.loads((folder / f"{c}.json").read_text())
        for c in CHOICES
        if (folder / f"{c}.json").exists()
    }
    times = (
        json.loads((folder / "times.json").read_text()) if (folder / "times.json").exists() else {}
    )
    base = window_scores(reports["draft"]["by_window"], "repaired")
    out = {}
    first = next(iter(reports.values()))
    iv = first["intervals"]
    print(
        f"reference {first['reference']['accuracy']:.4f} source {first['source']['accuracy']:.4f} "
        f"mapped {first['mapped']['accuracy']:.4f} tail {first['mapped_tail']['accuracy']:.4f} "
        f"ret_tail {first['retention_tail']:.4f} {iv['retention_tail']} gap_tail {first['gap_closed_tail']} {iv['gap_closed_tail']} no_prefix {first['no_prefix']['accuracy']:.4f}"
    )
    for c, r in reports.items():
        scores = window_scores(r["by_window"], "repaired")
        diff = paired_difference(base, scores)
        nll = paired_difference(
            window_scores(reports["draft"]["by_window"], "repaired", "nll"),
            window_scores(r["by_window"], "repaired", "nll"),
        )
        vs_tail = paired_difference(window_scores(r["by_window"], "mapped_tail"), scores)
        iv = r["intervals"]
        t = times.get(c, {})
        out[c] = dict(
            acc=r["repaired"]["accuracy"],
            nll=r["repaired"]["nll"],
            ret=r["retention_repaired"],
            ret_iv=iv["retention_repaired"],
            gap=r["gap_closed_repaired"],
            gap_iv=iv["gap_closed_repaired"],
            vs_draft=diff,
            nll_vs_draft=nll,
            vs_tail=vs_tail,
            repair=r["repair"],
            time=t,
        )
        gap = r["gap_closed_repaired"]
        print(
            f"{c:14s} acc {r['repaired']['accuracy']:.4f} nll {r['repaired']['nll']:.3f} ret {r['retention_repaired']:.4f} "
            f"[{iv['retention_repaired'][0]:.3f}, {iv['retention_repaired'][1]:.3f}] gap {gap if gap is None else round(gap, 3)} {iv['gap_closed_repaired']} "
            f"vs draft {diff['mean']:+.4f} (SE {diff['se']:.4f}; {diff['low']:+.4f} to {diff['high']:+.4f}) "
            f"nll vs draft {nll['mean']:+.4f} ({nll['low']:+.4f} to {nll['high']:+.4f}) "
            f"vs tail {vs_tail['mean']:+.4f} ({vs_tail['low']:+.4f} to {vs_tail['high']:+.4f}) time {t}"
        )
    (folder / "compare.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main(sys.argv[1])
