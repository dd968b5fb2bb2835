"""One swapped request of a `sgl-kvmap bench` run, rebuilt in the library: how its score on the
true continuation moves with the span of its prompt that is translated.

    python benchmarks/translated_span.py RESULTS_DIR --request N --pack PACK [--opening 64]
        [--end T]... [--exact-first-layer] [--source-bf16] [--matmul float32|bfloat16]

The request's prompt and continuation are rebuilt from the run's own workload settings
(run.json). The target's cache is composed as a served swap composes it: its own KV for the
first ``--opening`` tokens (the warm opening, computed by the target over them), then the
pack's map of the source's KV for tokens [opening, end) (the source computing the prompt, as
the sending engine did; its layer 0 mapped, as KVMapStorage's ``sinks: translate`` serves it,
unless ``--exact-first-layer``), then the target computing the rest of the prompt over it (the
tail and the new tokens) and the continuation teacher-forced. ``end`` = ``opening`` is the
target's own re-prefill. Scores are top-1 accuracy and mean NLL (nats/token) of the
continuation, as the benchmark scores a swap. The library computes in float32 unless
``--source-bf16`` rounds the source's KV to bfloat16 (as the engines' pools keep it) and
``--matmul bfloat16`` runs the map's products in bfloat16 (as a CPU engine with fast bfloat16
does).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sgl_kvmap import KVMapper, load_model  # noqa: E402
from sgl_kvmap.bench.workload import WorkloadConfig, load_workload  # noqa: E402
from sgl_kvmap.core.cache import KVCache  # noqa: E402
from sgl_kvmap.models.capture import run  # noqa: E402
from sgl_kvmap.models.transfer import mapped_prefix  # noqa: E402


def composed_cache(own: KVCache, translated: KVCache) -> KVCache:
    """``own`` (the target's first tokens) followed by ``translated`` (the next ones)."""
    return KVCache(
        [torch.cat(pair) for pair in zip(own.keys, translated.keys)],
        [torch.cat(pair) for pair in zip(own.values, translated.values)],
        torch.cat((own.positions, translated.positions)),
    )


def scores_after(target, cache: KVCache, rest: torch.Tensor, continuation: torch.Tensor):
    """Top-1 accuracy and mean NLL of ``continuation`` when the target computes ``rest`` and the
    continuation (teacher-forced) over ``cache``."""
    tokens = torch.cat((rest, continuation[:-1]))
    logits = run(target, tokens, past=cache, logits_to_keep=continuation.numel()).logits
    accuracy = (logits.argmax(-1) == continuation).float().mean().item()
    return accuracy, F.cross_entropy(logits, continuation).item()


@click.command()
@click.argument("results", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--request", type=int, required=True, help="The request's index in the run.")
@click.option("--pack", type=click.Path(exists=True, file_okay=False), required=True)
@click.option("--opening", type=int, default=64, show_default=True)
@click.option("--end", "ends", type=int, multiple=True, help="Where translation stops.")
@click.option("--exact-first-layer", is_flag=True, help="The target's own layer 0.")
@click.option("--source-bf16", is_flag=True, help="The source's KV rounded to bfloat16.")
@click.option("--matmul", type=click.Choice(["float32", "bfloat16"]), default="float32")
@torch.no_grad()
def main(
    results: Path, request: int, pack: str, opening: int, ends, exact_first_layer, source_bf16,
    matmul,
) -> None:  # fmt: skip
    header = json.loads((results / "run.json").read_text())
    models = dict(part.split(" ", 1) for part in header["models"].split(", "))
    mapper = KVMapper.from_pretrained(pack)
    source, target = load_model(models["small"]), load_model(models["large"])
    turns = load_workload(WorkloadConfig(**header["config"]["workload"]), target.tokenizer)
    turn = turns[request]
    prompt, continuation = torch.tensor(turn.tokens), torch.tensor(turn.continuation)
    print(f"request {request}: {prompt.numel()} prompt tokens, {continuation.numel()} scored")
    own = run(target.model, prompt[:opening]).cache
    source_cache = run(source.model, prompt).cache
    if source_bf16:
        source_cache = KVCache(
            [k.bfloat16().float() for k in source_cache.keys],
            [v.bfloat16().float() for v in source_cache.values],
            source_cache.positions,
        )
    for end in sorted({opening, *ends}):
        cache = own
        if end > opening:
            span = source_cache.slice(opening, end)
            tokens = prompt[opening:end]
            if exact_first_layer:
                mapped = mapped_prefix(mapper, span, tokens, target.model)
            else:  # layer 0 mapped too, as KVMapStorage serves it
                mapped = mapper.map(span, getattr(torch, matmul))
            cache = composed_cache(own, mapped)
        accuracy, nll = scores_after(target.model, cache, prompt[end:], continuation)
        label = "re-prefill" if end == opening else f"tokens {opening}-{end} translated"
        print(f"{label:>32}: accuracy {accuracy:.3f}, NLL {nll:.3f}")


if __name__ == "__main__":
    main()
