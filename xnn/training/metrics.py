"""Error metrics accumulated over batches as sums, so ranks can all-reduce them exactly.

``MetricSums`` keeps, per property, ``Σ|d|``, ``Σd²`` and the count of components, plus force
errors per species; ``finalize`` turns them into MAE/RMSE in user units: energy meV/atom,
forces meV/Å, stress meV/Å³. For a committee it also keeps the per-atom force spread of the
evaluated atoms (:meth:`MetricSums.add_spread`), finalized as ``forces_std_mean`` (meV/Å),
the ``forces_calibration`` factor these data call for and ``forces_std_calibrated_mean``
(meV/Å).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from xnn.models.blocks import N_ELEMENTS

PROPS = ("energy", "forces", "stress")
TO_MILLI = 1000.0
UNITS = {"energy": "meV/atom", "forces": "meV/Å", "stress": "meV/Å³"}


class MetricSums:
    """Running sums of absolute and squared errors (float64), mergeable across ranks.

    Layout of :attr:`values` ``[3 * 3 + 3 * 119 + 4 + 2]``: for each property ``(Σ|d|, Σd²,
    n)``; for each element ``Z`` the force ``(Σ|d|, Σd², n)``; a committee's force spread
    ``(Σσ, Σσ², Σ|e|², n_atoms)`` (:meth:`add_spread`); then ``(Σ loss, batches)`` where each
    rank adds its partial loss of every batch and only dp rank 0 counts the batch.
    """

    def __init__(self, device=None):
        self.values = torch.zeros(_SPREAD + 4 + 2, dtype=torch.float64, device=device)

    def add(self, res: dict[str, tuple[Tensor, Tensor]],
            force_numbers: Tensor | None = None) -> None:
        """Add residuals from :func:`xnn.training.losses.residuals` (detached);
        ``force_numbers``: atomic numbers of the rows of the force residuals (per-species
        force errors)."""
        v = self.values
        for k, name in enumerate(PROPS):
            if name not in res:
                continue
            d = res[name][0].detach().to(torch.float64)
            v[3 * k] += d.abs().sum()
            v[3 * k + 1] += (d * d).sum()
            v[3 * k + 2] += d.numel()
        if force_numbers is not None and "forces" in res:
            d = res["forces"][0].detach().to(torch.float64)
            idx = 9 + 3 * force_numbers
            v.index_add_(0, idx, d.abs().sum(-1))
            v.index_add_(0, idx + 1, (d * d).sum(-1))
            v.index_add_(0, idx + 2, torch.full_like(force_numbers, 3, dtype=torch.float64))

    def add_spread(self, rows: Tensor | None) -> None:
        """Add a committee's force spread: ``rows [n_atoms, 2]`` of (``|F̄_i - F_ref,i|``,
        ``forces_std_i``) in eV/Å (:func:`~xnn.training.committee.uncertainty_parity`'s
        ``forces_uncertainty``); ``None``: nothing (a single model)."""
        if rows is None:
            return
        r = rows.detach().to(torch.float64)
        err, std = r[:, 0], r[:, 1]
        v = self.values
        v[_SPREAD] += std.sum()
        v[_SPREAD + 1] += (std * std).sum()
        v[_SPREAD + 2] += (err * err).sum()
        v[_SPREAD + 3] += std.numel()

    def add_loss(self, partial_loss: float, batches: int) -> None:
        self.values[-2] += float(partial_loss)
        self.values[-1] += float(batches)

    def finalize(self, prefix: str = "") -> dict[str, float]:
        """``{prefix + "energy_mae": meV/atom, ..., "forces_rmse_Cu": meV/Å, "loss": ...}``."""
        from ase.data import chemical_symbols

        v = self.values.cpu().tolist()
        out: dict[str, float] = {}
        for k, name in enumerate(PROPS):
            a, s, n = v[3 * k : 3 * k + 3]
            if n > 0:
                out[f"{prefix}{name}_mae"] = TO_MILLI * a / n
                out[f"{prefix}{name}_rmse"] = TO_MILLI * math.sqrt(s / n)
        for z in range(N_ELEMENTS):
            a, s, n = v[9 + 3 * z : 12 + 3 * z]
            if n > 0:
                out[f"{prefix}forces_mae_{chemical_symbols[z]}"] = TO_MILLI * a / n
                out[f"{prefix}forces_rmse_{chemical_symbols[z]}"] = TO_MILLI * math.sqrt(s / n)
        out.update(_spread_metrics(v[_SPREAD:_SPREAD + 4], prefix))
        if v[-1] > 0:
            out[f"{prefix}loss"] = v[-2] / v[-1]
        return out


#: offset of the committee's force-spread sums in :attr:`MetricSums.values`
_SPREAD = 9 + 3 * N_ELEMENTS


def _spread_metrics(sums: list[float], prefix: str) -> dict[str, float]:
    """``forces_std_mean`` (meV/Å, the mean per-atom ``forces_std`` as the committee
    predicts it), ``forces_calibration`` (``c = sqrt(Σ|e|² / Σσ²)``, the factor that would
    calibrate the spread on these data, as :func:`~xnn.training.committee.
    calibration_factor` fits it) and ``forces_std_calibrated_mean`` (``c`` times the mean,
    meV/Å); empty without spread."""
    s, s2, e2, n = sums
    if n <= 0:
        return {}
    out = {f"{prefix}forces_std_mean": TO_MILLI * s / n}
    if s2 > 0:
        c = math.sqrt(e2 / s2)
        out[f"{prefix}forces_calibration"] = c
        out[f"{prefix}forces_std_calibrated_mean"] = TO_MILLI * c * s / n
    return out
