"""Closed-form ridge mappers and source-layer selection, from sufficient statistics (pure).

Columns: the source's features are all its layers' RoPE-stripped K (or V) side by side,
layer s at columns [s * ws, (s+1) * ws) with ws = kv_heads_s * head_dim_s; the target's
layer l sits at [l * wt, (l+1) * wt). A target layer's map reads the columns of its selected
source layers, so every selection's Gram is a sub-block of one streamed Gram: a single pass
over calibration text serves every k, every layer and both K and V.

Reduced rank (``fit_reduced_rank``): every target layer reads ALL source layers through one
shared projection to ``rank`` dimensions, so the per-token cost is (source width + target
width) x rank instead of k x source-layer width x target width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import KVMapError
from .stats import ACC, Moments, residuals

KINDS = ("k", "v")


@dataclass(frozen=True)
class Geometry:
    """Source and target layer counts, per-layer widths, and the target's head_dim."""

    source_layers: int
    source_width: int
    target_layers: int
    target_width: int
    target_head_dim: int

    def source_cols(self, layers) -> torch.Tensor:
        return torch.cat(
            [torch.arange(s * self.source_width, (s + 1) * self.source_width) for s in layers]
        )

    def target_cols(self, layer: int) -> torch.Tensor:
        return torch.arange(layer * self.target_width, (layer + 1) * self.target_width)


@dataclass(frozen=True)
class Ridge:
    """Ridge strength: ``value`` itself, or, if ``relative``, value x mean diagonal of the
    centred Gram (so one setting means the same for features of any scale or width)."""

    value: float
    relative: bool = False

    def for_gram(self, cxx: torch.Tensor) -> float:
        return self.value * cxx.diagonal().mean().item() if self.relative else self.value


def as_ridge(ridge: float | Ridge) -> Ridge:
    return ridge if isinstance(ridge, Ridge) else Ridge(float(ridge))


@dataclass
class LayerMap:
    """Affine map of one target layer, K or V: y = x @ weight + bias.
    weight: [k * source_width, target_width], bias: [target_width]."""

    weight: torch.Tensor
    bias: torch.Tensor


def ridge_solve(cxx: torch.Tensor, cxy: torch.Tensor, ridge: float | Ridge) -> torch.Tensor:
    """W = (cxx + ridge I)^-1 cxy. cxx: [d, d] centred Gram, cxy: [d, m]. Returns [d, m] float64."""
    return torch.cholesky_solve(cxy.to(ACC), _cholesky(cxx, ridge))


def fit_affine(
    m: Moments, x_cols: torch.Tensor, y_cols: torch.Tensor, ridge: float | Ridge, factor=None
):
    """Ridge fit of y[:, y_cols] on x[:, x_cols]. Returns (w [dx, dy], b [dy]) float64.
    ``factor``: a Cholesky factor of this Gram to reuse (from ``_cholesky``)."""
    chol = factor if factor is not None else _cholesky(m.centered_gram(x_cols), ridge)
    w = torch.cholesky_solve(m.centered_cross(x_cols, y_cols), chol)
    b = m.mean_y[y_cols] - m.mean_x[x_cols] @ w
    return w, b


def r2_by_head(sse: torch.Tensor, sst: torch.Tensor, head_dim: int) -> torch.Tensor:
    """1 - SSE/SST per head (sums over the head's dims). sse, sst: [heads * head_dim] -> [heads]."""
    return 1 - sse.reshape(-1, head_dim).sum(1) / sst.reshape(-1, head_dim).sum(1)


def probe_scores(train: dict[str, Moments], geo: Geometry, ridge: float | Ridge) -> torch.Tensor:
    """Single-source-layer probe R^2 for every (target layer, source layer): [Lt, Ls].

    Averaged over target heads and over K and V, as the method prescribes.
    """
    scores = torch.zeros(geo.target_layers, geo.source_layers, dtype=ACC)
    all_y = torch.arange(geo.target_layers * geo.target_width)
    for kind in KINDS:
        m = train[kind]
        for s in range(geo.source_layers):
            x_cols = geo.source_cols([s])
            w, b = fit_affine(m, x_cols, all_y, ridge)
            sse, sst = residuals(m, x_cols, all_y, w, b)
            per_head = r2_by_head(sse, sst, geo.target_head_dim)
            scores[:, s] += per_head.reshape(geo.target_layers, -1).mean(1) / len(KINDS)
    return scores


def top_k_selection(scores: torch.Tensor, k: int) -> list[list[int]]:
    """Each target layer's k best-scoring source layers, ascending. scores: [Lt, Ls]."""
    if not 1 <= k <= scores.shape[1]:
        raise KVMapError(f"k must be in 1..{scores.shape[1]}, got {k}")
    return [sorted(row.topk(k).indices.tolist()) for row in scores]


def candidate_ks(source_layers: int) -> list[int]:
    """1, 2, 4, 8, ... below the source's layer count, then all of them."""
    return _doubling(1, source_layers)


def heldout_r2(
    train: dict[str, Moments],
    heldout: dict[str, Moments],
    selection: list[list[int]],
    geo: Geometry,
    ridge: float | Ridge,
) -> dict[str, torch.Tensor]:
    """Held-out R^2 per target layer (mean over heads) of maps fitted on ``train``: kind -> [Lt]."""
    return {
        kind: maps_heldout_r2(
            heldout[kind], _fit_layers(train[kind], selection, geo, ridge), selection, geo
        )
        for kind in KINDS
    }


def maps_heldout_r2(
    heldout: Moments, maps: list[LayerMap], selection: list[list[int]], geo: Geometry
) -> torch.Tensor:
    """Held-out R^2 per target layer (mean over heads) of given maps, each reading its
    selection's columns: [Lt]."""
    r2 = []
    for layer, layer_map in enumerate(maps):
        x_cols, y_cols = geo.source_cols(selection[layer]), geo.target_cols(layer)
        sse, sst = residuals(heldout, x_cols, y_cols, layer_map.weight, layer_map.bias)
        r2.append(r2_by_head(sse, sst, geo.target_head_dim).mean())
    return torch.stack(r2)


def fit_maps(
    moments: dict[str, Moments], selection: list[list[int]], geo: Geometry, ridge: float | Ridge
) -> dict[str, list[LayerMap]]:
    """Final float32 maps of every target layer for K and V: kind -> Lt x LayerMap."""
    return {
        kind: [
            LayerMap(m.weight.float(), m.bias.float())
            for m in _fit_layers(moments[kind], selection, geo, ridge)
        ]
        for kind in KINDS
    }


def fit_reduced_rank(
    m: Moments, geo: Geometry, ridge: float | Ridge, rank: int
) -> tuple[torch.Tensor, list[LayerMap]]:
    """Reduced-rank ridge of all target layers on all source layers: y_l = (x P) B_l + b_l.

    The full ridge map W [dx, Lt * wt] is cut to the ``rank`` directions V [Lt * wt, rank] of
    largest fitted-value variance (top eigenvectors of W^T Cxx W), W_r = W V V^T: the best
    rank-r map in fitted-value error, unlike a principal-component basis of x alone. Returns
    P = W V [dx, rank] (shared by every target layer) and per target layer B_l = V^T[:, layer
    columns] [rank, wt] with its bias (refitted for W_r), float64.
    """
    return _truncated(m, geo, *_full_map_and_directions(m, geo, ridge), rank)


def heldout_r2_reduced(
    train: dict[str, Moments],
    heldout: dict[str, Moments],
    geo: Geometry,
    ridge: float | Ridge,
    ranks: list[int],
) -> dict[int, dict[str, torch.Tensor]]:
    """Held-out R^2 per target layer (mean over heads) of reduced-rank maps fitted on ``train``,
    for every rank in ``ranks`` (one full fit and eigendecomposition per kind serve them all):
    rank -> kind -> [Lt]."""
    every = [list(range(geo.source_layers))] * geo.target_layers
    out: dict[int, dict[str, torch.Tensor]] = {rank: {} for rank in ranks}
    for kind in KINDS:
        full, directions = _full_map_and_directions(train[kind], geo, ridge)
        for rank in ranks:
            projection, maps = _truncated(train[kind], geo, full, directions, rank)
            # each layer's map through the projection: x (P B_l) + b_l
            composed = [LayerMap(projection @ m.weight, m.bias) for m in maps]
            out[rank][kind] = maps_heldout_r2(heldout[kind], composed, every, geo)
    return out


def candidate_ranks(geo: Geometry) -> list[int]:
    """128, 256, 512, ... below the widest rank the pair allows, then that rank."""
    return _doubling(128, _widest_rank(geo))


def _doubling(first: int, last: int) -> list[int]:
    """first, 2 first, 4 first, ... below ``last``, then ``last``."""
    values, value = [], first
    while value < last:
        values.append(value)
        value *= 2
    return values + [last]


def _widest_rank(geo: Geometry) -> int:
    return min(geo.source_layers * geo.source_width, geo.target_layers * geo.target_width)


def _full_map_and_directions(
    m: Moments, geo: Geometry, ridge: float | Ridge
) -> tuple[torch.Tensor, torch.Tensor]:
    """The full ridge map W [dx, Lt * wt] and the directions of its fitted values, largest
    variance first [Lt * wt, widest rank]."""
    x_cols = geo.source_cols(range(geo.source_layers))
    w, _ = fit_affine(m, x_cols, torch.arange(geo.target_layers * geo.target_width), ridge)
    _, vectors = torch.linalg.eigh(w.T @ m.centered_gram(x_cols) @ w)
    return w, vectors[:, -_widest_rank(geo) :].flip(1)


def _truncated(
    m: Moments, geo: Geometry, full: torch.Tensor, directions: torch.Tensor, rank: int
) -> tuple[torch.Tensor, list[LayerMap]]:
    if not 1 <= rank <= directions.shape[1]:
        raise KVMapError(f"rank must be in 1..{directions.shape[1]} for this pair, got {rank}")
    x_cols = geo.source_cols(range(geo.source_layers))
    basis = directions[:, :rank]
    projection = full @ basis
    bias = m.mean_y - m.mean_x[x_cols] @ projection @ basis.T
    maps = [
        LayerMap(basis.T[:, geo.target_cols(layer)], bias[geo.target_cols(layer)])
        for layer in range(geo.target_layers)
    ]
    return projection, maps


def _fit_layers(
    m: Moments, selection: list[list[int]], geo: Geometry, ridge: float | Ridge
) -> list[LayerMap]:
    factors: dict[tuple[int, ...], torch.Tensor] = {}  # layers sharing a selection share one factor
    maps = []
    for layer, sources in enumerate(selection):
        x_cols = geo.source_cols(sources)
        key = tuple(sources)
        if key not in factors:
            factors[key] = _cholesky(m.centered_gram(x_cols), ridge)
        w, b = fit_affine(m, x_cols, geo.target_cols(layer), ridge, factor=factors[key])
        maps.append(LayerMap(w, b))
    return maps


def _cholesky(cxx: torch.Tensor, ridge: float | Ridge) -> torch.Tensor:
    """Cholesky factor of cxx + ridge I.

    With fewer tokens than features the Gram is singular, and float32 accumulation leaves it
    slightly indefinite; then the factor is taken of its nearest PSD matrix (eigenvalues
    clamped at zero) plus ridge I, which is what the ridge solution means there.
    """
    ridge = as_ridge(ridge).for_gram(cxx)
    eye = torch.eye(cxx.shape[0], dtype=ACC)
    factor, info = torch.linalg.cholesky_ex(cxx.to(ACC) + ridge * eye)
    if info.item() == 0:
        return factor
    if ridge <= 0:
        raise KVMapError(
            "the calibration Gram is singular; use a positive ridge or more calibration tokens"
        )
    values, vectors = torch.linalg.eigh(cxx.to(ACC))
    repaired = (vectors * (values.clamp(min=0) + ridge)) @ vectors.T
    return torch.linalg.cholesky((repaired + repaired.T) / 2)
