"""A small non-linear residual on a reduced-rank map (pure math).

The closed-form map is affine. The paper's one non-linear mapper (a 2-hidden-layer MLP, its
Table 3) rescued pairs where the linear map failed; here the non-linear part rides on the
reduced-rank map and costs little. A reduced-rank map sends a token's projected features
``z = x P`` ([rank]) to target layer l by ``z W_l + b_l``; the residual adds, per kind (K or V),
one hidden layer shared by every target layer and one output matrix per target layer:

    y_l = z W_l + b_l + gelu(z A + c) B_l        A: [rank, hidden], c: [hidden], B_l: [hidden, wt]

Per token it adds (rank + target layers x wt) x hidden multiply-adds to the map's (source width
+ target layers x wt) x rank. ``initial_residual`` starts it at B = 0, exactly the linear map,
and only downstream tuning (``config.TuneConfig.residual_hidden``) trains it: the closed-form fit
has no non-linear part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .errors import KVMapError


@dataclass
class Residual:
    """One kind's residual: ``weight_in`` [rank, hidden], ``bias_in`` [hidden], and
    ``weights_out``, one [hidden, target kv_width] per target layer."""

    weight_in: torch.Tensor
    bias_in: torch.Tensor
    weights_out: list[torch.Tensor]

    @property
    def hidden(self) -> int:
        return self.weight_in.shape[1]

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight_in, self.bias_in, *self.weights_out]

    def apply(self, fn) -> Residual:
        """A residual whose every tensor is ``fn(tensor)``."""
        return Residual(fn(self.weight_in), fn(self.bias_in), [fn(w) for w in self.weights_out])

    def output_columns(self, columns: torch.Tensor) -> Residual:
        """This residual with only the output ``columns`` of every layer (a head subset)."""
        return Residual(self.weight_in, self.bias_in, [w[:, columns] for w in self.weights_out])

    def validate(self, rank: int, target_layers: int, target_width: int) -> None:
        """Raise KVMapError unless the shapes fit a rank-``rank`` map into ``target_layers``
        layers of ``target_width``."""
        hidden = self.hidden
        shapes = [tuple(t.shape) for t in self.tensors()]
        want = [(rank, hidden), (hidden,)] + [(hidden, target_width)] * target_layers
        if shapes != want:
            raise KVMapError(
                f"residual shapes {shapes[:3]}... ({len(shapes) - 2} output matrices) do not fit "
                f"rank {rank}, hidden {hidden} and {target_layers} target layers of width "
                f"{target_width}"
            )


def hidden_activations(z: torch.Tensor, residual: Residual) -> torch.Tensor:
    """gelu(z A + c): z [t, rank] -> [t, hidden], in z's dtype."""
    weight_in, bias_in = residual.weight_in.to(z.dtype), residual.bias_in.to(z.dtype)
    return F.gelu(torch.addmm(bias_in, z, weight_in))


def initial_residual(
    z: torch.Tensor, hidden: int, target_layers: int, target_width: int, seed: int = 0
) -> Residual:
    """A residual that leaves the map as it is (B = 0), its hidden layer scaled for ``z``.

    z: [t, rank] projected features of some calibration tokens; A is Gaussian, scaled so that
    the pre-activations z A have unit RMS on them (gelu then sits where it bends); c = 0.
    """
    if hidden < 1:
        raise KVMapError(f"a residual needs hidden >= 1, got {hidden}")
    generator = torch.Generator().manual_seed(seed)
    weight_in = torch.randn(z.shape[1], hidden, generator=generator)
    pre_activation_rms = (z.float() @ weight_in).pow(2).mean().sqrt().clamp_min(1e-12)
    return Residual(
        weight_in / pre_activation_rms,
        torch.zeros(hidden),
        [torch.zeros(hidden, target_width) for _ in range(target_layers)],
    )


def output_rates(residual: Residual, z: torch.Tensor, layer_rates: list[float]) -> list[float]:
    """Adam step sizes for the output matrices B_l that move layer l's output as much as a step
    of ``layer_rates[l]`` on its linear weights W_l does: a step of size r on every entry of
    W_l moves the output by about r x ||z||, one on B_l by about r x ||h||, so B_l takes
    layer_rates[l] x RMS(z) sqrt(rank) / (RMS(h) sqrt(hidden)), with h the hidden activations
    of z: [t, rank]. (B starts at zero, so a rate relative to its own size would never move it.)
    """
    with torch.no_grad():
        h = hidden_activations(z.float(), residual.apply(lambda t: t.detach().float()))
        z_norm = z.float().pow(2).mean().sqrt() * z.shape[1] ** 0.5
        h_norm = h.pow(2).mean().sqrt().clamp_min(1e-12) * h.shape[1] ** 0.5
    return [rate * (z_norm / h_norm).item() for rate in layer_rates]
