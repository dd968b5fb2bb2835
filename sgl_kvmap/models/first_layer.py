"""A model's exact layer 0 for pages that arrive without their token ids.

Layer 0's keys (before RoPE) and values depend on the token alone: embedding, norm, projection,
no context. A table of them over the whole vocabulary (``first_layer_table``) therefore gives
a model's exact layer 0 for any token at any position, keys rotated there
(``first_layer_at``). A served engine's storage backend sees a peer's stored KV but never the
token ids behind it; the peer model's own table reads them back from that KV
(``recover_token_ids``: the nearest row of layer-0 values, kept only where it is clearly the
nearest), and ``ExactFirstLayer`` puts the target's exact layer 0 in place of the mapped one
for every token it read back. The library's hand-off does the same from the token ids it has
(``transfer.mapped_prefix``, ``capture.first_layer_kv``).
"""

from __future__ import annotations

import functools
import json
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..core.errors import KVMapError
from ..core.rope import rope, unrope
from ..core.sources import model_folder
from ..core.spec import ModelSpec, spec_from_pretrained, tables_for_spec
from .capture import first_layer_kv

# A stored value row is read back as a token when it lies within this fraction of its own norm
# of that token's row (bfloat16 storage and another kernel's products move it by well under
# 1%), and every other token's row is at least twice as far.
RECOVERY_TOLERANCE = 0.02
RECOVERY_MARGIN = 2.0
_TABLE_CHUNK = 4096  # tokens per forward while a table is built
_SEARCH_CHUNK = 256  # stored tokens compared with the whole vocabulary at once
_CANDIDATES = 8  # nearest rows by the ranking, whose distances are then taken in float32
MAX_REMEMBERED = 1 << 20  # stored rows whose token id an ExactFirstLayer remembers


@dataclass(frozen=True)
class FirstLayerTable:
    """Layer 0 of every token of a model's vocabulary. keys: [vocab, kv_heads, head_dim] in
    content space (RoPE stripped); values: [vocab, kv_heads, head_dim]; both float32. spec:
    the model's (its RoPE)."""

    keys: torch.Tensor
    values: torch.Tensor
    spec: ModelSpec

    def for_heads(self, heads: list[int]) -> FirstLayerTable:
        """The table of the KV heads ``heads`` only (a TP rank's shard)."""
        if list(heads) == list(range(self.keys.shape[1])):
            return self
        return FirstLayerTable(self.keys[:, heads], self.values[:, heads], self.spec)


@functools.lru_cache(maxsize=4)
def first_layer_table(path: str) -> FirstLayerTable:
    """The layer-0 table of the model at ``path`` (a folder or Hub id whose weights this host
    holds), computed by the model's own code: the model cut to its embedding and first layer,
    only those weights read from its safetensors files. Kept per path (engines in one process
    share it). Raises KVMapError when the weights cannot be read."""
    folder = model_folder(path)
    spec = spec_from_pretrained(path)
    model = _first_layer_model(folder)
    vocab = model.get_input_embeddings().weight.shape[0]
    keys = torch.empty(vocab, spec.num_kv_heads, spec.head_dim)
    values = torch.empty_like(keys)
    for start in range(0, vocab, _TABLE_CHUNK):
        ids = torch.arange(start, min(start + _TABLE_CHUNK, vocab))
        k, v = first_layer_kv(model, ids)
        tables = tables_for_spec(spec, torch.arange(ids.numel()))
        keys[ids] = unrope(k.float(), tables, spec.rope_style)
        values[ids] = v.float()
    if not (keys.isfinite().all() and values.isfinite().all()):
        raise KVMapError(f"{path}: layer 0's weights could not all be read from its files")
    return FirstLayerTable(keys, values, spec)


def recover_token_ids(
    values: torch.Tensor, table: FirstLayerTable, matmul_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """values: [tokens, kv_heads, head_dim], a model's stored layer-0 values (any dtype);
    ``table``: that model's. Returns [tokens] int64: each token's id, or -1 where no row of
    the table is clearly the nearest (``RECOVERY_TOLERANCE``, ``RECOVERY_MARGIN``; tokens whose
    embeddings coincide are never told apart). ``matmul_dtype``: the dtype candidates are
    ranked in (the CPU's fast one, ``kernels.fast_matmul_dtype``); distances are float32."""
    rows = table.values.flatten(1)
    rows_ranked = rows.to(matmul_dtype)
    half_norms = rows.square().sum(1).mul(-0.5)[None].to(matmul_dtype)
    ids = torch.full((values.shape[0],), -1, dtype=torch.long)
    for start in range(0, values.shape[0], _SEARCH_CHUNK):
        x = values[start : start + _SEARCH_CHUNK].flatten(1).float()
        # the nearest rows maximise x.r - |r|^2 / 2 (ranked in matmul_dtype, a few kept);
        # their distances are then taken in float32
        scores = torch.addmm(half_norms, x.to(matmul_dtype), rows_ranked.T)
        candidates = scores.topk(_CANDIDATES, dim=1).indices
        distances, order = (x[:, None] - rows[candidates]).norm(dim=2).sort(dim=1)
        best, second = distances[:, 0], distances[:, 1]
        scale = x.norm(dim=1)
        clear = (best <= RECOVERY_TOLERANCE * scale) & (second >= RECOVERY_MARGIN * best)
        clear &= second > RECOVERY_TOLERANCE * scale
        nearest = candidates.gather(1, order[:, :1]).squeeze(1)
        ids[start : start + x.shape[0]] = torch.where(clear, nearest, -1)
    return ids


def first_layer_at(
    table: FirstLayerTable, token_ids: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's exact layer-0 K (post-RoPE) and V of ``token_ids: [tokens]`` at
    ``positions: [tokens]``, each [tokens, kv_heads, head_dim] float32."""
    tables = tables_for_spec(table.spec, positions)
    keys = rope(table.keys[token_ids], tables, table.spec.rope_style)
    return keys, table.values[token_ids]


@dataclass
class ExactFirstLayer:
    """The target's exact layer 0 in place of the mapped one, for a peer's translated pages:
    ``source``: the peer model's table (to read the token ids back), ``target``: this engine's
    (its rank's heads); matmul_dtype: ``recover_token_ids``'. The ids read back are
    remembered by the stored rows' bytes (an engine writes the same bytes for a token each time
    it computes it), so a history translated again is read back without a search."""

    source: FirstLayerTable
    target: FirstLayerTable
    matmul_dtype: torch.dtype = torch.float32
    known: dict[bytes, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def token_ids(self, values: torch.Tensor) -> torch.Tensor:
        """values: [tokens, source heads, dim], stored layer-0 values. Returns [tokens] int64,
        -1 where none is read back (``recover_token_ids``)."""
        rows = [row.numpy().tobytes() for row in values.flatten(1).contiguous().view(torch.uint8)]
        with self._lock:  # translation workers share it
            ids = {row: self.known.get(row) for row in rows}
        unseen = {row: i for i, row in enumerate(rows) if ids[row] is None}
        if unseen:  # each distinct row searched once
            rows_unseen = values[list(unseen.values())]
            found = recover_token_ids(rows_unseen, self.source, self.matmul_dtype).tolist()
            ids.update(zip(unseen, found))
            with self._lock:
                if len(self.known) + len(unseen) > MAX_REMEMBERED:
                    self.known.clear()
                self.known.update(zip(unseen, found))
        return torch.tensor([ids[row] for row in rows], dtype=torch.long)

    def overwrite(self, source: torch.Tensor, positions: torch.Tensor, target: torch.Tensor) -> int:
        """source: [2, tokens, source layers, source heads, dim] as stored (on the CPU);
        positions: [tokens]; target: [2, tokens, target layers, target heads, dim], the
        translation, whose layer 0 is overwritten (in its dtype) for every token read back.
        Returns how many."""
        ids = self.token_ids(source[1, :, 0])
        known = (ids >= 0).nonzero().squeeze(1)
        if known.numel():
            keys, values = first_layer_at(self.target, ids[known], positions[known])
            target[0, known.to(target.device), 0] = keys.to(target)
            target[1, known.to(target.device), 0] = values.to(target)
        return int(known.numel())


def _first_layer_model(folder: Path) -> torch.nn.Module:
    """The model at ``folder`` cut to its first layer (float32, eval), with its embedding and
    first layer's weights read from its safetensors files; every other parameter is NaN, so
    a forward that needed one would show it."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    text = config.get_text_config()
    text.num_hidden_layers = 1
    if getattr(text, "layer_types", None):
        text.layer_types = text.layer_types[:1]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for param in params.values():
            param.fill_(math.nan)
        for file in _weight_files(folder):
            with safe_open(str(file), "pt") as weights:
                for name in weights.keys():
                    if name in params:
                        params[name].copy_(weights.get_tensor(name))
    return model


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / name for name in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise KVMapError(f"{folder} holds no safetensors weights")
    return files
