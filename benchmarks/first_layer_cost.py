"""What serving the target's exact layer 0 costs a translating engine (``--first-layer exact``).

    python benchmarks/first_layer_cost.py [SOURCE TARGET] [--tokens 2048] [--text FILE]

Times, on this machine, with the thread count the caller leaves torch:
- building each model's layer-0 table (``first_layer_table``: done once when a server starts);
- reading the token ids back from the source's layer-0 values of ``--tokens`` tokens of real
  text (the source model's own forward in bfloat16, as an engine stores it): cold, the first
  time those rows are seen, and warm, the same rows again (``ExactFirstLayer`` remembers them);
- the whole ``ExactFirstLayer.overwrite`` of a run of that length, cold;
and says how many ids were read back and whether each is right.
Defaults: the embedded Qwen2.5-Coder pair (``~/.cache/sgl-kvmap/models``) and docs/LOG.md as
the text.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from sgl_kvmap.kernels import fast_matmul_dtype
from sgl_kvmap.models.capture import first_layer_kv, load_model
from sgl_kvmap.models.first_layer import ExactFirstLayer, first_layer_table, recover_token_ids

MODELS = Path.home() / ".cache" / "sgl-kvmap" / "models"
TEXT = Path(__file__).resolve().parents[1] / "docs" / "LOG.md"


def seconds(call) -> tuple[float, object]:
    started = time.perf_counter()
    out = call()
    return time.perf_counter() - started, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", nargs="?", default=str(MODELS / "qwen2.5-coder-0.5b-instruct"))
    parser.add_argument("target", nargs="?", default=str(MODELS / "qwen2.5-coder-1.5b-instruct"))
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--text", default=str(TEXT))
    args = parser.parse_args()

    built = {}
    for role, path in (("source", args.source), ("target", args.target)):
        took, built[role] = seconds(lambda path=path: first_layer_table(path))
        print(f"{role} table ({Path(path).name}): {tuple(built[role].keys.shape)}, {took:.1f} s")

    source = load_model(args.source, dtype=torch.bfloat16)
    text = Path(args.text).read_text()
    ids = source.tokenizer(text, return_tensors="pt").input_ids[0][: args.tokens]
    keys, values = first_layer_kv(source.model, ids)

    fast = fast_matmul_dtype("cpu")
    cold, read = seconds(lambda: recover_token_ids(values, built["source"], fast))
    right = int((read == ids).sum())
    wrong = int(((read >= 0) & (read != ids)).sum())
    print(
        f"read back {int((read >= 0).sum())} of {ids.numel()} ids ({right} right, {wrong} wrong): "
        f"{cold:.2f} s cold, {1e3 * cold / ids.numel():.2f} ms per token"
    )
    exact = ExactFirstLayer(built["source"], built["target"], fast)
    spec = built["target"].spec
    stored = torch.stack([keys, values])[:, :, None]  # [2, tokens, 1 layer, heads, dim]
    target = torch.zeros(2, ids.numel(), spec.num_layers, spec.num_kv_heads, spec.head_dim)
    positions = torch.arange(ids.numel())
    took, done = seconds(lambda: exact.overwrite(stored, positions, target))
    print(f"overwrite of {ids.numel()} tokens, cold: {took:.2f} s ({done} tokens exact)")
    took, _ = seconds(lambda: exact.overwrite(stored, positions, target))
    print(f"the same run again (remembered): {took:.3f} s")


if __name__ == "__main__":
    main()
