"""Each anchor choice on one pack, as `sgl-kvmap eval PACK --windows 16 --anchors 240 --tail 32
--anchor-choice X --json` computes it (the same library calls), in ONE process: the models load
once and their own passes over the 16 windows are shared (EvalRuns), then each choice's hand-off
is timed at 2,048 tokens (time_choices.measure).

python run_choices.py PACK OUTDIR [CHOICE...]
"""

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from time_choices import measure  # noqa: E402

from sgl_kvmap.core.mapper import KVMapper  # noqa: E402
from sgl_kvmap.fitting.config import EvalConfig  # noqa: E402
from sgl_kvmap.fitting.evaluate import EvalRuns, evaluate  # noqa: E402
from sgl_kvmap.fitting.texts import default_eval_files, eval_windows, prompt_of_length  # noqa: E402
from sgl_kvmap.models.capture import load_models_for  # noqa: E402
from sgl_kvmap.models.transfer import ANCHOR_CHOICES, Repair  # noqa: E402

WINDOWS, ANCHORS, TAIL = 16, 240, 32


def write(path: Path, data) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.rename(path)


def main(pack, out, choices):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    mapper = KVMapper.from_pretrained(pack)
    source, target = load_models_for(mapper)
    config = EvalConfig()
    windows = eval_windows(
        target.tokenizer, default_eval_files(), config.prefix_len + config.continuation, WINDOWS
    )
    runs = EvalRuns(windows, config.prefix_len, config.continuation)
    for choice in choices:
        if (out / f"{choice}.json").exists():
            continue
        start = time.time()
        report = evaluate(
            mapper,
            source,
            target,
            windows,
            config.prefix_len,
            config.continuation,
            TAIL,
            runs=runs,
            repair=Repair(ANCHORS, choice=choice),
        )
        result = report.to_dict()
        result["wall_seconds"] = time.time() - start
        write(out / f"{choice}.json", result)
        print(time.strftime("%T"), choice, report.repaired, flush=True)
    del runs
    if not (out / "times.json").exists():
        ids = prompt_of_length(target.tokenizer, 2048)
        write(out / "times.json", measure(mapper, source, target, ids))
        print(time.strftime("%T"), "timed", flush=True)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main(sys.argv[1], sys.argv[2], sys.argv[3:] or ANCHOR_CHOICES)
