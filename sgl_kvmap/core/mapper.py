"""KVMapper: fitted per-layer maps from a source model's KV cache to a target model's."""

from __future__ import annotations

import copy
import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from .cache import KVCache
from .errors import KVMapError
from .fit import KINDS, LayerMap
from .manifest import MAX_COUNT
from .pack import is_hub_pack, load_pack, registry, save_pack
from .residual import Residual, hidden_activations
from .rope import rope, unrope
from .spec import ModelSpec, tables_for_spec


def _ascending_layers(sources: list[int], num_layers: int) -> bool:
    """Whether ``sources`` are distinct layer indices in [0, num_layers), in ascending order."""
    whole = all(isinstance(s, int) and not isinstance(s, bool) for s in sources)
    return (
        bool(sources)
        and whole
        and sources == sorted(set(sources))
        and 0 <= sources[0]
        and sources[-1] < num_layers
    )


def default_matmul_dtype(cache_dtype: torch.dtype) -> torch.dtype:
    """The dtype a map's matrix products run in for a cache of ``cache_dtype``: the cache's own
    if it is a 16-bit float (as an engine's GEMMs run), else float32."""
    return cache_dtype if cache_dtype in (torch.bfloat16, torch.float16) else torch.float32


def content_features(
    cache: KVCache, spec: ModelSpec, rows: slice = slice(None)
) -> dict[str, torch.Tensor]:
    """{"k", "v"}: [t, L * w] float32, every layer's RoPE-free keys (values) side by side,
    layer-major (w = spec.kv_width), for the ``rows`` (t of them) of ``cache``: L x [T, kv_heads,
    head_dim], post-RoPE, of the model ``spec`` describes. The input of a map
    (``KVMapper.content_products``) and of the statistics a map is fitted on."""
    positions = cache.positions[rows]
    tables, t = tables_for_spec(spec, positions), positions.numel()
    keys = [unrope(k[rows].float(), tables, spec.rope_style) for k in cache.keys]
    return {
        "k": torch.cat([k.reshape(t, -1) for k in keys], dim=1),
        "v": torch.cat([v[rows].float().reshape(t, -1) for v in cache.values], dim=1),
    }


@dataclass
class KVMapper:
    """Maps source KV (post-RoPE) to target KV (post-RoPE) through RoPE-free content space.

    ``selection[l]``: source layers read by target layer l (ascending). ``maps[kind][l]``: the
    affine map of target layer l for "k" or "v" over those layers' concatenated features.
    ``sink_tokens``: leading tokens whose target KV should be computed by the target itself
    (attention sinks map badly); ``translate_prefix`` honours it. ``info`` holds the
    calibration recipe and measured metrics recorded in the pack. ``projections[kind]``
    (reduced-rank mappers only): [Ls * ws, rank], shared by every target layer, which then
    reads all source layers and maps the projected features (``maps`` weights [rank, wt]).
    ``residuals[kind]`` (reduced-rank mappers only, made by tuning): a non-linear residual on
    the projected features (``residual.Residual``), added to every target layer's affine map.
    """

    source: ModelSpec
    target: ModelSpec
    selection: list[list[int]]
    maps: dict[str, list[LayerMap]]
    ridge: float
    sink_tokens: int = 1
    info: dict[str, Any] = field(default_factory=dict)
    projections: dict[str, torch.Tensor] | None = None
    residuals: dict[str, Residual] | None = None

    def __post_init__(self) -> None:
        self.validate()
        self._stack_cache: dict = {}

    @property
    def source_layers_per_target(self) -> int:
        """Source layers each target layer reads (the largest number, if layers differ)."""
        return max(len(s) for s in self.selection)

    @property
    def rank(self) -> int | None:
        """Width of the shared projection of a reduced-rank mapper (None: a k-layer mapper)."""
        return None if self.projections is None else self.projections["k"].shape[1]

    @property
    def residual_hidden(self) -> int | None:
        """Hidden width of the non-linear residual (None: the map is affine)."""
        return None if self.residuals is None else self.residuals["k"].hidden

    def validate(self) -> None:
        """Check that selection and tensor shapes agree with both specs (raises KVMapError)."""
        if len(self.selection) != self.target.num_layers:
            raise KVMapError(
                f"selection has {len(self.selection)} layers, target has {self.target.num_layers}"
            )
        if not (math.isfinite(self.ridge) and self.ridge >= 0):
            raise KVMapError(f"ridge must be a finite number >= 0, got {self.ridge}")
        if isinstance(self.sink_tokens, bool) or not isinstance(self.sink_tokens, int):
            raise KVMapError(f"sink_tokens must be an integer, got {self.sink_tokens!r}")
        if not 0 <= self.sink_tokens <= MAX_COUNT:
            raise KVMapError(f"sink_tokens must be 0 to {MAX_COUNT}, got {self.sink_tokens}")
        self._validate_projections()
        self._validate_residuals()
        for layer, sources in enumerate(self.selection):
            if not _ascending_layers(sources, self.source.num_layers):
                raise KVMapError(
                    f"target layer {layer}: source layers {sources} are not distinct source "
                    f"layers in ascending order (the source has {self.source.num_layers})"
                )
            for kind in KINDS:
                m = self.maps[kind][layer]
                width = self.rank or len(sources) * self.source.kv_width
                want = (width, self.target.kv_width)
                if tuple(m.weight.shape) != want or tuple(m.bias.shape) != want[1:]:
                    raise KVMapError(
                        f"{kind} map of target layer {layer} has shape {tuple(m.weight.shape)}/"
                        f"{tuple(m.bias.shape)}, expected {want}/{want[1:]}"
                    )

    def _validate_projections(self) -> None:
        if self.projections is None:
            return
        every = list(range(self.source.num_layers))
        if any(sources != every for sources in self.selection):
            raise KVMapError("a reduced-rank mapper reads every source layer in every target layer")
        want = self.source.num_layers * self.source.kv_width
        for kind in KINDS:
            got = tuple(self.projections[kind].shape)
            if len(got) != 2 or got != (want, self.rank):
                raise KVMapError(f"{kind} projection has shape {got}, expected ({want}, rank)")

    def _validate_residuals(self) -> None:
        if self.residuals is None:
            return
        if self.projections is None:
            raise KVMapError("a non-linear residual needs a reduced-rank mapper (projections)")
        for kind in KINDS:
            self.residuals[kind].validate(self.rank, self.target.num_layers, self.target.kv_width)

    def map(self, source_cache: KVCache, matmul_dtype: torch.dtype | None = None) -> KVCache:
        """Reference map: source_cache Ls x [t, kv_s, d_s] -> Lt x [t, kv_t, d_t], both post-RoPE.

        RoPE in float32, the matrix products in ``matmul_dtype`` (default: the cache's dtype if
        it is a 16-bit float, as an engine's GEMMs run, else float32; bfloat16 runs on a CPU's
        AMX units or a GPU's tensor cores); the result has the source cache's dtype and the
        same positions. Target layers that read the same source
        layers share one feature matrix and one matrix product. Differentiable in the weights
        when they require grad (``tune.tune_mapper`` trains them).
        """
        self._check_source(source_cache)
        matmul_dtype = matmul_dtype or default_matmul_dtype(source_cache.keys[0].dtype)
        positions, t = source_cache.positions, len(source_cache)
        tgt_tables = tables_for_spec(self.target, positions)
        features = content_features(source_cache, self.source)
        mapped = {kind: [None] * self.target.num_layers for kind in KINDS}
        for kind in KINDS:
            for layers, y_all in self.content_products(kind, features[kind].to(matmul_dtype)):
                for layer, y in zip(layers, y_all.float().split(self.target.kv_width, dim=1)):
                    mapped[kind][layer] = y.reshape(
                        t, self.target.num_kv_heads, self.target.head_dim
                    )
        keys = [
            rope(k, tgt_tables, self.target.rope_style).to(source_cache.keys[0].dtype)
            for k in mapped["k"]
        ]
        values = [v.to(source_cache.values[0].dtype) for v in mapped["v"]]
        return KVCache(keys, values, positions)

    def to(self, device: torch.device | str) -> KVMapper:
        """This mapper with its weights on ``device`` (a new mapper; this one is unchanged).
        Pools translated on a GPU need the mapper there too."""
        return self.apply(lambda tensor: tensor.to(device))

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> KVMapper:
        """A new mapper whose every weight tensor (maps, projections, residuals) is
        ``fn(tensor)``, with a copy of this one's ``info``; this one is unchanged."""
        maps = {
            kind: [LayerMap(fn(m.weight), fn(m.bias)) for m in layers]
            for kind, layers in self.maps.items()
        }
        projections = (
            None
            if self.projections is None
            else {kind: fn(p) for kind, p in self.projections.items()}
        )
        residuals = (
            None
            if self.residuals is None
            else {kind: r.apply(fn) for kind, r in self.residuals.items()}
        )
        return replace(
            self,
            maps=maps,
            projections=projections,
            residuals=residuals,
            info=copy.deepcopy(self.info),
        )

    def for_target_heads(self, heads: list[int]) -> KVMapper:
        """This mapper restricted to the target's KV ``heads`` (indices, in output order): what
        one tensor-parallel rank of the target computes. A map's output columns are per head, so
        the weights are sliced, not the result; the new mapper's target spec has
        ``len(heads)`` KV heads (and so its own fingerprint)."""
        if not heads or any(not 0 <= h < self.target.num_kv_heads for h in heads):
            raise KVMapError(
                f"heads {heads} are not KV heads of the target ({self.target.num_kv_heads})"
            )
        dim = self.target.head_dim
        columns = torch.cat([torch.arange(h * dim, (h + 1) * dim) for h in heads])
        maps = {
            kind: [LayerMap(m.weight[:, columns], m.bias[columns]) for m in layers]
            for kind, layers in self.maps.items()
        }
        residuals = (
            None
            if self.residuals is None
            else {kind: r.output_columns(columns) for kind, r in self.residuals.items()}
        )
        target = replace(self.target, num_kv_heads=len(heads))
        return replace(
            self, target=target, maps=maps, residuals=residuals, info=copy.deepcopy(self.info)
        )

    def content_products(
        self, kind: str, features: torch.Tensor
    ) -> list[tuple[list[int], torch.Tensor]]:
        """The map's matrix products in content space, in ``features``' dtype.

        features: [t, Ls * ws], every source layer's RoPE-free ``kind`` ("k" or "v") features,
        layer-major (``ws`` = source kv_width; ``mapper.content_features``). Returns one (target
        layers, [t, len(layers) * wt]) pair per group of target layers that read the same source
        layers: the layers' content-space outputs side by side, in the order listed, the
        non-linear residual (if the mapper has one) included. Shared by ``map`` and the
        paged-pool kernels, so every backend runs the same products.
        """
        t, every = features.shape[0], tuple(range(self.source.num_layers))
        per_layer = features.view(t, self.source.num_layers, self.source.kv_width)
        products = []
        for sources, layers in self._layer_groups().items():
            x = features if sources == every else per_layer[:, list(sources)].reshape(t, -1)
            if self.projections is not None:
                x = x @ self._projection(kind, features.dtype)
            weight, bias = self._stacked(kind, layers, features.dtype)
            y = torch.addmm(bias, x, weight)
            if self.residuals is not None:  # x: the projected features
                y = y + hidden_activations(x, self.residuals[kind]) @ self._residual_out(
                    kind, layers, features.dtype
                )
            products.append((layers, y))
        return products

    def _layer_groups(self) -> dict[tuple[int, ...], list[int]]:
        groups: dict[tuple[int, ...], list[int]] = {}
        for layer, sources in enumerate(self.selection):
            groups.setdefault(tuple(sources), []).append(layer)
        return groups

    def _stacked(
        self, kind: str, layers: list[int], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights [k * ws, len(layers) * wt] and biases of target layers that share a selection,
        in ``dtype``."""
        maps = [self.maps[kind][layer] for layer in layers]

        def stack() -> tuple[torch.Tensor, torch.Tensor]:
            weights, biases = [m.weight for m in maps], [m.bias for m in maps]
            return torch.cat(weights, 1).to(dtype), torch.cat(biases).to(dtype)

        return self._cached((kind, tuple(layers), dtype), stack, maps[0].weight)

    def _residual_out(self, kind: str, layers: list[int], dtype: torch.dtype) -> torch.Tensor:
        """The residual's output matrices of ``layers`` side by side, [hidden, len(layers) *
        wt], in ``dtype``."""
        outputs = [self.residuals[kind].weights_out[layer] for layer in layers]
        return self._cached(
            (kind, "residual", tuple(layers), dtype),
            lambda: torch.cat(outputs, 1).to(dtype),
            outputs[0],
        )

    def _projection(self, kind: str, dtype: torch.dtype) -> torch.Tensor:
        projection = self.projections[kind]
        return self._cached((kind, "projection", dtype), lambda: projection.to(dtype), projection)

    def _cached(self, key: tuple, make, weight: torch.Tensor):
        """``make()``, cached under ``key`` unless ``weight`` is being trained (``tune``): then
        every call builds it anew, so gradients reach the weights."""
        if weight.requires_grad:
            return make()
        if key not in self._stack_cache:
            self._stack_cache[key] = make()
        return self._stack_cache[key]

    def _check_source(self, cache: KVCache) -> None:
        want = (self.source.num_layers, self.source.num_kv_heads, self.source.head_dim)
        got = (len(cache.keys), *cache.keys[0].shape[1:]) if cache.keys else (0,)
        if got != want:
            raise KVMapError(
                f"source cache has (layers, kv_heads, head_dim) {got}, this mapper expects {want}"
            )

    def save_pretrained(self, folder: str | Path, *, overwrite: bool = False) -> Path:
        """Write the pack folder (mapper.safetensors + kvmap.json + README.md) atomically.

        A new or empty folder is written; an existing pack is replaced only with ``overwrite``;
        any other existing folder is refused with PackError (nothing in it is touched)."""
        return save_pack(self, Path(folder), overwrite=overwrite)

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | Path,
        *,
        revision: str | None = None,
        cache_dir: str | Path | None = None,
        local_files_only: bool = False,
        token: str | bool | None = None,
    ) -> KVMapper:
        """Load and validate a pack: a local folder, or a Hub repo id ``namespace/name`` at
        ``revision`` (fetched at one commit through the registry, into the Hugging Face cache).
        Raises PackError for a wrong, damaged or unreachable pack."""
        if not is_hub_pack(name_or_path):
            return load_pack(Path(name_or_path), cls)
        folder = registry().fetch(
            str(name_or_path),
            revision=revision,
            cache_dir=cache_dir,
            local_files_only=local_files_only,
            token=token,
        )
        return load_pack(folder, cls)

    def push_to_hub(
        self,
        repo_id: str,
        *,
        revision: str | None = None,
        private: bool = False,
        tag: str | None = None,
        token: str | bool | None = None,
        commit_message: str | None = None,
    ) -> str:
        """Publish this mapper as a pack to the Hub repo ``repo_id`` in one commit (on branch
        ``revision``, tagged ``tag``). Returns the commit id."""
        with tempfile.TemporaryDirectory() as root:
            folder = self.save_pretrained(Path(root) / "pack")
            return registry().push(
                folder,
                repo_id,
                revision=revision,
                private=private,
                tag=tag,
                token=token,
                commit_message=commit_message,
            )
