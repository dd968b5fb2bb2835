"""Translate a prefix vs re-prefill it with the target, side by side in one run.

    python benchmarks/translate_speed.py PACK [PACK ...] [--tokens 512 --tokens 2048]
        [--dtype float32|bfloat16]

For each pack (e.g. the two written by `sgl-kvmap demo`), loads its source and target from
the paths recorded in the pack, and times at each prefix length: the mapper (unrope, matrix
products, rope), the target's forward over its sink tokens, and the target's own prefill, with
both models (and so the caches and the map's matrix products) in --dtype.
Prints a table; writes benchmarks/results/translate_speed.json (translate_speed_bfloat16.json
for bfloat16). No asserts: benchmarks measure.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import click
import torch

from sgl_kvmap import KVMapper, load_model
from sgl_kvmap.texts import prompt_of_length
from sgl_kvmap.timing import measure_speed

RESULTS = Path(__file__).parent / "results"


@click.command()
@click.argument("packs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
@click.option(
    "--tokens", "token_counts", multiple=True, type=int, default=[512, 2048], show_default=True
)
@click.option("--repeats", default=3, show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32")
def main(packs, token_counts, repeats, dtype) -> None:
    rows = []
    for pack in packs:
        mapper = KVMapper.from_pretrained(pack)
        source, target = (
            load_model(spec.model_id, dtype=getattr(torch, dtype))
            for spec in (mapper.source, mapper.target)
        )
        for tokens in token_counts:
            speed = measure_speed(
                mapper, source, target, prompt_of_length(target.tokenizer, tokens), repeats
            )
            rows.append(
                {
                    "pack": str(pack),
                    "dtype": dtype,
                    "k": mapper.k,
                    "sink_tokens": mapper.sink_tokens,
                    **speed.to_dict(),
                }
            )
            print(
                f"{Path(pack).name:<16} {dtype} k={mapper.k:<3} {tokens:>6} tokens: "
                f"map {speed.map_seconds:.3f} s, sinks {speed.sink_seconds:.3f} s, "
                f"hand-off {speed.handoff_seconds:.3f} s, "
                f"re-prefill {speed.prefill_seconds:.2f} s; "
                f"speedup: map {speed.map_speedup:.1f}x, map+sinks {speed.speedup:.1f}x, "
                f"end-to-end {speed.end_to_end_speedup:.1f}x"
            )
        del source, target
    meta = {
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    path = RESULTS / (
        "translate_speed.json" if dtype == "float32" else f"translate_speed_{dtype}.json"
    )
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
