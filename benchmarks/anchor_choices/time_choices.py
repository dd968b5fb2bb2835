"""Time each anchor choice's hand-off at a prompt of N tokens (medians of 3), beside re-prefill.

python time_choices.py PACK [TOKENS] > times.json
"""

import json
import sys

import torch

from sgl_kvmap.core.mapper import KVMapper
from sgl_kvmap.fitting.texts import prompt_of_length
from sgl_kvmap.models.capture import capture_kv, forward_scattered, load_models_for, run
from sgl_kvmap.models.timing import median_seconds
from sgl_kvmap.models.transfer import (
    ANCHOR_CHOICES,
    Repair,
    handoff,
    handoff_positions,
    handoff_split,
    mapped_prefix,
    pick_anchors,
)

TAIL, ANCHORS, REPEATS = 32, 240, 3


def timed(fn, repeats=REPEATS):
    return median_seconds(fn, repeats)


def main(pack, tokens):
    torch.set_grad_enabled(False)
    mapper = KVMapper.from_pretrained(pack)
    source, target = load_models_for(mapper)
    print(
        json.dumps(
            measure(mapper, source, target, prompt_of_length(target.tokenizer, tokens)), indent=2
        )
    )


def measure(mapper, source, target, ids):
    split = handoff_split(ids.numel(), TAIL)
    cache = capture_kv(source.model, ids[:split])
    out = {"tokens": ids.numel(), "tail": TAIL, "anchors": ANCHORS, "repeats": REPEATS}
    run(target.model, ids, logits_to_keep=1)  # warm-up
    out["prefill_seconds"] = timed(lambda: run(target.model, ids, logits_to_keep=1), 2)
    mapped = mapped_prefix(mapper, cache, ids[:split], target.model)
    out["map_seconds"] = timed(lambda: mapped_prefix(mapper, cache, ids[:split], target.model))
    plain = handoff_positions(ids.numel(), TAIL, mapper.sink_tokens)
    out["tail_only_forward_seconds"] = timed(
        lambda: forward_scattered(target.model, mapped, ids, plain, 1)
    )
    for choice in ANCHOR_CHOICES:
        repair = Repair(ANCHORS, choice=choice)
        pick = lambda repair=repair: pick_anchors(  # noqa: E731
            repair, mapper, cache, ids, TAIL, source.model, target.model, mapped
        )
        anchors = pick()
        positions = handoff_positions(ids.numel(), TAIL, mapper.sink_tokens, anchors)
        row = {
            "choice_seconds": timed(pick),
            "handoff_forward_seconds": timed(
                lambda positions=positions: forward_scattered(
                    target.model, mapped, ids, positions, 1
                )
            ),
            "handoff_seconds": timed(
                lambda repair=repair: handoff(
                    mapper, cache, ids, target.model, TAIL, repair, source.model
                )
            ),
        }
        row["x_under_prefill"] = out["prefill_seconds"] / row["handoff_seconds"]
        out[choice] = row
        print(choice, row, file=sys.stderr, flush=True)
    return out


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2048)
