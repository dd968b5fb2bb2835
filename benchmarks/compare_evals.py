"""Paired comparison of two `sgl-kvmap eval --json` runs over the same windows.

    python benchmarks/compare_evals.py BEFORE.json AFTER.json [--condition repaired]...

Two hand-offs scored on the same held-out windows differ far less than the windows do, so
their difference is judged window by window (``evaluate.paired_difference``): for each
condition both runs scored (all of them unless --condition is given), the accuracy and NLL of
each run, the mean per-window difference AFTER - BEFORE, its standard error and its 90%
bootstrap interval. The runs must share the windows: the same count and lengths, and the same
per-window scores of the target on its own cache. Prints a markdown table; measures only.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from sgl_kvmap.fitting.evaluate import CONDITIONS, INTERVAL_LEVEL, paired_difference, window_scores


def load_run(path: Path) -> dict:
    run = json.loads(path.read_text())
    if not run.get("by_window"):
        raise click.UsageError(f"{path} has no per-window scores (`sgl-kvmap eval --json`)")
    return run


def check_same_windows(before: dict, after: dict) -> None:
    """A clear error unless both runs scored the same windows."""
    for key in ("windows", "prefix_len", "continuation"):
        if before[key] != after[key]:
            raise click.UsageError(f"the runs differ in {key}: {before[key]} vs {after[key]}")
    own = [[w["reference"] for w in run["by_window"]] for run in (before, after)]
    if own[0] != own[1]:
        raise click.UsageError("the target's own per-window scores differ: not the same windows")


def comparison_rows(before: dict, after: dict, conditions: list[str]) -> list[str]:
    rows = []
    for condition in conditions:
        cells = [condition]
        for metric in ("accuracy", "nll"):
            a, b = (window_scores(run["by_window"], condition, metric) for run in (before, after))
            d = paired_difference(a, b)
            cells += [
                f"{a.mean():.3f} -> {b.mean():.3f}",
                f"{d['mean']:+.4f} ({d['se']:.4f}; {d['low']:+.4f} to {d['high']:+.4f})",
            ]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


@click.command()
@click.argument("before", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("after", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--condition", "conditions", multiple=True, type=click.Choice(CONDITIONS))
def main(before: Path, after: Path, conditions: tuple[str, ...]) -> None:
    """Compare AFTER with BEFORE window by window."""
    runs = load_run(before), load_run(after)
    check_same_windows(*runs)
    shared = [c for c in CONDITIONS if all(c in run["by_window"][0] for run in runs)]
    wanted = [c for c in conditions if c in shared] if conditions else shared
    if not wanted:
        raise click.UsageError(f"no condition of {conditions} was scored by both runs")
    click.echo(
        f"{before.name} -> {after.name}, {runs[0]['windows']} windows; "
        f"difference: mean (SE; {INTERVAL_LEVEL:.0%} bootstrap interval)\n"
    )
    click.echo("| condition | accuracy | accuracy difference | NLL | NLL difference |")
    click.echo("| --- | --- | --- | --- | --- |")
    for row in comparison_rows(*runs, wanted):
        click.echo(row)


if __name__ == "__main__":
    main()
