"""What one forward of the default pair's 1.5B costs on this machine, by prompt length.

A primed swap (``--sinks prime``) runs one more forward than the swap itself: its first page,
16 tokens. Where a forward's cost is mostly reading the weights (a CPU), that page costs about
what a forward of any short prompt costs; this prints the median of ``--repeats`` forwards (the
model's own, as the in-process engines run it, one logit kept) at each length, interleaved so
that drift hits every length alike.

python benchmarks/forward_cost.py [--lengths 16,64,128,440] [--repeats 3]
"""

import argparse
import statistics
import time

import torch

from sgl_kvmap.fitting.default_pair import LARGE, ensure_model
from sgl_kvmap.models.capture import load_model, run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="16,64,128,440")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    model = load_model(str(ensure_model(LARGE)))
    generator = torch.Generator().manual_seed(0)
    run(model.model, torch.randint(1000, 20000, (16,), generator=generator), logits_to_keep=1)
    times: dict[int, list[float]] = {n: [] for n in lengths}
    for _ in range(args.repeats):
        for n in lengths:
            ids = torch.randint(1000, 20000, (n,), generator=generator)
            started = time.perf_counter()
            run(model.model, ids, logits_to_keep=1)
            times[n].append(time.perf_counter() - started)
    dtype = next(model.model.parameters()).dtype
    print(f"{LARGE.name}, {dtype}, {torch.get_num_threads()} threads")
    for n in lengths:
        median = statistics.median(times[n])
        print(f"{n:6d} tokens: {median:.3f} s ({median / n * 1000:.1f} ms/token)")


if __name__ == "__main__":
    main()
