"""Translate a prefix vs re-prefill it with the target, side by side in one run.

    python benchmarks/translate_speed.py PACK [PACK ...] [--tokens 512 --tokens 2048]
        [--dtype float32|bfloat16] [--tail 0] [--repair ANCHORS:DRAFT[:SWEEPS] ...] [--out PATH]

For each pack (e.g. the two written by `sgl-kvmap demo`), loads its source and target from
the paths recorded in the pack, and times at each prefix length: the mapper (unrope, matrix
products, rope), the target's forward over its sink tokens, and the target's own prefill, with
both models (and so the caches and the map's matrix products) in --dtype. Each --repair also
times that hand-off repair (the source's draft, the target's forward over the anchors, the
--tail and the sinks) against the same re-prefill, so draft variants compare side by side.
Prints a table; writes --out (default benchmarks/results/translate_speed.json, or
translate_speed_bfloat16.json for bfloat16). No asserts: benchmarks measure.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import click
import torch
from fidelity import RepairType

from sgl_kvmap import KVMapper, load_model
from sgl_kvmap.fitting.texts import prompt_of_length
from sgl_kvmap.models.timing import measure_speed

RESULTS = Path(__file__).parent / "results"


@click.command()
@click.argument("packs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
@click.option(
    "--tokens", "token_counts", multiple=True, type=int, default=[512, 2048], show_default=True
)
@click.option("--repeats", default=3, show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32")
@click.option("--tail", default=0, show_default=True, help="Tail of the repaired hand-offs.")
@click.option(
    "--repair",
    "repairs",
    multiple=True,
    type=RepairType(),
    help="Also time this hand-off repair, ANCHORS:DRAFT[:SWEEPS] (repeatable).",
)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(packs, token_counts, repeats, dtype, tail, repairs, out) -> None:
    rows = []
    for pack in packs:
        mapper = KVMapper.from_pretrained(pack)
        source, target = (
            load_model(spec.model_id, dtype=getattr(torch, dtype))
            for spec in (mapper.source, mapper.target)
        )
        for tokens in token_counts:
            prompt, prefill = prompt_of_length(target.tokenizer, tokens), None
            for repair in (None, *repairs):
                speed = measure_speed(
                    mapper,
                    source,
                    target,
                    prompt,
                    repeats,
                    tail=0 if repair is None else tail,
                    prefill_seconds=prefill,
                    repair=repair,
                )
                prefill = speed.prefill_seconds  # one re-prefill timing for every variant
                rows.append(
                    {
                        "pack": str(pack),
                        "dtype": dtype,
                        "k": mapper.source_layers_per_target,
                        "sink_tokens": mapper.sink_tokens,
                        "repair": None if repair is None else str(repair),
                        **speed.to_dict(),
                    }
                )
                k = mapper.source_layers_per_target
                print(f"{Path(pack).name:<16} {dtype} k={k:<3} {speed.line()}")
                if repair is not None:
                    print(f"    {repair}: draft {speed.draft_seconds:.3f} s")
        del source, target
    meta = {
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    path = out or RESULTS / (
        "translate_speed.json" if dtype == "float32" else f"translate_speed_{dtype}.json"
    )
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
