"""Reciprocal-space (k-space) parts of Ewald and PME, composed from torch-pme's pieces.

Every function takes the atoms of ONE periodic system and a ``global_sum`` callable. All
sums over atoms that the k-space energy needs pass through ``global_sum``, in ONE call per
system: the structure factors ``S(k) = sum_i q_i exp(i k.r_i)`` (Ewald) or the charge mesh
(PME), concatenated with the scalar moments (total charge Q, dipole M_z, sum q z^2) of the
background and slab terms. In one
process ``global_sum`` is the identity. A domain-decomposition layer can make the k-space
part exact across ranks by (1) passing each rank's OWNED atoms only, and (2) replacing
``global_sum`` by a differentiable all-reduce (sum) over ranks; every rank then holds the
full structure factors / mesh and interpolates the potential back at its own atoms.

Returned potentials are the electrostatic potential ``phi_i`` (eV/e with the prefactor),
so that the k-space energy is ``1/2 sum_i q_i phi_i``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torchpme.lib import generate_kvectors_for_ewald
from torchpme.lib.kvectors import get_ns_mesh

GlobalSum = Callable[[Tensor], Tensor]


def _height(pos: Tensor, cell: Tensor, periodic: Tensor) -> Tensor:
    """``z [n]`` (Å): the coordinate along the unit normal of the two periodic vectors
    (pointing like the third). It is unchanged by a move along a periodic vector, strained
    or not, so the slab term and its strain derivative do not depend on which periodic
    image of an atom is given (``z`` is the Cartesian z for a cell with ``a, b`` in the
    x-y plane)."""
    axis = int(torch.nonzero(~periodic).flatten()[0])
    a, b = cell[(axis + 1) % 3], cell[(axis + 2) % 3]
    n = torch.linalg.cross(a, b)
    n = n * torch.sign((n * cell[axis]).sum()) / torch.linalg.norm(n)
    return pos @ n


def _moments(q: Tensor, pos: Tensor, cell: Tensor, periodic: Tensor, slab: bool) -> Tensor:
    """This rank's scalar moments: ``[Q]``, or ``[Q, sum q z, sum q z^2]`` for a slab."""
    total = q.sum().reshape(1)
    if not slab:
        return total
    z = _height(pos, cell, periodic)
    return torch.cat([total, torch.stack([(q * z).sum(), (q * z * z).sum()])])


def _corrections(potential, q: Tensor, cell: Tensor, pos: Tensor, periodic: Tensor,
                 moments: Tensor, slab: bool) -> Tensor:
    """Self, neutralising-background and (2-D) slab terms of ``phi [n]`` from the globally
    summed :func:`_moments`.

    The slab term is torch-pme's ``pbc_correction`` (Yeh–Berkowitz with the
    Ballenegger–Arnold–Cerdà terms for a net charge): ``E = 2 pi / V (M_z^2 - Q sum q z^2
    - Q^2 L_z^2 / 12)``; it is re-assembled here from globally summed moments.
    """
    volume = torch.abs(torch.linalg.det(cell))
    phi = -q * potential.self_contribution()
    total = moments[0]
    phi = phi - 2.0 * potential.background_correction() * total / volume
    if slab:
        axis = int(torch.nonzero(~periodic).flatten()[0])
        z = _height(pos, cell, periodic)
        length = torch.linalg.norm(cell[axis])
        phi = phi + potential.prefactor * (4.0 * torch.pi / volume) * (
            z * moments[1] - 0.5 * (moments[2] + total * z * z) - total / 12.0 * length**2)
    return phi


def _summed(global_sum: GlobalSum, parts: list[Tensor]) -> list[Tensor]:
    """``parts`` summed by ONE call of ``global_sum`` (one all-reduce per evaluation under
    domain decomposition), split back into their shapes."""
    flat = global_sum(torch.cat([p.reshape(-1) for p in parts]))
    sizes = [p.numel() for p in parts]
    return [f.reshape(p.shape) for f, p in zip(torch.split(flat, sizes), parts)]


def ewald_kspace(potential, lr_wavelength: float, q: Tensor, cell: Tensor, pos: Tensor,
                 periodic: Tensor, global_sum: GlobalSum, slab: bool) -> Tensor:
    """Ewald k-space potential ``phi [n]`` of one system (charges ``q [n]`` e, Å)."""
    k_cut = 2.0 * torch.pi / lr_wavelength
    # all k = n b with |n_i| <= k_cut |a_i| / 2 pi (a superset of |k| <= k_cut); torch-pme's
    # generator takes FFT-style counts (-ns/2 .. ns/2), hence 2 n_max + 1
    n_max = torch.ceil(k_cut * torch.linalg.norm(cell.detach(), dim=1) / (2 * torch.pi))
    ns = (2 * n_max + 1).long()
    kvec = generate_kvectors_for_ewald(ns=ns, cell=cell)  # [n_k, 3]
    green = potential.lr_from_k_sq((kvec * kvec).sum(-1))  # [n_k]
    arg = pos @ kvec.T  # [n, n_k]
    cos, sin = torch.cos(arg), torch.sin(arg)
    # structure factors [2, n_k] and the moments, summed over all atoms
    s_k, moments = _summed(global_sum, [torch.stack([q @ cos, q @ sin]),
                                        _moments(q, pos, cell, periodic, slab)])
    volume = torch.abs(torch.linalg.det(cell))
    phi = (cos @ (green * s_k[0]) + sin @ (green * s_k[1])) / volume
    return phi + _corrections(potential, q, cell, pos, periodic, moments, slab)


def pme_kspace(calculator, q: Tensor, cell: Tensor, pos: Tensor, periodic: Tensor,
               global_sum: GlobalSum, slab: bool) -> Tensor:
    """PME k-space potential ``phi [n]``: torch-pme's mesh interpolator and k-space filter
    of ``calculator`` (a ``torchpme.PMECalculator``), with the mesh summed by ``global_sum``
    between spreading and filtering."""
    ns = get_ns_mesh(cell.detach(), calculator.mesh_spacing)
    interp, kfilter = calculator.mesh_interpolator, calculator.kspace_filter
    interp.update(cell, ns)
    kfilter.update(cell, ns)
    interp.compute_weights(pos)
    mesh = interp.points_to_mesh(particle_weights=q[:, None])  # [1, nx, ny, nz]
    mesh, moments = _summed(global_sum, [mesh, _moments(q, pos, cell, periodic, slab)])
    volume = torch.abs(torch.linalg.det(cell))
    phi = interp.mesh_to_points(kfilter.forward(mesh))[:, 0] / volume
    return phi + _corrections(calculator.potential, q, cell, pos, periodic, moments, slab)
