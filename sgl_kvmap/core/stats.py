"""Streaming sufficient statistics for least squares (pure; memory independent of tokens).

``Moments`` holds the raw moments of shifted data x' = x - shift_x, y' = y - shift_y: n, sum x',
sum y', X'^T X', X'^T Y' and the per-column sum of y'^2. The shift (the first batch's mean) keeps
the centred Gram accurate when features have large means (attention-sink outliers), so each
batch's products can run in float32 while the sums are kept in float64. Moments with equal
shifts add, so a fit can be split over processes and all-reduced (torch.distributed) as is;
moments with other shifts are moved to a common one first (``reshifted``, exact algebra), so
statistics captured separately (another corpus, another machine) merge into one fit.

Rows may carry weights (weighted least squares): every sum is then weighted and ``n`` is the
sum of the weights, so all formulas below hold unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import KVMapError

ACC = torch.float64


@dataclass
class Moments:
    """Raw moments of (x', y'). x: [n, dx] features, y: [n, dy] targets; all sums float64.
    n: the number of rows, or the sum of their weights."""

    shift_x: torch.Tensor  # [dx]
    shift_y: torch.Tensor  # [dy]
    n: float
    sum_x: torch.Tensor  # [dx]
    sum_y: torch.Tensor  # [dy]
    xx: torch.Tensor  # [dx, dx]
    xy: torch.Tensor  # [dx, dy]
    yy: torch.Tensor  # [dy] sum of squares per column

    @classmethod
    def empty(cls, shift_x: torch.Tensor, shift_y: torch.Tensor) -> Moments:
        dx, dy = shift_x.numel(), shift_y.numel()
        zeros = lambda *shape: torch.zeros(*shape, dtype=ACC, device=shift_x.device)  # noqa: E731
        return cls(
            shift_x.to(ACC),
            shift_y.to(ACC),
            0,
            zeros(dx),
            zeros(dy),
            zeros(dx, dx),
            zeros(dx, dy),
            zeros(dy),
        )

    @property
    def mean_x(self) -> torch.Tensor:
        return self.shift_x + self.sum_x / self.n

    @property
    def mean_y(self) -> torch.Tensor:
        return self.shift_y + self.sum_y / self.n

    def update(self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor | None = None) -> None:
        """Add rows. x: [n, dx], y: [n, dy] (any float dtype; products in float32);
        weight: [n] non-negative row weights (None: all 1)."""
        if (
            x.shape[0] != y.shape[0]
            or x.shape[1] != self.sum_x.numel()
            or y.shape[1] != self.sum_y.numel()
            or (weight is not None and weight.shape != (x.shape[0],))
        ):
            raise KVMapError(
                f"moments of width ({self.sum_x.numel()}, {self.sum_y.numel()}) got "
                f"{tuple(x.shape)}, {tuple(y.shape)}"
                + ("" if weight is None else f", weight {tuple(weight.shape)}")
            )
        xs = x.float() - self.shift_x.float()
        ys = y.float() - self.shift_y.float()
        w = torch.ones(x.shape[0], device=x.device) if weight is None else weight.float()
        if (w < 0).any():
            raise KVMapError("row weights must be non-negative")
        xw = xs * w[:, None]
        self.n += x.shape[0] if weight is None else w.sum(dtype=ACC).item()
        self.sum_x += xw.sum(0, dtype=ACC)
        self.sum_y += (ys * w[:, None]).sum(0, dtype=ACC)
        self.xx += (xw.T @ xs).to(ACC)
        self.xy += (xw.T @ ys).to(ACC)
        self.yy += (ys.square() * w[:, None]).sum(0, dtype=ACC)

    def reshifted(self, shift_x: torch.Tensor, shift_y: torch.Tensor) -> Moments:
        """The same sample's moments about other shifts ([dx], [dy]). With d = old - new shift,
        x - new = (x - old) + d, so every sum moves by terms of n, the sums and d."""
        if shift_x.shape != self.shift_x.shape or shift_y.shape != self.shift_y.shape:
            raise KVMapError(
                f"shifts of shape {tuple(shift_x.shape)}, {tuple(shift_y.shape)} for moments of "
                f"width ({self.sum_x.numel()}, {self.sum_y.numel()})"
            )
        dx = self.shift_x - shift_x.to(ACC)
        dy = self.shift_y - shift_y.to(ACC)
        return Moments(
            shift_x.to(ACC),
            shift_y.to(ACC),
            self.n,
            self.sum_x + self.n * dx,
            self.sum_y + self.n * dy,
            self.xx
            + torch.outer(self.sum_x, dx)
            + torch.outer(dx, self.sum_x)
            + self.n * torch.outer(dx, dx),
            self.xy
            + torch.outer(self.sum_x, dy)
            + torch.outer(dx, self.sum_y)
            + self.n * torch.outer(dx, dy),
            self.yy + 2 * dy * self.sum_y + self.n * dy.square(),
        )

    def merged(self, other: Moments) -> Moments:
        """Moments of the union of both samples, about this one's shifts (``other`` is
        reshifted first when its shifts differ)."""
        if not (
            torch.equal(self.shift_x, other.shift_x) and torch.equal(self.shift_y, other.shift_y)
        ):
            other = other.reshifted(self.shift_x, self.shift_y)
        return Moments(
            self.shift_x,
            self.shift_y,
            self.n + other.n,
            self.sum_x + other.sum_x,
            self.sum_y + other.sum_y,
            self.xx + other.xx,
            self.xy + other.xy,
            self.yy + other.yy,
        )

    def centered_gram(self, x_cols: torch.Tensor) -> torch.Tensor:
        """Centred Gram [len(x_cols), len(x_cols)] of a column subset of x."""
        mx = self._mean_shifted_x(x_cols)
        return _block(self.xx, x_cols, x_cols) - self.n * torch.outer(mx, mx)

    def centered_cross(self, x_cols: torch.Tensor, y_cols: torch.Tensor) -> torch.Tensor:
        """Centred cross moments [len(x_cols), len(y_cols)]."""
        mx, my = self._mean_shifted_x(x_cols), self.sum_y[y_cols] / self.n
        return _block(self.xy, x_cols, y_cols) - self.n * torch.outer(mx, my)

    def _mean_shifted_x(self, x_cols: torch.Tensor) -> torch.Tensor:
        if self.n < 2:
            raise KVMapError("need at least two calibration tokens")
        return self.sum_x[x_cols] / self.n


def residuals(
    m: Moments, x_cols: torch.Tensor, y_cols: torch.Tensor, w: torch.Tensor, b: torch.Tensor
):
    """Sum of squared errors and total sum of squares per target column of y = x w + b on ``m``.

    w: [len(x_cols), len(y_cols)], b: [len(y_cols)] (in original, unshifted coordinates).
    Returns (sse, sst), each [len(y_cols)] float64.
    """
    w, b = w.to(ACC), b.to(ACC)
    b_shifted = m.shift_x[x_cols] @ w + b - m.shift_y[y_cols]
    xx, xy, sx, sy = (
        _block(m.xx, x_cols, x_cols),
        _block(m.xy, x_cols, y_cols),
        m.sum_x[x_cols],
        m.sum_y[y_cols],
    )
    sse = (
        m.yy[y_cols]
        - 2 * (w * xy).sum(0)
        - 2 * b_shifted * sy
        + ((xx @ w) * w).sum(0)
        + 2 * b_shifted * (sx @ w)
        + m.n * b_shifted.square()
    )
    sst = m.yy[y_cols] - sy.square() / m.n
    return sse, sst


def _block(matrix: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """matrix[rows][:, cols], without copying when both are the whole range."""
    if _is_everything(rows, matrix.shape[0]) and _is_everything(cols, matrix.shape[1]):
        return matrix
    return matrix.index_select(0, rows).index_select(1, cols)


def _is_everything(index: torch.Tensor, size: int) -> bool:
    return index.numel() == size and torch.equal(index, torch.arange(size))


MOMENT_FIELDS = ("shift_x", "shift_y", "sum_x", "sum_y", "xx", "xy", "yy")


def moments_to_tensors(m: Moments, prefix: str) -> dict[str, torch.Tensor]:
    """Flat ``{prefix.field: tensor}`` for safetensors (``n``: a 0-d int64, or float64 when
    the rows were weighted)."""
    out = {f"{prefix}.{name}": getattr(m, name).cpu().contiguous() for name in MOMENT_FIELDS}
    out[f"{prefix}.n"] = torch.tensor(m.n, dtype=torch.int64 if isinstance(m.n, int) else ACC)
    return out


def moments_from_tensors(tensors: dict[str, torch.Tensor], prefix: str) -> Moments:
    fields = {name: tensors[f"{prefix}.{name}"] for name in MOMENT_FIELDS}
    return Moments(n=tensors[f"{prefix}.n"].item(), **fields)
